#!/usr/bin/env python
# Copied from examples/unconditional_image_generation/train_unconditional.py; tests/test_drift.py keeps what they share alike.
"""Train a VQ-GAN (diffusers' VQModel) with its discriminator, from scratch or on from a VQModel, with an optional EMA.

    accelerate launch train_vqgan.py \\
      --dataset_name=cifar10 --image_column=img --resolution=128 --train_batch_size=2 \\
      --gradient_accumulation_steps=8 --validation_images bird.jpg car.jpg --use_ema --output_dir=vqgan-output

The VQModel is a fresh one of upstream's default configuration, or of ``--model_config_name_or_path``'s (or
``--pretrained_model_name_or_path``'s, trained on); the discriminator a fresh `training_utils.vqgan.Discriminator` of
``--discriminator_config_name_or_path``'s configuration (upstream's files fit). The steps take turns, as upstream's:
odd steps train the VQModel on the pixels (``--vae_loss``), timm's VGG features (``--timm_model_backend``, read
from its safetensors file without timm), the quantizer's commitment and the adaptively weighted adversarial loss;
even steps train the discriminator (hinge loss, gradient penalty), each network with its own optimizer
(``--learning_rate``, ``--discr_learning_rate``) and schedule (``--lr_scheduler``, ``--discr_lr_scheduler``). Images
are in [-1, 1], as every diffusers autoencoder takes them. Writes the VQModel to ``output_dir``
(``VQModel.from_pretrained`` loads it), the EMA's to ``output_dir/ema`` with ``--use_ema``, and the discriminator to
``output_dir/discriminator``; reconstructions of ``--validation_images`` (each shown beside its original, raw and
EMA) every ``--validation_steps`` and at the final step with ``validation/log.jsonl``; checkpoints holding both
networks, both optimizers and schedules and the EMA, to resume exactly; and a model card.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import copy
import inspect
from pathlib import Path

import torch
from diffusers import VQModel

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import check_args, fill_dependent_defaults, training_parser
from training_utils.compile import compile_repeated_blocks
from training_utils.data.datasets import TrainDataset, load_train_dataset, make_dataloader, stack_collate
from training_utils.data.images import ImageTransform
from training_utils.ema import make_ema
from training_utils.errors import UsageError, require
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import ModelExport, save_with_ema
from training_utils.outputs.hub import finish_run
from training_utils.outputs.run_status import run_script
from training_utils.outputs.writing import save_model
from training_utils.parser import add_refused_args
from training_utils.pipeline import is_hub_id, prepare_components, trainable_parameters, weight_dtype_for
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.sharding.fsdp2 import fsdp_requested
from training_utils.validation import make_validator
from training_utils.vqgan import (Discriminator, VQReconstructionPipeline, adaptive_weight, check_vgg_source,
                                  discriminator_loss, frozen, load_config_file, load_vgg, perceptual_loss,
                                  reconstruction_loss, to_pil, vgg_taps)

# The flags of upstream's script that this one does not carry, besides those no script here carries; and the shared
# flags that a VQ-GAN, which reconstructs images, has no use for.
RECONSTRUCTS = "a VQ-GAN's validation reconstructs --validation_images, once each (a reconstruction draws nothing)"
REFUSED = {
    "--log_steps": "the losses and learning rate are logged at every optimizer step",
    "--log_grad_norm_steps": "gradient norms are not logged per parameter; the losses are logged at every step",
    "--non_ema_revision": "the EMA starts from the VQModel as loaded (--revision)",
    "--prediction_type": "a VQ-GAN reconstructs its input: it predicts nothing else",
    **dict.fromkeys(["--validation_prompt", "--num_validation_images", "--validation_inference_steps",
                     "--validation_guidance_scale", "--validation_true_cfg_scale"], RECONSTRUCTS),
    **dict.fromkeys(["--caption_column", "--caption_dropout", "--proportion_empty_prompts"],
                    "a VQ-GAN trains on images alone, without captions"),
    **dict.fromkeys(["--validation_height", "--validation_width", "--use_aspect_ratio_buckets",
                     "--aspect_ratio_buckets"], "images train and are reconstructed as --resolution squares"),
}
# Upstream's default VQModel: Kandinsky 2.2's MoVQ without its attention blocks.
DEFAULT_VQMODEL = {"act_fn": "silu", "block_out_channels": [128, 256, 512],
                   "down_block_types": ["DownEncoderBlock2D"] * 3, "up_block_types": ["UpDecoderBlock2D"] * 3,
                   "in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 2,
                   "norm_num_groups": 32, "norm_type": "spatial", "num_vq_embeddings": 16384, "sample_size": 32,
                   "scaling_factor": 0.18215, "vq_embed_dim": 4}
HOW_TO_LOAD = """
from diffusers import VQModel

vqmodel = VQModel.from_pretrained("{output_dir}")  # {ema}
reconstruction = vqmodel(images).sample  # images: (batch, 3, height, width) in [-1, 1]
"""


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], resolution=512, tracker_project_name="vqgan-training",
                             optional_pretrained_model="a VQModel folder or hub id to train on (default: a fresh "
                                                       "VQModel)")
    parser.set_defaults(output_dir="vqgan-output", train_batch_size=16, num_train_epochs=100, lr_warmup_steps=500)
    model = parser.add_argument_group("VQ-GAN")
    model.add_argument("--model_config_name_or_path", default=None,
                       help="a VQModel config (a json file, or a folder or hub id holding config.json) to build the "
                            "fresh VQModel from (default: upstream's)")
    model.add_argument("--discriminator_config_name_or_path", default=None,
                       help="the discriminator's config (a json file, or a folder holding config.json: in_channels, "
                            "cond_channels, hidden_channels, depth; default: upstream's)")
    model.add_argument("--discr_learning_rate", type=float, default=1e-4, help="the discriminator's learning rate")
    model.add_argument("--discr_lr_scheduler", default="constant",
                       choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                                "constant_with_warmup"], help="the discriminator's learning-rate schedule")
    model.add_argument("--vae_loss", default="l2", choices=["l2", "l1"], help="the pixels' reconstruction loss")
    model.add_argument("--timm_model_backend", default="vgg19",
                       help="the VGG of the perceptual loss: vgg11, vgg13, vgg16 or vgg19 (timm's ImageNet weights "
                            "from the hub), a hub id or a local safetensors file of timm's VGG layout")
    model.add_argument("--timm_model_layers", default="head",
                       help="which VGG features the perceptual loss compares, as upstream names them: children of "
                            "timm's VGG (features, pre_logits, head) separated by |, each the feature map of its "
                            "index less --timm_model_offset (head: the ReLU before the third max pool)")
    model.add_argument("--timm_model_offset", type=int, default=0, help="see --timm_model_layers")
    parser.add_argument("--validation_images", nargs="+", default=None,
                        help="images reconstructed at every validation (none: no validation)")
    add_refused_args(parser, REFUSED)
    # What the shared checks and the validator read of the refused flags.
    parser.set_defaults(validation_prompt=None, num_validation_images=1, validation_inference_steps=1,
                        validation_guidance_scale=None, validation_true_cfg_scale=None, caption_column=None,
                        caption_dropout=0.0, validation_height=None, validation_width=None,
                        use_aspect_ratio_buckets=False, aspect_ratio_buckets=None)
    args = parser.parse_args(argv)
    require(not fsdp_requested(), "--use_fsdp", True,
            "an unsharded launch: the discriminator and the VGG are not sharded here")
    # --pretrained_model_name_or_path is a VQModel here, not a pipeline: checked below, not as a pipeline folder.
    shared = copy.copy(args)
    shared.pretrained_model_name_or_path = None
    check_args(shared)
    require(args.pretrained_model_name_or_path is None or args.model_config_name_or_path is None,
            "--model_config_name_or_path", args.model_config_name_or_path,
            "no --pretrained_model_name_or_path with it (that VQModel is the model)")
    require(args.discr_learning_rate > 0, "--discr_learning_rate", args.discr_learning_rate, "a positive number")
    config = vqmodel_config(args)  # a config that cannot be read fails here
    require(config.get("_class_name", "VQModel") == "VQModel", "--model_config_name_or_path",
            args.model_config_name_or_path, f"a VQModel's config, not a {config.get('_class_name')}'s")
    require(config.get("in_channels", 3) == 3 and config.get("out_channels", 3) == 3,
            "--model_config_name_or_path", args.pretrained_model_name_or_path or args.model_config_name_or_path,
            "a VQModel of RGB images (3 channels in and out)")
    factor = 2 ** (len(config.get("block_out_channels", [64])) - 1)
    require(args.resolution % factor == 0, "--resolution", args.resolution,
            f"a multiple of {factor}, the VQModel's downsampling")
    depth = discriminator_config(args).get("depth", inspect.signature(Discriminator).parameters["depth"].default)
    require(args.resolution >= 2 ** (depth + 1), "--resolution", args.resolution,
            f"at least {2 ** (depth + 1)}: the discriminator halves it {depth} times, down to 2 pixels at least "
            f"(its instance norm needs more than one)")
    check_vgg_source(args.timm_model_backend)
    require(all(tap >= 0 for tap in vgg_taps(args.timm_model_layers, args.timm_model_offset)), "--timm_model_offset",
            args.timm_model_offset, "an offset that leaves every --timm_model_layers index non-negative")
    fill_dependent_defaults(args)
    return args


def vqmodel_config(args):
    """The VQModel's config: ``--pretrained_model_name_or_path``'s or ``--model_config_name_or_path``'s, or
    `DEFAULT_VQMODEL`."""
    if args.pretrained_model_name_or_path is not None:
        path = args.pretrained_model_name_or_path
        require(Path(path).is_dir() and (Path(path) / "config.json").is_file() if Path(path).exists()
                else is_hub_id(path), "--pretrained_model_name_or_path", path,
                "a VQModel folder (with config.json) or a hub id")
        return load_config_file(VQModel, path, "--pretrained_model_name_or_path", args.cache_dir)
    if args.model_config_name_or_path is None:
        return DEFAULT_VQMODEL
    return load_config_file(VQModel, args.model_config_name_or_path, "--model_config_name_or_path", args.cache_dir)


def discriminator_config(args):
    """The discriminator's config: ``--discriminator_config_name_or_path``'s, or the default one."""
    if args.discriminator_config_name_or_path is None:
        return {}
    config = load_config_file(Discriminator, args.discriminator_config_name_or_path,
                              "--discriminator_config_name_or_path", args.cache_dir)
    require(config.get("_class_name", "Discriminator") == "Discriminator", "--discriminator_config_name_or_path",
            args.discriminator_config_name_or_path, f"a Discriminator's config, not a {config.get('_class_name')}'s")
    return config


def load_validation_images(args):
    """``[(name, pixels)]`` of ``--validation_images``: each its shorter side resized to ``--resolution`` and
    center-cropped square, in [-1, 1]."""
    transform = ImageTransform(args.resolution, center_crop=True, interpolation=args.image_interpolation_mode)
    images = []
    for path in args.validation_images or ():
        try:
            images.append((path, transform(path, None).pixels))
        except (OSError, ValueError) as error:
            raise UsageError("--validation_images", path, f"readable images ({error})") from None
    return images


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, {"--image_column": args.image_column})
    validation_images = load_validation_images(args)
    accelerator = make_accelerator(args, run)

    # 2. The VQModel, once (fresh, or as loaded), in the pipeline that reconstructs the validation images; the
    #    discriminator, fresh; the frozen VGG of the perceptual loss.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    if args.pretrained_model_name_or_path is None:
        vqmodel = VQModel.from_config(vqmodel_config(args))
    else:
        vqmodel = VQModel.from_pretrained(args.pretrained_model_name_or_path, revision=args.revision,
                                          variant=args.variant, cache_dir=args.cache_dir)
    pipe = VQReconstructionPipeline(vqmodel)
    pipe.set_progress_bar_config(disable=True)
    discriminator = Discriminator.from_config(discriminator_config(args))
    vgg = load_vgg(args.timm_model_backend, vgg_taps(args.timm_model_layers, args.timm_model_offset),
                   args.cache_dir).to(accelerator.device, weight_dtype)

    # 3. The whole VQModel trains, in fp32, and its EMA is made from its live tensors; the discriminator trains beside
    #    it (checkpoints hold it whole) and is written too, but it is not the output.
    trained = {"vqmodel": vqmodel}
    vqmodel.requires_grad_(True)
    prepare_components(pipe, trained, accelerator.device, weight_dtype)
    discriminator.to(accelerator.device).train()
    if args.gradient_checkpointing:
        vqmodel.enable_gradient_checkpointing()
    compile_repeated_blocks(vqmodel, args.torch_compile)
    parameters = trainable_parameters(trained)
    discriminator_parameters = trainable_parameters({"discriminator": discriminator})
    export = ModelExport.of(trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: the images at --resolution in [-1, 1]. An optimizer and a schedule per network, each as long as its
    #    own steps (the odd steps are the VQModel's, the even ones the discriminator's); accelerate; the loop resumes.
    transform = ImageTransform(args.resolution, args.center_crop, args.random_flip,
                               interpolation=args.image_interpolation_mode)

    def preprocess(example, generator):
        return {"image": transform(example[args.image_column], generator).pixels}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(dataset, preprocess, args.seed, args.repeats), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    processes = accelerator.num_processes
    optimizer = make_optimizer(args, parameters, processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, (max_train_steps + 1) // 2, processes)
    discriminator_optimizer = make_optimizer(args, discriminator_parameters, processes,
                                             learning_rate=args.discr_learning_rate)
    discriminator_lr_scheduler = make_lr_scheduler(args, discriminator_optimizer, max_train_steps // 2, processes,
                                                   schedule=args.discr_lr_scheduler)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    scoring, discriminator_optimizer, discriminator_lr_scheduler = accelerator.prepare(
        discriminator, discriminator_optimizer, discriminator_lr_scheduler)

    # Each validation image is a "prompt" of one reconstruction, shown beside its original.
    validator = make_validator(args, pipe, accelerator, prompts=[name for name, _ in validation_images], ema=ema,
                               posthoc=posthoc, weight_dtype=weight_dtype,
                               prompt_kwargs=[{"image": pixels} for _, pixels in validation_images],
                               conditioning_images=[to_pil(pixels[None])[0] for _, pixels in validation_images],
                               conditioning_label="original")
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator,
                        companions={"discriminator": discriminator})
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: the steps take turns between the networks; after each optimizer step the loop updates the EMA,
    #    checkpoints and validates when due (the final step included, once).
    models["vqmodel"].train()
    last_decoder_layer = vqmodel.decoder.conv_out.weight
    for batch in loop:
        images = batch["image"]
        if loop.global_step % 2 == 0:  # the VQModel's step (the 1st, 3rd, ...)
            with accelerator.accumulate(models["vqmodel"]):
                reconstructions, commit_loss = models["vqmodel"](images, return_dict=False)
                pixels = reconstruction_loss(images, reconstructions, args.vae_loss)
                perceptual = perceptual_loss(vgg, images, reconstructions)
                with frozen(discriminator):
                    adversarial = -discriminator(reconstructions).mean()
                weight = adaptive_weight(perceptual, adversarial, last_decoder_layer)
                loss = pixels + commit_loss + perceptual + weight * adversarial
                losses = {"reconstruction_loss": pixels, "perceptual_loss": perceptual, "commit_loss": commit_loss,
                          "generator_loss": adversarial, "adaptive_weight": weight}
                stepped = loop.backward_and_step(loss)
        else:  # the discriminator's
            with accelerator.accumulate(scoring):
                with torch.no_grad():
                    reconstructions = models["vqmodel"](images).sample
                loss, penalty = discriminator_loss(scoring, images, reconstructions)
                losses = {"discriminator_loss": loss, "gradient_penalty": penalty}
                stepped = loop.backward_and_step(loss, discriminator_optimizer, discriminator_lr_scheduler,
                                                 list(discriminator_parameters.values()))
        if stepped:
            accelerator.log({name: value.item() for name, value in losses.items()}, step=loop.global_step)

    # 6. Save the raw VQModel and the EMA's from memory, checked against it, and the discriminator; the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        discriminator_folder = save_model(discriminator, Path(args.output_dir) / "discriminator")
        ema_note = f'or "{args.output_dir}/ema" for the EMA' if ema is not None else ""
        finish_run(args, "VQ-GAN", HOW_TO_LOAD.format(output_dir=args.output_dir, ema=ema_note), loop.records, saved,
                   "VQModel")
        print(f"discriminator: {discriminator_folder}")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
