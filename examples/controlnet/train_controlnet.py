#!/usr/bin/env python
# Copied from examples/text_to_image/train_text_to_image_lora.py; tests/test_drift.py keeps what they share alike.
"""Train a ControlNet for Stable Diffusion 1.x from (image, conditioning image, caption) triples, with an optional EMA.

    accelerate launch train_controlnet.py \\
      --pretrained_model_name_or_path=stable-diffusion-v1-5/stable-diffusion-v1-5 \\
      --dataset_name=fusing/fill50k --output_dir=out --use_ema \\
      --validation_prompt "red circle with blue background" --validation_image ./conditioning_image_1.png

Without ``--controlnet_model_name_or_path`` the ControlNet starts as a copy of the UNet's encoder.
Only the ControlNet trains. The frozen text encoder runs once per distinct caption before training, and
with ``--cache_latents`` the VAE runs once per image (both flips); the
conditioning images are not cached, since the ControlNet reads them.

Writes the ControlNet to ``output_dir`` (and the EMA to ``output_dir/ema``), which
``ControlNetModel.from_pretrained`` loads, validation images with ``validation/log.jsonl``,
checkpoints to resume from, and a model card.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

from diffusers import StableDiffusionControlNetPipeline, StableDiffusionPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import (add_cache_args, add_diffusion_loss_args, check_args, fill_dependent_defaults,
                                 training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.controlnet import (add_controlnet_args, cast_residuals_to_denoiser_dtype, check_controlnet_args,
                                       controlnet_how_to_load, dataset_columns, load_controlnet_pipeline,
                                       load_validation_pairs, make_controlnet_validator)
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import (TrainDataset, captions_with_empty, dataset_shapes, drop_caption,
                                          load_train_dataset, make_dataloader, pick_caption, stack_collate)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageWithConditioningTransform
from training_utils.data.prompts import cached_rows
from training_utils.diffusion import diffusion_loss, prediction_target, sample_noise, sample_timesteps
from training_utils.ema import make_ema
from training_utils.families import sd
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import ModelExport, save_with_ema
from training_utils.outputs.hub import finish_run
from training_utils.outputs.run_status import run_script
from training_utils.pipeline import prepare_components, trainable_parameters, training_noise_scheduler, weight_dtype_for
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.quantization import quantization_config


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], tracker_project_name="train_controlnet")
    add_controlnet_args(parser)
    add_diffusion_loss_args(parser)
    add_cache_args(parser)
    args = parser.parse_args(argv)
    check_args(args)
    check_controlnet_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, dataset_columns(args))
    validation_pairs = load_validation_pairs(args)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once, with the ControlNet among its components (without --controlnet_model_name_or_path,
    # one made from the loaded UNet's encoder).
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    quantization = quantization_config(args, weight_dtype, base=["unet"], text_encoders=["text_encoder"])
    pipe = load_controlnet_pipeline(StableDiffusionControlNetPipeline, StableDiffusionPipeline, args, weight_dtype,
                                    quantization)
    controlnet, unet, text_encoders = pipe.controlnet, pipe.unet, [pipe.text_encoder]
    noise_scheduler = training_noise_scheduler(pipe, prediction_type=args.prediction_type)
    settings = sd.prompt_settings(pipe, args)
    call_kwargs = sd.call_kwargs(pipe, settings)

    # 3. Only the ControlNet trains; the UNet, VAE and text encoder are frozen. The EMA tracks the ControlNet.
    trained = {"controlnet": controlnet}
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, *text_encoders])
    if args.gradient_checkpointing:
        controlnet.enable_gradient_checkpointing()
    compile_repeated_blocks(controlnet, args.torch_compile)
    unet.register_forward_pre_hook(cast_residuals_to_denoiser_dtype, with_kwargs=True)
    parameters = trainable_parameters(trained)
    export = ModelExport.of(trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: the frozen encoders run once, here, not in every step (the text encoder on each distinct caption
    #    and on the empty prompt that --caption_dropout draws; with --cache_latents, the VAE on each target image,
    #    not on the conditioning image, which the ControlNet reads), then leave the accelerator until validation.
    #    A conditioning image is resized and cropped as its image is (to its bucket, with buckets). Optimizer,
    #    schedule, accelerate; the loop resumes if asked.
    transform = ImageWithConditioningTransform.from_args(args, pipe)
    frozen = FrozenEncoders(sd.image_vae(pipe), text_encoders, transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)

    def encode_prompts(prompts):
        return sd.encode_prompts(pipe, prompts, accelerator.device, settings)

    embeddings = frozen.text_embeddings(captions_with_empty(dataset[args.caption_column], args.caption_dropout),
                                        encode_prompts, sd.prompt_dependencies(pipe, settings))
    shapes = dataset_shapes(transform, dataset, args.image_column)
    examples = frozen.cache_dataset_images(dataset, args.image_column, shapes)

    def preprocess(example, generator):
        laid_out = frozen.dataset_image_with_conditioning(example, example[args.conditioning_image_column],
                                                          generator)
        # An empty prompt now and then teaches the ControlNet to follow the conditioning image alone.
        prompt = drop_caption(pick_caption(example[args.caption_column], generator), args.caption_dropout, generator)
        return {"image": laid_out.pixels, "conditioning_pixel_values": laid_out.conditioning_pixels,
                "prompt": prompt}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(examples, preprocess, args.seed, args.repeats, shapes), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    prompt_rows = cached_rows(embeddings, accelerator.device)

    # The pipeline resizes each --validation_image to the validation size (with buckets, the most common one).
    validator = make_controlnet_validator(
        args, pipe, accelerator, validation_pairs, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
        weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
        call_kwargs={**validation_size(args, shapes), **call_kwargs})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: the denoising loss on the family's latents and conditioning (`sd`), through the ControlNet-guided
    # UNet; after each optimizer step the loop updates the EMA, checkpoints and validates when due (the final step
    # included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            latents = sd.normalized_latents(pipe, frozen.latents(batch["image"]))
            noise = sample_noise(latents, args.noise_offset)
            timesteps = sample_timesteps(noise_scheduler, latents.shape[0], latents.device)
            text = sd.text_inputs(prompt_rows(batch["prompt"]))
            inputs = sd.model_inputs(pipe, noise_scheduler.add_noise(latents, noise, timesteps), timesteps, text)
            # The ControlNet turns the conditioning image into residuals for the frozen UNet's skip connections.
            down_residuals, mid_residual = models["controlnet"](
                **inputs, controlnet_cond=batch["conditioning_pixel_values"].to(weight_dtype),
                return_dict=False)
            output = unet(**inputs, down_block_additional_residuals=down_residuals,
                          mid_block_additional_residual=mid_residual, return_dict=False)[0]
            target = prediction_target(noise_scheduler, latents, noise, timesteps)
            loss = diffusion_loss(sd.prediction(pipe, output, latents), target, noise_scheduler, timesteps,
                                  args.snr_gamma)
            loop.backward_and_step(loss)

    # 6. Save the raw and EMA ControlNet from memory, check the files against it, and write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        finish_run(args, "ControlNet", controlnet_how_to_load(args, pipe), loop.records, saved, "ControlNet")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
