#!/usr/bin/env python
# Copied from examples/text_to_image/train_text_to_image.py; tests/test_drift.py keeps what they share alike.
"""Fine-tune every parameter of a Stable Diffusion XL UNet on image-caption pairs, with an optional EMA.

    accelerate launch train_text_to_image_sdxl.py \\
      --pretrained_model_name_or_path=stabilityai/stable-diffusion-xl-base-1.0 \\
      --pretrained_vae_model_name_or_path=madebyollin/sdxl-vae-fp16-fix \\
      --train_data_dir=my_images --output_dir=out --resolution=1024 --use_ema --ema_device=cpu \\
      --validation_prompt "a red circle" --validation_steps=100

Writes a full pipeline holding the trained UNet to ``output_dir`` (``StableDiffusionXLPipeline.from_pretrained``
loads it) and, with ``--use_ema``, the EMA UNet to ``output_dir/ema/unet``; validation images with
``validation/log.jsonl``, checkpoints to resume from, and a model card. ``--ema_device=cpu`` keeps the EMA off
the accelerator. The frozen VAE and both text encoders run, and are saved, in the mixed-precision dtype; the UNet
trains and is saved in fp32. SDXL's own VAE overflows in fp16, so with ``--mixed_precision fp16`` pass an
fp16-safe one (as above) with ``--pretrained_vae_model_name_or_path``, or train in bf16: that VAE replaces the
pipeline's for training, validation and the saved pipeline alike. The frozen text encoders run once per distinct
caption before training (and, with ``--cache_latents``, the VAE once per image), not in every step; they stay off
the accelerator except while validating.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

from diffusers import StableDiffusionXLPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import (add_cache_args, add_diffusion_loss_args, check_args, fill_dependent_defaults,
                                 training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import (TrainDataset, captions_with_empty, dataset_shapes, drop_caption,
                                          load_train_dataset, make_dataloader, pick_caption, stack_collate)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform
from training_utils.data.prompts import cached_rows
from training_utils.diffusion import diffusion_loss, prediction_target, sample_noise, sample_timesteps
from training_utils.ema import make_ema
from training_utils.families import sdxl
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import PipelineExport, save_with_ema
from training_utils.outputs.hub import fine_tuned_unet_how_to_load, finish_run
from training_utils.outputs.run_status import run_script
from training_utils.parser import add_refused_args
from training_utils.pipeline import (load_pipeline, prepare_components, trainable_parameters, training_noise_scheduler,
                                     weight_dtype_for)
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.validation import make_validator

# The flags of upstream's script that this one does not carry, besides those no script here carries.
REFUSED = dict.fromkeys(["--timestep_bias_strategy", "--timestep_bias_multiplier", "--timestep_bias_begin",
                         "--timestep_bias_end", "--timestep_bias_portion"],
                        "timestep bias is not carried: timesteps are drawn uniformly")


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], resolution=1024, interpolation="lanczos",
                             tracker_project_name="text2image-fine-tune-sdxl")
    sdxl.add_args(parser)
    add_diffusion_loss_args(parser)
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    sdxl.check_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, {"--image_column": args.image_column, "--caption_column": args.caption_column})
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once (with the replacement VAE, if any). Its modules are the ones we train and the ones
    #    validation renders with. Prompts are encoded as its own encode_prompt does, with the same settings
    #    everywhere: training and validation.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    vae_replacement = sdxl.vae_components(args.pretrained_vae_model_name_or_path, weight_dtype)
    pipe = load_pipeline(StableDiffusionXLPipeline, args, weight_dtype, trained_in_fp32=["unet"], **vae_replacement)
    if args.pretrained_vae_model_name_or_path:
        accelerator.print(f"VAE: {args.pretrained_vae_model_name_or_path}")
    unet, text_encoders = pipe.unet, [pipe.text_encoder, pipe.text_encoder_2]
    noise_scheduler = training_noise_scheduler(pipe, prediction_type=args.prediction_type)
    settings = sdxl.prompt_settings(pipe, args)
    call_kwargs = sdxl.call_kwargs(pipe, settings)

    # 3. The whole UNet trains, in fp32; the EMA is made from its live tensors (no second copy from disk).
    trained = {"unet": unet}
    unet.requires_grad_(True)
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, *text_encoders])
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    compile_repeated_blocks(unet, args.torch_compile)
    parameters = trainable_parameters(trained)
    export = PipelineExport(pipe, trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: the frozen encoders run once, here, not in every step (both text encoders on each distinct caption
    #    and on the empty prompt that --caption_dropout draws; with --cache_latents, the VAE on each image), in their
    #    half precision as the step would run them, then leave the accelerator until validation. Optimizer,
    #    schedule, accelerate; the loop resumes if asked.
    transform = ImageTransform.from_args(args, pipe)
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
        laid_out = frozen.dataset_image(example, generator)
        prompt = drop_caption(pick_caption(example[args.caption_column], generator), args.caption_dropout, generator)
        # SDXL is told each image's original size, where it was cropped (after any flip) and the size it trains at
        # (its bucket).
        return {"image": laid_out.pixels, "prompt": prompt,
                "time_ids": sdxl.time_ids(laid_out.original_size, laid_out.crop_top_left, laid_out.size)}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(examples, preprocess, args.seed, args.repeats, shapes), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    prompt_rows = cached_rows(embeddings, accelerator.device)

    validator = make_validator(args, pipe, accelerator, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
                               weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
                               call_kwargs={**validation_size(args, shapes), **call_kwargs})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: the denoising loss on the family's latents and conditioning (`sdxl`), each image's micro-
    # conditioning beside its prompt's; after each optimizer step the loop updates the EMA, checkpoints and validates
    # when due (the final step included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            latents = sdxl.normalized_latents(pipe, frozen.latents(batch["image"]))
            noise = sample_noise(latents, args.noise_offset)
            timesteps = sample_timesteps(noise_scheduler, latents.shape[0], latents.device)
            text = sdxl.text_inputs(prompt_rows(batch["prompt"]))
            text["added_cond_kwargs"]["time_ids"] = batch["time_ids"]
            inputs = sdxl.model_inputs(pipe, noise_scheduler.add_noise(latents, noise, timesteps), timesteps, text)
            output = models["unet"](**inputs, return_dict=False)[0]
            target = prediction_target(noise_scheduler, latents, noise, timesteps)
            loss = diffusion_loss(sdxl.prediction(pipe, output, latents), target, noise_scheduler, timesteps,
                                  args.snr_gamma)
            loop.backward_and_step(loss)

    # 6. Save the pipeline (its VAE the one trained with) with the raw UNet and the EMA UNet from memory, check the
    #    files, write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        finish_run(args, "Text-to-image fine-tune for SDXL",
                   fine_tuned_unet_how_to_load(args, pipe, ema), loop.records, saved, "UNet")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
