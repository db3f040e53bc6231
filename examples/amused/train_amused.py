#!/usr/bin/env python
# Copied from examples/text_to_image/train_text_to_image.py; tests/test_drift.py keeps what they share alike.
"""Fine-tune aMUSEd's masked-token transformer (every parameter, or a LoRA with --use_lora), with an optional EMA.

    accelerate launch train_amused.py \\
      --pretrained_model_name_or_path=amused/amused-256 --resolution=256 \\
      --instance_data_dataset=m1guelpf/nouns --image_key=image --prompt_key=text \\
      --output_dir=out --use_ema --validation_prompts "a pixel art character" --validation_steps=100

The frozen VQ-GAN turns each picture (its shorter side resized to ``--resolution``, a random square cropped) into
codebook ids; a cosine-scheduled share of them (at least ``--min_masking_rate``) is replaced by the mask token, and
the transformer learns the masked ids by cross-entropy, conditioned on the frozen CLIP text encoder's penultimate
hidden states and projected embedding and on the picture's original size and crop (``training_utils.amused``).
Writes a full pipeline holding the trained transformer to ``output_dir`` (``AmusedPipeline.from_pretrained`` loads
it; the untouched models are hard-linked from the base) and, with ``--use_ema``, the EMA transformer to
``output_dir/ema/transformer``; with ``--use_lora``, ``pytorch_lora_weights.safetensors`` (and ``ema/``) instead,
which ``pipe.transformer.load_lora_adapter(output_dir, prefix="transformer", weight_name=...)`` loads
(``AmusedPipeline`` has no ``load_lora_weights``; the file keeps ``--lora_alpha`` in its metadata). Validation images
with ``validation/log.jsonl``, checkpoints to resume from, and a model card.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

from pathlib import Path

from diffusers import AmusedPipeline
from PIL import Image

from training_utils import amused
from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.adapters.export import adapter_export
from training_utils.adapters.injection import add_adapter
from training_utils.args import check_args, fill_dependent_defaults, training_parser
from training_utils.compile import compile_repeated_blocks
from training_utils.data.datasets import (TrainDataset, drop_caption, load_train_dataset, make_dataloader, pick_caption,
                                          stack_collate)
from training_utils.ema import make_ema
from training_utils.errors import UsageError, require
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import PipelineExport, save_with_ema
from training_utils.outputs.hub import finish_run
from training_utils.outputs.run_status import run_script
from training_utils.parser import add_refused_args
from training_utils.pipeline import load_pipeline, prepare_components, trainable_parameters, weight_dtype_for
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.validation import make_validator

# The flags of upstream's script that this one does not carry, besides those no script here carries; and the shared
# flags that aMUSEd's data and renders have no use for.
FROZEN_TEXT_ENCODER = "the text encoder stays frozen here (upstream's text-encoder training fails to save and load)"
REFUSED = {
    **dict.fromkeys(["--train_text_encoder", "--text_encoder_use_lora", "--text_encoder_lora_r",
                     "--text_encoder_lora_alpha", "--text_encoder_lora_target_modules"], FROZEN_TEXT_ENCODER),
    "--ema_update_after_step": "the EMA starts at the first optimizer step (--ema_update_every spaces its updates)",
    "--logging_steps": "the loss and learning rate are logged at every optimizer step",
    "--train_data_dir": "aMUSEd's data is --instance_data_dir (captions from the file names), --instance_data_image or "
                        "--instance_data_dataset, as upstream's",
    **dict.fromkeys(["--center_crop", "--random_flip", "--use_aspect_ratio_buckets", "--aspect_ratio_buckets",
                     "--validation_height", "--validation_width"],
                    "aMUSEd trains on random --resolution squares, with their crop as micro-conditioning, and "
                    "renders at --resolution, as upstream's"),
}
HOW_TO_LOAD = """
from diffusers import AmusedPipeline, UVit2DModel

pipe = AmusedPipeline.from_pretrained("{output_dir}")
{swap_in_ema}image = pipe("{prompt}").images[0]
"""
EMA_SWAP = """# the EMA transformer instead of the raw one:
pipe.transformer = UVit2DModel.from_pretrained("{output_dir}/ema/transformer")
"""
LORA_HOW_TO_LOAD = """
from pathlib import Path

from diffusers import AmusedPipeline

pipe = AmusedPipeline.from_pretrained("{base_model}")
# or "{output_dir}/ema" for the EMA adapter
pipe.transformer.load_lora_adapter("{output_dir}", prefix="transformer",
                                   weight_name="pytorch_lora_weights.safetensors")
image = pipe("{prompt}").images[0]
"""


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=12, tracker_project_name="amused")
    data = parser.add_argument_group("aMUSEd data (exactly one source)")
    data.add_argument("--instance_data_dir", default=None,
                      help="a folder of training images, each captioned with its file name without the extension")
    data.add_argument("--instance_data_image", default=None,
                      help="one training image, captioned with its file name without the extension")
    data.add_argument("--instance_data_dataset", dest="dataset_name", default=None,
                      help="a dataset (hub id or folder) of images and captions; --image_key and --prompt_key name "
                           "its columns")
    data.add_argument("--image_key", dest="image_column", default=None, help="upstream's --image_column")
    data.add_argument("--prompt_key", dest="caption_column", default=None, help="upstream's --caption_column")
    data.add_argument("--prompt_prefix", default=None, help="text put before every caption of the dataset")
    parser.add_argument("--cond_dropout_prob", dest="caption_dropout", type=float,
                        help="upstream's --caption_dropout: train on the empty prompt with this probability")
    model = parser.add_argument_group("aMUSEd")
    model.add_argument("--min_masking_rate", type=float, default=0.0,
                       help="the least share of each picture's tokens that is masked")
    model.add_argument("--split_vae_encode", type=int, default=None,
                       help="encode this many pictures at a time with the VQ-GAN (default: the whole batch)")
    model.add_argument("--use_lora", action="store_true", help="train a LoRA on the transformer, not all of it")
    model.add_argument("--lora_r", "--rank", dest="rank", type=int, default=16, help="the LoRA's rank")
    model.add_argument("--lora_alpha", type=float, default=32, help="the LoRA's alpha (its scale is alpha / rank)")
    model.add_argument("--lora_target_modules", nargs="+", default=["to_q", "to_k", "to_v"],
                       help="the transformer's linear layers that get the LoRA, by name")
    parser.set_defaults(learning_rate=3e-4, train_batch_size=16, lr_scheduler="constant", lr_warmup_steps=500,
                        output_dir="muse_training", image_column="image", caption_column="text")
    add_refused_args(parser, REFUSED)
    parser.set_defaults(train_data_dir=None, center_crop=False, random_flip=False, use_aspect_ratio_buckets=False,
                        aspect_ratio_buckets=None, validation_height=None, validation_width=None)
    args = parser.parse_args(argv)
    sources = [flag for flag, value in (("--instance_data_dir", args.instance_data_dir),
                                        ("--instance_data_image", args.instance_data_image),
                                        ("--instance_data_dataset", args.dataset_name)) if value is not None]
    require(len(sources) == 1, "/".join(sources) or "--instance_data_dir", len(sources),
            "exactly one of --instance_data_dir, --instance_data_image and --instance_data_dataset")
    check_args(args)
    require(0 <= args.min_masking_rate <= 1, "--min_masking_rate", args.min_masking_rate, "a number in [0, 1]")
    require(args.split_vae_encode is None or args.split_vae_encode > 0, "--split_vae_encode", args.split_vae_encode,
            "a positive integer")
    require(args.rank > 0, "--lora_r", args.rank, "a positive integer")
    fill_dependent_defaults(args)
    return args


def load_examples(args):
    """The training rows ``{"image", "prompt"}``: upstream's instance folder or image (`amused.instance_examples`),
    or ``--instance_data_dataset``'s columns; checked before any weights load."""
    if args.dataset_name is not None:
        dataset = load_train_dataset(args, {"--image_key": args.image_column, "--prompt_key": args.caption_column})
        return dataset.rename_columns({args.image_column: "image", args.caption_column: "prompt"}) \
            if (args.image_column, args.caption_column) != ("image", "prompt") else dataset
    for flag, path, kind in (("--instance_data_dir", args.instance_data_dir, "an existing folder of images"),
                             ("--instance_data_image", args.instance_data_image, "an existing image file")):
        if path is not None:
            examples = amused.instance_examples(args) if Path(path).exists() else []
            if not examples:
                raise UsageError(flag, path, kind)
            return examples


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    examples = load_examples(args)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once. Its modules are the ones we train and the ones validation renders with; prompts are
    #    encoded as its own call encodes them.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    pipe = load_pipeline(AmusedPipeline, args, weight_dtype, trained_in_fp32=[] if args.use_lora else ["transformer"])
    transformer = pipe.transformer
    mask_id = amused.mask_token_id(transformer)
    tokens_per_side = args.resolution // pipe.vae_scale_factor

    # 3. The whole transformer trains in fp32 (or its LoRA, upstream's layers); the EMA is made from its live tensors.
    trained = {"transformer": transformer}
    if args.use_lora:
        from peft import LoraConfig

        add_adapter(transformer, LoraConfig(r=args.rank, lora_alpha=args.lora_alpha,
                                            target_modules=args.lora_target_modules))
        export = adapter_export(amused.AmusedLoraWriter, trained)
    else:
        transformer.requires_grad_(True)
        export = PipelineExport(pipe, trained)
    prepare_components(pipe, trained, accelerator.device, weight_dtype)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    compile_repeated_blocks(transformer, args.torch_compile)
    parameters = trainable_parameters(trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: each picture resized and randomly cropped, with its micro-conditioning; its caption (upstream's prefix
    #    before a dataset's), the empty one with --cond_dropout_prob. Optimizer, schedule, accelerate; the loop
    #    resumes if asked.
    def preprocess(example, generator):
        image = example["image"]
        pixels, micro_conds = amused.process_image(Image.open(image) if isinstance(image, str) else image,
                                                   args.resolution, generator)
        prompt = pick_caption(example["prompt"], generator)
        if args.prompt_prefix is not None and args.dataset_name is not None:
            prompt = args.prompt_prefix + prompt
        return {"image": pixels, "micro_conds": micro_conds,
                "prompt": drop_caption(prompt, args.caption_dropout, generator)}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(examples, preprocess, args.seed, args.repeats), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes, no_decay=amused.NO_WEIGHT_DECAY)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)

    validator = make_validator(args, pipe, accelerator, ema=ema, posthoc=posthoc, schedulers=[pipe.scheduler],
                               weight_dtype=weight_dtype,
                               call_kwargs={"height": args.resolution, "width": args.resolution})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: the masked tokens' cross-entropy (`amused`); after each optimizer step the loop updates the EMA,
    # checkpoints and validates when due (the final step included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            tokens = amused.image_tokens(pipe.vqvae, batch["image"].to(weight_dtype), args.split_vae_encode)
            input_ids, labels, _ = amused.mask_tokens(tokens, mask_id, args.min_masking_rate)
            hidden_states, pooled = amused.encode_prompt(pipe.text_encoder, pipe.tokenizer, batch["prompt"],
                                                         accelerator.device)
            logits = models["transformer"](input_ids.reshape(-1, tokens_per_side, tokens_per_side),
                                           encoder_hidden_states=hidden_states, pooled_text_emb=pooled,
                                           micro_conds=batch["micro_conds"].to(hidden_states.dtype))
            loop.backward_and_step(amused.token_loss(logits.float(), labels))

    # 6. Save the pipeline with the raw transformer (or the LoRA) and the EMA one from memory, check the files, write
    #    the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        prompt = args.validation_prompt[0] if args.validation_prompt else "a photo"
        if args.use_lora:
            how_to_load = LORA_HOW_TO_LOAD.format(base_model=args.pretrained_model_name_or_path,
                                                  output_dir=args.output_dir, prompt=prompt)
        else:
            swap_in_ema = EMA_SWAP.format(output_dir=args.output_dir) if ema is not None else ""
            how_to_load = HOW_TO_LOAD.format(output_dir=args.output_dir, swap_in_ema=swap_in_ema, prompt=prompt)
        finish_run(args, f"aMUSEd {export.title if args.use_lora else 'fine-tune'}", how_to_load, loop.records,
                   saved, "LoRA" if args.use_lora else "transformer")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
