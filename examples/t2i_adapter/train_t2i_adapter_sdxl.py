#!/usr/bin/env python
# Copied from examples/controlnet/train_controlnet_sdxl.py; tests/test_drift.py keeps what they share alike.
"""Train a T2I-Adapter for Stable Diffusion XL from (image, conditioning image, caption) triples, with an optional EMA.

    accelerate launch train_t2i_adapter_sdxl.py \\
      --pretrained_model_name_or_path=stabilityai/stable-diffusion-xl-base-1.0 \\
      --pretrained_vae_model_name_or_path=madebyollin/sdxl-vae-fp16-fix \\
      --dataset_name=fusing/fill50k --output_dir=out --resolution=1024 --use_ema \\
      --validation_prompt "red circle with blue background" --validation_image ./conditioning_image_1.png

Without ``--adapter_model_name_or_path`` the adapter starts new (upstream's ``full_adapter_xl`` for SDXL).
``--adapter_conditioning_scale`` scales its features in training and validation alike, as the pipeline's argument of
that name does. Only the adapter trains. The frozen text encoders run once per distinct caption before training, and
with ``--cache_latents`` the VAE runs once per image (both flips); the
conditioning images are not cached, since the adapter reads them.

SDXL's own VAE overflows in fp16: with ``--mixed_precision fp16`` pass an fp16-safe one (as above),
which replaces the pipeline's for training and validation alike, or train in bf16.

Writes the adapter to ``output_dir`` (and the EMA to ``output_dir/ema``), which
``T2IAdapter.from_pretrained`` loads into ``StableDiffusionXLAdapterPipeline``, validation images with
``validation/log.jsonl``, checkpoints to resume from, and a model card.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

from diffusers import StableDiffusionXLAdapterPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import (add_cache_args, add_diffusion_loss_args, check_args, fill_dependent_defaults,
                                 training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.controlnet import dataset_columns, load_validation_pairs, make_controlnet_validator
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import (TrainDataset, captions_with_empty, dataset_shapes, drop_caption,
                                          load_train_dataset, make_dataloader, pick_caption, stack_collate)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageWithConditioningTransform
from training_utils.data.prompts import cached_rows
from training_utils.diffusion import diffusion_loss, prediction_target, sample_noise
from training_utils.ema import make_ema
from training_utils.families import sdxl
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import ModelExport, save_with_ema
from training_utils.outputs.hub import finish_run
from training_utils.outputs.run_status import run_script
from training_utils.parser import add_refused_args
from training_utils.pipeline import prepare_components, trainable_parameters, training_noise_scheduler, weight_dtype_for
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.quantization import quantization_config
from training_utils.t2i_adapter import (adapter_features, add_t2i_adapter_args, cast_features_to_unet_dtype,
                                        check_t2i_adapter_args, cubic_timesteps, load_adapter_pipeline,
                                        t2i_adapter_how_to_load)

# The flags of upstream's script that this one does not carry, besides those no script here carries.
REFUSED = {**dict.fromkeys(["--crops_coords_top_left_h", "--crops_coords_top_left_w"],
                           "SDXL is told each image's own crop corner, where it was cropped (as the LoRA script does)"),
           "--detection_resolution": "upstream's script never reads it: each conditioning image is resized and "
                                     "cropped with its image"}


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], resolution=1024, interpolation="lanczos",
                             tracker_project_name="sd_xl_train_t2iadapter")
    sdxl.add_args(parser)
    add_t2i_adapter_args(parser)
    add_diffusion_loss_args(parser)
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    sdxl.check_args(args)
    check_t2i_adapter_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, dataset_columns(args))
    validation_pairs = load_validation_pairs(args)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once (with the replacement VAE, if any), with the adapter among its components
    # (without --adapter_model_name_or_path, a new one sized for the UNet).
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    quantization = quantization_config(args, weight_dtype, base=["unet"],
                                       text_encoders=["text_encoder", "text_encoder_2"])
    vae_replacement = sdxl.vae_components(args.pretrained_vae_model_name_or_path, weight_dtype)
    pipe = load_adapter_pipeline(StableDiffusionXLAdapterPipeline, args, weight_dtype, quantization, **vae_replacement)
    if args.pretrained_vae_model_name_or_path:
        accelerator.print(f"VAE: {args.pretrained_vae_model_name_or_path}")
    adapter, unet, text_encoders = pipe.adapter, pipe.unet, [pipe.text_encoder, pipe.text_encoder_2]
    noise_scheduler = training_noise_scheduler(pipe, prediction_type=args.prediction_type)
    settings = sdxl.prompt_settings(pipe, args)
    call_kwargs = sdxl.call_kwargs(pipe, settings)

    # 3. Only the adapter trains; the UNet, VAE and both text encoders are frozen. The EMA tracks the adapter.
    trained = {"adapter": adapter}
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, *text_encoders])
    # The small adapter repeats no blocks: --gradient_checkpointing saves the frozen UNet's activations, as
    # upstream's does, and --torch_compile compiles the UNet's repeated blocks, where the step's time goes.
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    compile_repeated_blocks(unet, args.torch_compile)
    unet.register_forward_pre_hook(cast_features_to_unet_dtype, with_kwargs=True)
    parameters = trainable_parameters(trained)
    export = ModelExport.of(trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: the frozen encoders run once, here, not in every step (both text encoders on each distinct
    #    caption and on the empty prompt that --caption_dropout draws; with --cache_latents, the VAE on each
    #    target image, not on the conditioning image, which the adapter reads), then leave the accelerator
    #    until validation. A conditioning image is resized and cropped as its image is (to its bucket, with
    #    buckets). Optimizer, schedule, accelerate; the loop resumes if asked.
    transform = ImageWithConditioningTransform.from_args(args, pipe)
    frozen = FrozenEncoders(sdxl.image_vae(pipe), text_encoders, transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)

    def encode_prompts(prompts):
        return sdxl.encode_prompts(pipe, prompts, accelerator.device, settings)

    embeddings = frozen.text_embeddings(captions_with_empty(dataset[args.caption_column], args.caption_dropout),
                                        encode_prompts, sdxl.prompt_dependencies(pipe, settings))
    shapes = dataset_shapes(transform, dataset, args.image_column)
    examples = frozen.cache_dataset_images(dataset, args.image_column, shapes)

    def preprocess(example, generator):
        laid_out = frozen.dataset_image_with_conditioning(example, example[args.conditioning_image_column],
                                                          generator)
        # An empty prompt now and then teaches the adapter to steer the image without the prompt's help.
        prompt = drop_caption(pick_caption(example[args.caption_column], generator), args.caption_dropout, generator)
        # SDXL is told each image's original size, where it was cropped (after any flip) and the size it trains
        # at (its bucket).
        return {"image": laid_out.pixels, "conditioning_pixel_values": laid_out.conditioning_pixels, "prompt": prompt,
                "time_ids": sdxl.time_ids(laid_out.original_size, laid_out.crop_top_left, laid_out.size)}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(examples, preprocess, args.seed, args.repeats, shapes), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    prompt_rows = cached_rows(embeddings, accelerator.device)

    # The pipeline resizes each --validation_image to the validation size (with buckets, the most common one) and
    # scales the adapter's features as training does.
    validator = make_controlnet_validator(
        args, pipe, accelerator, validation_pairs, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
        weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
        call_kwargs={**validation_size(args, shapes), **call_kwargs,
                     "adapter_conditioning_scale": args.adapter_conditioning_scale})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: the denoising loss on the family's latents and conditioning (`sdxl`), each image's
    # micro-conditioning beside its prompt's, through the adapter-guided UNet, at timesteps drawn as upstream draws
    # them (cubic: mostly noisy ones); after each optimizer step the loop updates the EMA, checkpoints and validates
    # when due (the final step included, once). Upstream's Euler-scaled input and sigma-weighted loss on the
    # denoised latents are this noise and this loss, written as the other UNet scripts write them.
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            latents = sdxl.normalized_latents(pipe, frozen.latents(batch["image"]))
            noise = sample_noise(latents, args.noise_offset)
            timesteps = cubic_timesteps(noise_scheduler, latents.shape[0], latents.device)
            text = sdxl.text_inputs(prompt_rows(batch["prompt"]))
            text["added_cond_kwargs"]["time_ids"] = batch["time_ids"]
            inputs = sdxl.model_inputs(pipe, noise_scheduler.add_noise(latents, noise, timesteps), timesteps, text)
            # The adapter turns the conditioning image (in [0, 1], as the pipeline gives it) into features, scaled as
            # the pipeline scales them, that the frozen UNet adds inside its down blocks.
            features = adapter_features(models["adapter"], batch["conditioning_pixel_values"],
                                        args.adapter_conditioning_scale)
            output = unet(**inputs, down_intrablock_additional_residuals=features, return_dict=False)[0]
            target = prediction_target(noise_scheduler, latents, noise, timesteps)
            loss = diffusion_loss(sdxl.prediction(pipe, output, latents), target, noise_scheduler, timesteps,
                                  args.snr_gamma)
            loop.backward_and_step(loss)

    # 6. Save the raw and EMA adapter from memory, check the files against it, and write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        vae_fields = sdxl.vae_how_to_load(args.pretrained_vae_model_name_or_path, pipe)
        finish_run(args, "T2I-Adapter for SDXL", t2i_adapter_how_to_load(args, pipe, **vae_fields), loop.records,
                   saved, "T2I-Adapter")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
