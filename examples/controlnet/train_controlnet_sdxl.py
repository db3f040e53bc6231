#!/usr/bin/env python
"""Train a ControlNet for Stable Diffusion XL from (image, conditioning image, caption) triples, with an optional EMA.

    accelerate launch train_controlnet_sdxl.py \\
      --pretrained_model_name_or_path=stabilityai/stable-diffusion-xl-base-1.0 \\
      --pretrained_vae_model_name_or_path=madebyollin/sdxl-vae-fp16-fix \\
      --dataset_name=fusing/fill50k --output_dir=out --resolution=1024 --use_ema \\
      --validation_prompt "red circle with blue background" --validation_image ./conditioning_image_1.png

Without ``--controlnet_model_name_or_path`` the ControlNet starts as a copy of the UNet's encoder.
Only the ControlNet trains. The frozen text encoders run once per distinct caption before training, and
with ``--cache_latents`` (which needs ``--center_crop``) the VAE runs once per image (both flips); the
conditioning images are not cached, since the ControlNet reads them.

SDXL's own VAE overflows in fp16: with ``--mixed_precision fp16`` pass an fp16-safe one (as above),
which replaces the pipeline's for training and validation alike, or train in bf16.

Writes the ControlNet to ``output_dir`` (and the EMA to ``output_dir/ema``), which
``ControlNetModel.from_pretrained`` loads, validation images with ``validation/log.jsonl``,
checkpoints to resume from, and a model card.
"""

from diffusers import StableDiffusionXLControlNetPipeline, StableDiffusionXLPipeline

from training_utils.args import (add_cache_args, add_diffusion_loss_args, check_args, exit_on_usage_error,
                                 training_parser)
from training_utils.cache import DatasetLatents, cache_text_embeddings, distinct_captions, offload, sample_latents
from training_utils.controlnet import (add_controlnet_args, cast_residuals_to_unet_dtype, check_controlnet_args,
                                       dataset_columns, finish_controlnet_run, load_controlnet_pipeline,
                                       load_validation_pairs, make_controlnet_validator, pick_training_caption)
from training_utils.data import PairedImageTransform, TrainDataset, load_train_dataset, make_dataloader, stack_collate
from training_utils.diffusion import diffusion_loss, prediction_target, sample_noise, sample_timesteps
from training_utils.loop import TrainingLoop
from training_utils.pipeline import (prepare_components, trainable_parameters, training_noise_scheduler,
                                     weight_dtype_for)
from training_utils.posthoc_ema import module_export_format
from training_utils.sdxl import add_vae_args, check_vae_path, encode_prompt, time_ids, tokenize_prompt, vae_components
from training_utils.training import (end_training, make_accelerator, make_ema, make_lr_scheduler, make_optimizer,
                                     make_posthoc_ema, tracker_config, training_length)

HOW_TO_LOAD = """
from diffusers import {classes}
from diffusers.utils import load_image

controlnet = ControlNetModel.from_pretrained("{output_dir}")  # or "{output_dir}/ema" for the EMA weights
pipe = StableDiffusionXLControlNetPipeline.from_pretrained("{base_model}", controlnet=controlnet{vae})
image = pipe("{prompt}", image=load_image("{conditioning_image}")).images[0]
"""


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0])
    add_vae_args(parser)
    add_controlnet_args(parser, tracker_project_name="sd_xl_train_controlnet")
    add_diffusion_loss_args(parser)
    add_cache_args(parser)
    args = parser.parse_args(argv)
    check_args(args)
    check_vae_path(args.pretrained_vae_model_name_or_path)
    check_controlnet_args(args)
    return args


def main(args):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, dataset_columns(args))
    validation_pairs = load_validation_pairs(args)
    accelerator = make_accelerator(args)

    # 2. The pipeline, once (with the replacement VAE, if any), with the ControlNet among its components
    # (without --controlnet_model_name_or_path, one made from the loaded UNet's encoder).
    pipe = load_controlnet_pipeline(StableDiffusionXLControlNetPipeline, StableDiffusionXLPipeline, args,
                                    **vae_components(args.pretrained_vae_model_name_or_path))
    if args.pretrained_vae_model_name_or_path:
        accelerator.print(f"VAE: {args.pretrained_vae_model_name_or_path}")
    controlnet, unet, vae = pipe.controlnet, pipe.unet, pipe.vae
    text_encoders, tokenizers = [pipe.text_encoder, pipe.text_encoder_2], [pipe.tokenizer, pipe.tokenizer_2]
    noise_scheduler = training_noise_scheduler(pipe, prediction_type=args.prediction_type)

    # 3. Only the ControlNet trains; the UNet, VAE and both text encoders are frozen. The EMA tracks the ControlNet.
    trained = {"controlnet": controlnet}
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    prepare_components(pipe, trained, accelerator.device, weight_dtype)
    if args.gradient_checkpointing:
        controlnet.enable_gradient_checkpointing()
    unet.register_forward_pre_hook(cast_residuals_to_unet_dtype, with_kwargs=True)
    parameters = trainable_parameters(trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, module_export_format(trained))

    # 4. Frozen encoders run once, here, never in the step: both text encoders on each distinct caption (and
    #    the empty prompt that --proportion_empty_prompts draws) and, with --cache_latents, the VAE on each
    #    target image (both flips); then they leave the accelerator until validation. The conditioning image
    #    is not cached: the ControlNet reads it. Data, optimizer and schedule; then accelerate, and resume if asked.
    transform = PairedImageTransform(args.resolution, args.center_crop, args.random_flip)
    cache_batch_size = max(args.train_batch_size, 16)

    def encode_text(captions):
        input_ids = [ids.to(accelerator.device) for ids in tokenize_prompt(tokenizers, captions)]
        return encode_prompt(text_encoders, input_ids)

    captions = distinct_captions([*dataset[args.caption_column], ""])
    embeddings = cache_text_embeddings(captions, encode_text, cache_batch_size)
    cached_encoders = [*text_encoders]
    examples = dataset
    if args.cache_latents:
        latent_cache = DatasetLatents(dataset, args.image_column, transform, vae, accelerator.device, weight_dtype,
                                      cache_batch_size)
        cached_encoders.append(vae)
        examples = latent_cache.examples
    encoders_on_device = offload(cached_encoders, accelerator.device)

    def preprocess(example, generator):
        # SDXL is told each image's original size and where it was cropped (after any flip).
        conditioning_image = example[args.conditioning_image_column]
        if args.cache_latents:
            latent_parameters, conditioning_pixel_values, original_size, crop_top_left = (
                latent_cache.draw_paired(example, conditioning_image, generator))
            target = {"latent_parameters": latent_parameters}
        else:
            pixel_values, conditioning_pixel_values, original_size, crop_top_left = transform(
                example[args.image_column], conditioning_image, generator)
            target = {"pixel_values": pixel_values}
        caption = pick_training_caption(example[args.caption_column], args.proportion_empty_prompts, generator)
        prompt_embeds, pooled = embeddings[caption]
        return {**target, "conditioning_pixel_values": conditioning_pixel_values,
                "prompt_embeds": prompt_embeds, "text_embeds": pooled,
                "time_ids": time_ids(original_size, crop_top_left, (args.resolution, args.resolution))}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(examples, preprocess, args.seed), args.train_batch_size, args.dataloader_num_workers,
        stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters.values(), accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    controlnet, optimizer, lr_scheduler = accelerator.prepare(controlnet, optimizer, lr_scheduler)

    validator = make_controlnet_validator(
        args, pipe, accelerator, validation_pairs, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
        weight_dtype=weight_dtype, render_context=encoders_on_device,
        call_kwargs={"height": args.resolution, "width": args.resolution})
    loop = TrainingLoop(accelerator, args, dataloader, optimizer, lr_scheduler, parameters, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: the denoising loss through the ControlNet-guided UNet, both given SDXL's conditioning;
    # after each optimizer step the loop updates the EMA, checkpoints and validates when due (the final step
    # included, once).
    controlnet.train()
    for batch in loop:
        with accelerator.accumulate(controlnet):
            if args.cache_latents:  # drawn from the global RNG exactly as latent_dist.sample() draws
                latents = sample_latents(batch["latent_parameters"])
            else:
                latents = vae.encode(batch["pixel_values"].to(weight_dtype)).latent_dist.sample()
            # One memory layout for both paths (the CPU VAE gives channels-last): randn_like follows it.
            latents = latents.contiguous() * vae.config.scaling_factor
            noise = sample_noise(latents, args.noise_offset)
            timesteps = sample_timesteps(noise_scheduler, latents.shape[0], latents.device)
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            prompt_embeds = batch["prompt_embeds"]
            added_cond_kwargs = {"text_embeds": batch["text_embeds"], "time_ids": batch["time_ids"]}
            # The ControlNet turns the conditioning image into residuals for the frozen UNet's skip connections.
            down_residuals, mid_residual = controlnet(
                noisy_latents, timesteps, prompt_embeds, added_cond_kwargs=added_cond_kwargs,
                controlnet_cond=batch["conditioning_pixel_values"].to(weight_dtype), return_dict=False)
            model_pred = unet(noisy_latents, timesteps, prompt_embeds, added_cond_kwargs=added_cond_kwargs,
                              down_block_additional_residuals=down_residuals,
                              mid_block_additional_residual=mid_residual, return_dict=False)[0]
            target = prediction_target(noise_scheduler, latents, noise, timesteps)
            loss = diffusion_loss(model_pred, target, noise_scheduler, timesteps, args.snr_gamma)

            loop.backward_and_step(loss)

    # 6. Save the raw and EMA ControlNet from memory, check the files against it, and write the model card.
    if accelerator.is_main_process:
        vae_path = args.pretrained_vae_model_name_or_path
        finish_controlnet_run(
            args, "ControlNet for SDXL", HOW_TO_LOAD, trained["controlnet"], ema, validator, loop.records,
            classes=", ".join((["AutoencoderKL"] if vae_path else []) +
                              ["ControlNetModel", "StableDiffusionXLControlNetPipeline"]),
            vae=f', vae=AutoencoderKL.from_pretrained("{vae_path}")' if vae_path else "")
    end_training(accelerator)


if __name__ == "__main__":
    with exit_on_usage_error():
        main(parse_args())
