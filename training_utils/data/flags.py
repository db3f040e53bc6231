"""The data flags every script shares, each declared here once, with upstream's names.

A script whose data differs in kind gives its own defaults with ``parser.set_defaults`` (DreamBooth and edit scripts:
no ``--caption_column`` unless given, `dreambooth.add_dreambooth_args`) and refuses what it does not read
(`dreambooth.NOT_DREAMBOOTH_DATA`); the flags of its own data (``--instance_data_dir``, ...) are its group's.
"""

from .buckets import add_bucket_args
from .images import INTERPOLATIONS


def add_data_args(parser, resolution=512, interpolation="bilinear"):
    """The data group: where the images and captions come from, how they are laid out, and how they are loaded;
    ``resolution`` and ``interpolation`` are the script's upstream counterpart's defaults."""
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", default=None,
                      help="a datasets hub name or a local dataset folder (DreamBooth and edit scripts: of the "
                           "subject's images, or of targets with references, instead of --instance_data_dir)")
    data.add_argument("--dataset_config_name", default=None, help="the dataset's configuration, if it has several")
    data.add_argument("--train_data_dir", default=None, help="an imagefolder with metadata.jsonl")
    data.add_argument("--image_column", default="image", help="--dataset_name's column of (target) images")
    data.add_argument("--caption_column", default="text",
                      help="--dataset_name's column of captions (an edit's instructions), a string or a list to draw "
                           "one from; DreamBooth and edit scripts take none by default: --instance_prompt is then "
                           "every image's")
    data.add_argument("--max_train_samples", type=int, default=None)
    data.add_argument("--cache_dir", default=None, help="where datasets keeps what it downloads")
    data.add_argument("--resolution", type=int, default=resolution)
    data.add_argument("--center_crop", action="store_true",
                      help="crop the centre instead of a random square (or bucket-shaped rectangle)")
    data.add_argument("--random_flip", action="store_true")
    data.add_argument("--image_interpolation_mode", default=interpolation, choices=list(INTERPOLATIONS),
                      help="the filter that resizes the images (torchvision's names, as upstream's scripts take them)")
    add_bucket_args(data)
    data.add_argument("--repeats", type=int, default=1,
                      help="how many times each training image is seen an epoch (each time with draws of its own)")
    data.add_argument("--caption_dropout", "--proportion_empty_prompts", dest="caption_dropout", type=float,
                      default=0.0, help="the probability that a sample trains on the empty prompt instead of its "
                                        "caption, for classifier-free guidance (never a class image's)")
    data.add_argument("--dataloader_num_workers", type=int, default=0)
    data.add_argument("--skip_corrupt_images", action="store_true",
                      help="train on the next readable sample in place of an image that cannot be read (counted in "
                           "the logs as skipped_images) instead of stopping the run after a checkpoint")
