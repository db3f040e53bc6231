#!/usr/bin/env python
# Copied from examples/text_to_image/train_text_to_image.py; tests/test_drift.py keeps what they share alike.
"""Train an unconditional DDPM UNet in pixel space from scratch (or on from a DDPM pipeline), with an optional EMA.

    accelerate launch train_unconditional.py \\
      --dataset_name=huggan/flowers-102-categories --resolution=64 --output_dir=ddpm-ema-flowers-64 \\
      --train_batch_size=16 --num_epochs=100 --use_ema --learning_rate=1e-4 --lr_warmup_steps=500

The UNet is a fresh ``UNet2DModel`` of upstream's default configuration at ``--resolution``, or of
``--model_config_name_or_path``'s config; the noise schedule is ``--ddpm_num_steps`` of ``--ddpm_beta_schedule``
(or, with ``--pretrained_model_name_or_path``, that pipeline's UNet and schedule, trained on). Writes a
``DDPMPipeline`` folder holding the trained UNet to ``output_dir`` (``DDPMPipeline.from_pretrained`` loads it; also
at the end of every ``--save_model_epochs``-th epoch) and, with ``--use_ema``, the EMA UNet to ``output_dir/ema/unet``;
validation images (``--num_validation_images`` a batch, upstream's ``--eval_batch_size``, in
``--validation_inference_steps`` DDPM steps, upstream's ``--ddpm_num_inference_steps``) every ``--validation_steps``
or ``--validation_epochs`` (upstream's ``--save_images_epochs``) and at the final step, raw and EMA, with
``validation/log.jsonl``; checkpoints to resume from, and a model card. The EMA's decay warms up as upstream's does
(``--ema_inv_gamma``, ``--ema_power``, up to ``--ema_max_decay``).
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import check_args, fill_dependent_defaults, training_parser
from training_utils.compile import compile_repeated_blocks
from training_utils.data.datasets import TrainDataset, load_train_dataset, make_dataloader, stack_collate
from training_utils.data.images import ImageTransform
from training_utils.diffusion import diffusion_loss, sample_noise, sample_timesteps, snr
from training_utils.ema import make_ema
from training_utils.errors import UsageError, require
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import PipelineExport, save_with_ema
from training_utils.outputs.hub import finish_run
from training_utils.outputs.run_status import run_script
from training_utils.parser import add_refused_args
from training_utils.pipeline import (load_pipeline, prepare_components, trainable_parameters, training_noise_scheduler,
                                     weight_dtype_for)
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.validation import make_validator

# The flags of upstream's script that this one does not carry, besides those no script here carries; and the shared
# flags that an unconditional model in pixel space has no use for.
NO_PROMPTS = "an unconditional model renders and trains without prompts"
REFUSED = {
    "--preserve_input_precision": "images are read as 8-bit RGB (16-bit and float images scaled to 8 bits), as in "
                                  "every script here",
    **dict.fromkeys(["--validation_prompt", "--caption_column", "--caption_dropout", "--proportion_empty_prompts"],
                    NO_PROMPTS),
    **dict.fromkeys(["--validation_guidance_scale", "--validation_true_cfg_scale"],
                    "DDPMPipeline renders without guidance"),
    **dict.fromkeys(["--validation_height", "--validation_width", "--use_aspect_ratio_buckets",
                     "--aspect_ratio_buckets"],
                    "the UNet trains and renders at --resolution squares (its sample_size)"),
}
# Upstream's default UNet (its model at 64 px has six resolutions, attention at the 16 px one); sample_size is
# --resolution.
DEFAULT_UNET = {"in_channels": 3, "out_channels": 3, "layers_per_block": 2,
                "block_out_channels": (128, 128, 256, 256, 512, 512),
                "down_block_types": ("DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D",
                                     "DownBlock2D"),
                "up_block_types": ("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D")}
HOW_TO_LOAD = """
from diffusers import DDPMPipeline, UNet2DModel

pipe = DDPMPipeline.from_pretrained("{output_dir}")
{swap_in_ema}image = pipe(num_inference_steps=1000).images[0]
"""
EMA_SWAP = """# the EMA UNet instead of the raw one:
pipe.unet = UNet2DModel.from_pretrained("{output_dir}/ema/unet")
"""


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=1000, resolution=64,
                             optional_pretrained_model="a DDPM pipeline folder or hub id whose UNet and noise schedule "
                                                       "train on (default: a fresh UNet)")
    # Upstream's names and defaults for the shared flags.
    parser.add_argument("--num_epochs", dest="num_train_epochs", type=int, help="upstream's --num_train_epochs")
    parser.add_argument("--logger", dest="report_to", choices=["tensorboard", "wandb"], help="upstream's --report_to")
    parser.add_argument("--eval_batch_size", dest="num_validation_images", type=int,
                        help="upstream's --num_validation_images")
    parser.add_argument("--ddpm_num_inference_steps", dest="validation_inference_steps", type=int,
                        help="upstream's --validation_inference_steps")
    parser.add_argument("--save_images_epochs", dest="validation_epochs", type=int,
                        help="upstream's --validation_epochs")
    parser.add_argument("--ema_max_decay", dest="ema_decay", type=float, help="upstream's --ema_decay")
    parser.set_defaults(num_train_epochs=100, train_batch_size=16, num_validation_images=16, output_dir="ddpm-model-64",
                        lr_scheduler="cosine", lr_warmup_steps=500, adam_beta1=0.95, adam_weight_decay=1e-6,
                        ema_warmup=True, ema_power=3 / 4)
    model = parser.add_argument_group("DDPM")
    model.add_argument("--model_config_name_or_path", default=None,
                       help="a UNet2DModel config (a folder or hub id holding config.json) to build the fresh UNet "
                            "from (default: upstream's default UNet at --resolution)")
    model.add_argument("--ddpm_num_steps", type=int, default=None, help="the noise schedule's steps (default: 1000, "
                                                                         "or the pretrained pipeline's)")
    model.add_argument("--ddpm_beta_schedule", default=None,
                       choices=["linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid"],
                       help="the noise schedule's betas (default: linear, or the pretrained pipeline's)")
    model.add_argument("--prediction_type", default=None, choices=["epsilon", "sample"],
                       help="what the UNet predicts: the noise, or the clean image, with the loss weighted by the "
                            "SNR (default: epsilon, or the pretrained pipeline's)")
    parser.add_argument("--hub_private_repo", action="store_true", help="with --push_to_hub, create a private repo")
    parser.add_argument("--save_model_epochs", type=int, default=10,
                        help="also write the pipeline (and EMA) into --output_dir at the end of every N-th epoch")
    add_refused_args(parser, REFUSED)
    parser.set_defaults(caption_column=None, caption_dropout=0.0)  # what the shared checks read of refused flags
    args = parser.parse_args(argv)
    check_args(args)
    require(args.pretrained_model_name_or_path is None or args.model_config_name_or_path is None,
            "--model_config_name_or_path", args.model_config_name_or_path,
            "no --pretrained_model_name_or_path with it (that pipeline's UNet is the model)")
    require(args.ddpm_num_steps is None or args.ddpm_num_steps > 0, "--ddpm_num_steps", args.ddpm_num_steps,
            "a positive integer")
    require(args.save_model_epochs > 0, "--save_model_epochs", args.save_model_epochs, "a positive integer")
    unet_config(args)  # a config that cannot be read fails here
    fill_dependent_defaults(args)
    return args


def unet_config(args):
    """The fresh UNet's config: ``--model_config_name_or_path``'s, or `DEFAULT_UNET` at ``--resolution``."""
    if args.model_config_name_or_path is None:
        return {**DEFAULT_UNET, "sample_size": args.resolution}
    try:
        return UNet2DModel.load_config(args.model_config_name_or_path, cache_dir=args.cache_dir)
    except (OSError, ValueError) as error:
        raise UsageError("--model_config_name_or_path", args.model_config_name_or_path,
                         f"a folder or hub id holding a UNet2DModel's config.json ({error})") from None


def fresh_pipeline(args):
    """A ``DDPMPipeline`` of a fresh UNet (`unet_config`) and the noise schedule the DDPM flags give."""
    scheduler = DDPMScheduler(num_train_timesteps=args.ddpm_num_steps or 1000,
                              beta_schedule=args.ddpm_beta_schedule or "linear",
                              prediction_type=args.prediction_type or "epsilon")
    pipe = DDPMPipeline(UNet2DModel.from_config(unet_config(args)), scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def trained_pipeline(args, weight_dtype):
    """``--pretrained_model_name_or_path``'s ``DDPMPipeline``, its noise schedule changed where the DDPM flags ask."""
    pipe = load_pipeline(DDPMPipeline, args, weight_dtype, trained_in_fp32=["unet"])
    changed = {name: value for name, value in (("num_train_timesteps", args.ddpm_num_steps),
                                               ("beta_schedule", args.ddpm_beta_schedule)) if value is not None}
    if changed:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, **changed)
    return pipe


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, {"--image_column": args.image_column})
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once: a fresh UNet and noise schedule (or a pretrained DDPM pipeline's). Its UNet is the one
    #    that trains and the one validation renders with; the training noise scheduler is made from its scheduler.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    pipe = fresh_pipeline(args) if args.pretrained_model_name_or_path is None else trained_pipeline(args, weight_dtype)
    unet = pipe.unet
    noise_scheduler = training_noise_scheduler(pipe, prediction_type=args.prediction_type)

    # 3. The whole UNet trains, in fp32; the EMA is made from its live tensors (no second copy from disk).
    trained = {"unet": unet}
    unet.requires_grad_(True)
    prepare_components(pipe, trained, accelerator.device, weight_dtype)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    compile_repeated_blocks(unet, args.torch_compile)
    parameters = trainable_parameters(trained)
    export = PipelineExport(pipe, trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: the images at --resolution in [-1, 1], the pixels the UNet denoises (there is no VAE). Optimizer,
    #    schedule, accelerate; the loop resumes if asked.
    transform = ImageTransform(args.resolution, args.center_crop, args.random_flip,
                               interpolation=args.image_interpolation_mode)

    def preprocess(example, generator):
        return {"image": transform(example[args.image_column], generator).pixels}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(dataset, preprocess, args.seed, args.repeats), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)

    # DDPMPipeline takes no prompt: each validation renders one batch of --num_validation_images.
    validator = make_validator(args, pipe, accelerator, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
                               weight_dtype=weight_dtype)
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: the denoising loss on the images themselves; after each optimizer step the loop updates the EMA,
    # checkpoints and validates when due (the final step included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            images = batch["image"]
            noise = sample_noise(images)
            timesteps = sample_timesteps(noise_scheduler, images.shape[0], images.device)
            output = models["unet"](noise_scheduler.add_noise(images, noise, timesteps), timesteps,
                                    return_dict=False)[0]
            if noise_scheduler.config.prediction_type == "epsilon":
                loss = diffusion_loss(output, noise, noise_scheduler, timesteps)
            else:  # "sample": the clean image, each sample's error weighted by its SNR, as upstream's
                weights = snr(noise_scheduler, timesteps).reshape(-1, 1, 1, 1)
                loss = (weights * (output.float() - images.float()) ** 2).mean()
            stepped = loop.backward_and_step(loss)
        # Upstream's --save_model_epochs: the outputs written at the end of every N-th epoch, the last one's below.
        step = loop.global_step
        if (stepped and accelerator.is_main_process and step < max_train_steps and step % steps_per_epoch == 0
                and (step // steps_per_epoch) % args.save_model_epochs == 0):
            save_with_ema(export, args.output_dir, ema)

    # 6. Save the pipeline with the raw UNet and the EMA UNet from memory, check the files, write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        swap_in_ema = EMA_SWAP.format(output_dir=args.output_dir) if ema is not None else ""
        finish_run(args, "Unconditional DDPM", HOW_TO_LOAD.format(output_dir=args.output_dir, swap_in_ema=swap_in_ema),
                   loop.records, saved, "UNet")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
