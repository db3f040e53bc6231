#!/usr/bin/env python
"""Train a ControlNet for Stable Diffusion 1.x from (image, conditioning image, caption) triples, with an optional EMA.

    accelerate launch train_controlnet.py \\
      --pretrained_model_name_or_path=stable-diffusion-v1-5/stable-diffusion-v1-5 \\
      --dataset_name=fusing/fill50k --output_dir=out --use_ema \\
      --validation_prompt "red circle with blue background" --validation_image ./conditioning_image_1.png

Without ``--controlnet_model_name_or_path`` the ControlNet starts as a copy of the UNet's encoder.
Only the ControlNet trains. Writes it to ``output_dir`` (and the EMA to ``output_dir/ema``), which
``ControlNetModel.from_pretrained`` loads, validation images with ``validation/log.jsonl``,
checkpoints to resume from, and a model card.
"""

import math
from pathlib import Path

import torch
from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionPipeline
from PIL import Image, UnidentifiedImageError

from training_utils.args import (UsageError, add_diffusion_loss_args, check_args, exit_on_usage_error, require,
                                 training_parser)
from training_utils.data import (PairedImageTransform, TrainDataset, load_train_dataset, make_dataloader, pick_caption,
                                 stack_collate, tokenize)
from training_utils.diffusion import diffusion_loss, prediction_target, sample_noise, sample_timesteps
from training_utils.export import save_model_with_ema
from training_utils.hub import finish_run
from training_utils.loop import TrainingLoop
from training_utils.pipeline import (load_pipeline, prepare_components, trainable_parameters, training_noise_scheduler,
                                     weight_dtype_for)
from training_utils.posthoc_ema import module_export_format
from training_utils.training import (make_accelerator, make_ema, make_lr_scheduler, make_optimizer, make_posthoc_ema,
                                     tracker_config, training_length)
from training_utils.validation import make_validator

HOW_TO_LOAD = """
from diffusers import ControlNetModel, StableDiffusionControlNetPipeline
from diffusers.utils import load_image

controlnet = ControlNetModel.from_pretrained("{output_dir}")  # or "{output_dir}/ema" for the EMA weights
pipe = StableDiffusionControlNetPipeline.from_pretrained("{base_model}", controlnet=controlnet)
image = pipe("{prompt}", image=load_image("{conditioning_image}")).images[0]
"""


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0])
    controlnet = parser.add_argument_group("ControlNet")
    controlnet.add_argument("--controlnet_model_name_or_path", default=None,
                            help="ControlNet to start from (default: a copy of the UNet's encoder)")
    controlnet.add_argument("--conditioning_image_column", default="conditioning_image")
    controlnet.add_argument("--validation_image", nargs="+", default=None,
                            help="conditioning images: one per --validation_prompt, one for all prompts, "
                                 "or several for one prompt")
    controlnet.add_argument("--proportion_empty_prompts", type=float, default=0.0,
                            help="fraction of captions replaced by the empty prompt")
    controlnet.add_argument("--tracker_project_name", default="train_controlnet")
    add_diffusion_loss_args(parser)
    args = parser.parse_args(argv)
    check_args(args)
    require(0 <= args.proportion_empty_prompts <= 1, "--proportion_empty_prompts", args.proportion_empty_prompts,
            "a number in [0, 1]")
    if args.controlnet_model_name_or_path and Path(args.controlnet_model_name_or_path).exists():
        require((Path(args.controlnet_model_name_or_path) / "config.json").is_file(),
                "--controlnet_model_name_or_path", args.controlnet_model_name_or_path,
                "a ControlNetModel folder (with config.json) or a hub id")
    return args


def load_validation_pairs(args):
    """``[(prompt, conditioning image)]``: prompts and images paired one to one, or one of them shared by all."""
    prompts, paths = args.validation_prompt or [], args.validation_image or []
    paired = len(prompts) == len(paths) or 1 in (len(prompts), len(paths))
    if not paired or bool(prompts) != bool(paths):
        raise UsageError("--validation_image", paths, f"one conditioning image per --validation_prompt "
                         f"({len(prompts)}), or one image for all prompts")
    images = {}
    for path in paths:
        try:
            with Image.open(path) as image:
                images[path] = image.convert("RGB")
        except (FileNotFoundError, IsADirectoryError, UnidentifiedImageError):
            raise UsageError("--validation_image", path, "an existing image file") from None
    count = max(len(prompts), len(paths))
    return [(prompts[i % len(prompts)], images[paths[i % len(paths)]]) for i in range(count)]


def cast_residuals_to_unet_dtype(unet, args, kwargs):
    """A UNet forward pre-hook: the ControlNet's residuals in the frozen UNet's dtype, in training and validation alike.

    Under mixed precision the prepared ControlNet returns fp32 (accelerate's output wrapper); CUDA's
    autocast copes with fp32 residuals in a half-precision UNet, the CPU's does not.
    """
    if kwargs.get("mid_block_additional_residual") is not None:
        kwargs["mid_block_additional_residual"] = kwargs["mid_block_additional_residual"].to(unet.dtype)
        kwargs["down_block_additional_residuals"] = [
            residual.to(unet.dtype) for residual in kwargs["down_block_additional_residuals"]]
    return args, kwargs


def main(args):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, {"--image_column": args.image_column, "--caption_column": args.caption_column,
                                        "--conditioning_image_column": args.conditioning_image_column})
    validation_pairs = load_validation_pairs(args)
    accelerator = make_accelerator(args)

    # 2. The pipeline, once, with the ControlNet among its components.
    if args.controlnet_model_name_or_path:
        controlnet = ControlNetModel.from_pretrained(args.controlnet_model_name_or_path)
        pipe = load_pipeline(StableDiffusionControlNetPipeline, args, controlnet=controlnet)
    else:
        sd_pipe = load_pipeline(StableDiffusionPipeline, args)
        # The conditioning embedding must shrink the image as much as the VAE does (8x: SD's default 4 blocks).
        embedding_channels = (16, 32, 96, 256)[: int(math.log2(sd_pipe.vae_scale_factor)) + 1]
        controlnet = ControlNetModel.from_unet(sd_pipe.unet, conditioning_embedding_out_channels=embedding_channels)
        pipe = StableDiffusionControlNetPipeline(**sd_pipe.components, controlnet=controlnet,
                                                 requires_safety_checker=sd_pipe.config.requires_safety_checker)
        pipe.set_progress_bar_config(disable=True)
    unet, vae, text_encoder, tokenizer = pipe.unet, pipe.vae, pipe.text_encoder, pipe.tokenizer
    noise_scheduler = training_noise_scheduler(pipe, prediction_type=args.prediction_type)

    # 3. Only the ControlNet trains; the UNet, VAE and text encoder are frozen. The EMA tracks the ControlNet.
    trained = {"controlnet": controlnet}
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    prepare_components(pipe, trained, accelerator.device, weight_dtype)
    if args.gradient_checkpointing:
        controlnet.enable_gradient_checkpointing()
    unet.register_forward_pre_hook(cast_residuals_to_unet_dtype, with_kwargs=True)
    parameters = trainable_parameters(trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, module_export_format(trained))

    # 4. Data, optimizer and schedule; then accelerate, and resume if asked.
    transform = PairedImageTransform(args.resolution, args.center_crop, args.random_flip)

    def preprocess(example, generator):
        pixel_values, conditioning_pixel_values, _, _ = transform(
            example[args.image_column], example[args.conditioning_image_column], generator)
        caption = pick_caption(example[args.caption_column], generator)
        if torch.rand((), generator=generator) < args.proportion_empty_prompts:
            caption = ""
        return {"pixel_values": pixel_values, "conditioning_pixel_values": conditioning_pixel_values,
                "input_ids": tokenize(tokenizer, caption)[0]}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(dataset, preprocess, args.seed), args.train_batch_size, args.dataloader_num_workers,
        stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters.values(), accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    controlnet, optimizer, lr_scheduler = accelerator.prepare(controlnet, optimizer, lr_scheduler)

    prompts, conditioning_images = zip(*validation_pairs) if validation_pairs else ([], [])
    validator = make_validator(
        args, pipe, accelerator, prompts, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
        weight_dtype=weight_dtype, call_kwargs={"height": args.resolution, "width": args.resolution},
        prompt_kwargs=[{"image": image} for image in conditioning_images], conditioning_images=conditioning_images)
    loop = TrainingLoop(accelerator, args, dataloader, optimizer, lr_scheduler, parameters, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: the denoising loss through the ControlNet-guided UNet; after each optimizer step the
    # loop updates the EMA, checkpoints and validates when due (the final step included, once).
    controlnet.train()
    for batch in loop:
        with accelerator.accumulate(controlnet):
            latents = vae.encode(batch["pixel_values"].to(weight_dtype)).latent_dist.sample()
            latents = latents * vae.config.scaling_factor
            noise = sample_noise(latents, args.noise_offset)
            timesteps = sample_timesteps(noise_scheduler, latents.shape[0], latents.device)
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
            # The ControlNet turns the conditioning image into residuals for the frozen UNet's skip connections.
            down_residuals, mid_residual = controlnet(
                noisy_latents, timesteps, encoder_hidden_states,
                controlnet_cond=batch["conditioning_pixel_values"].to(weight_dtype), return_dict=False)
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False,
                              down_block_additional_residuals=down_residuals,
                              mid_block_additional_residual=mid_residual)[0]
            target = prediction_target(noise_scheduler, latents, noise, timesteps)
            loss = diffusion_loss(model_pred, target, noise_scheduler, timesteps, args.snr_gamma)

            loop.backward_and_step(loss)

    # 6. Save the raw and EMA ControlNet from memory, check the files against it, and write the model card.
    if accelerator.is_main_process:
        output_dir = Path(args.output_dir)
        paths = save_model_with_ema(trained["controlnet"], output_dir, ema, output_dir / "ema")
        saved = {f"{variant} ControlNet": path for variant, path in paths.items()}
        how_to_load = HOW_TO_LOAD.format(
            base_model=args.pretrained_model_name_or_path, output_dir=args.output_dir,
            prompt=args.validation_prompt[0] if args.validation_prompt else "a photo",
            conditioning_image=args.validation_image[0] if args.validation_image else "conditioning.png")
        finish_run(args, "ControlNet", how_to_load, validator.card_records(loop.records) if validator else [], saved)
    accelerator.end_training()


if __name__ == "__main__":
    with exit_on_usage_error():
        main(parse_args())
