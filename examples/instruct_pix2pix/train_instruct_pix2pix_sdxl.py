#!/usr/bin/env python
# Copied from examples/text_to_image/train_text_to_image_sdxl.py; tests/test_drift.py keeps what they share alike.
"""Fine-tune every parameter of a Stable Diffusion XL UNet to edit images as instructions say (InstructPix2Pix).

    accelerate launch train_instruct_pix2pix_sdxl.py \\
      --pretrained_model_name_or_path=stabilityai/stable-diffusion-xl-base-1.0 \\
      --pretrained_vae_model_name_or_path=madebyollin/sdxl-vae-fp16-fix \\
      --dataset_name=fusing/instructpix2pix-1000-samples --output_dir=out --resolution=256 --use_ema \\
      --conditioning_dropout_prob=0.05 --validation_prompt "make the mountains snowy" \\
      --val_image_url_or_path mountain.png --validation_steps=100

Trains on (original image, edit instruction, edited image) rows (``--original_image_column``,
``--edit_prompt_column``, ``--edited_image_column``) from ``--dataset_name`` or an imagefolder. A text-to-image
UNet's ``conv_in`` is widened to read the original image's latents beside the noisy ones (new channels zero); an
InstructPix2Pix pipeline's UNet trains as it is. Writes the whole ``StableDiffusionXLInstructPix2PixPipeline``
folder holding the trained UNet to ``output_dir`` and, with ``--use_ema``, the EMA UNet to ``output_dir/ema/unet``;
validation edits each ``--validation_image`` (upstream's ``--val_image_url_or_path``, a local file here) and shows it
beside the raw and EMA edits; checkpoints to resume from, and a model card. The frozen VAE and both text encoders
run, and are saved, in the mixed-precision dtype; the UNet trains and is saved in fp32. SDXL's own VAE overflows in
fp16, so with ``--mixed_precision fp16`` pass an fp16-safe one with ``--pretrained_vae_model_name_or_path``, or
train in bf16. The frozen text encoders run once per distinct instruction before training (and, with
``--cache_latents``, the VAE once per edited image; the original image is encoded in each step).
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import torch
from diffusers import StableDiffusionXLInstructPix2PixPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import (add_cache_args, add_diffusion_loss_args, check_args, fill_dependent_defaults,
                                 training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.control import make_control_validator, with_conditioning
from training_utils.controlnet import load_validation_pairs
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import (TrainDataset, captions_with_empty, dataset_shapes, drop_caption,
                                          load_train_dataset, make_dataloader, pick_caption, stack_collate)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageWithConditioningTransform
from training_utils.data.prompts import cached_rows
from training_utils.diffusion import diffusion_loss, prediction_target, sample_noise, sample_timesteps
from training_utils.ema import make_ema
from training_utils.families import sdxl
from training_utils.instruct_pix2pix import (add_instruct_pix2pix_args, check_instruct_pix2pix_args,
                                            conditioning_dropped, dataset_columns, instruct_pix2pix_how_to_load,
                                            original_image_latents, at_size, widen_conv_in)
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import PipelineExport, save_with_ema
from training_utils.outputs.hub import finish_run
from training_utils.outputs.run_status import run_script
from training_utils.parser import add_refused_args
from training_utils.pipeline import (load_pipeline, prepare_components, trainable_parameters, training_noise_scheduler,
                                     weight_dtype_for)
from training_utils.posthoc_ema import make_posthoc_ema

# The flags of upstream's script that this one does not carry, besides those no script here carries.
REFUSED = {
    **dict.fromkeys(["--crops_coords_top_left_h", "--crops_coords_top_left_w"],
                    "SDXL is told each image's own crop corner, where it was cropped (as the text-to-image script "
                    "does)"),
    "--vae_precision": "the VAE runs in the mixed-precision dtype: pass an fp16-safe one with "
                       "--pretrained_vae_model_name_or_path, or train in bf16 or fp32",
    "--non_ema_revision": "the EMA starts from the weights that train (--revision); there is no other revision to "
                          "load them from",
}


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], resolution=256, tracker_project_name="instruct-pix2pix-xl")
    sdxl.add_args(parser)
    add_diffusion_loss_args(parser)
    add_instruct_pix2pix_args(parser, url_flag="--val_image_url_or_path")
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    sdxl.check_args(args)
    check_instruct_pix2pix_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, dataset_columns(args))
    validation_pairs = load_validation_pairs(args)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once, as InstructPix2Pix's, from a text-to-image folder or an InstructPix2Pix one (with the
    #    replacement VAE, if any). Its modules are the ones we train and the ones
    #    validation renders with. Prompts are encoded as its own encode_prompt does, with the same settings
    #    everywhere: training and validation.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    vae_replacement = sdxl.vae_components(args.pretrained_vae_model_name_or_path, weight_dtype)
    pipe = load_pipeline(StableDiffusionXLInstructPix2PixPipeline, args, weight_dtype, trained_in_fp32=["unet"],
                         **vae_replacement)
    if args.pretrained_vae_model_name_or_path:
        accelerator.print(f"VAE: {args.pretrained_vae_model_name_or_path}")
    unet, text_encoders = pipe.unet, [pipe.text_encoder, pipe.text_encoder_2]
    noise_scheduler = training_noise_scheduler(pipe, prediction_type=args.prediction_type)
    settings = sdxl.prompt_settings(pipe, args)
    call_kwargs = sdxl.call_kwargs(pipe, settings)

    # 3. The whole UNet trains, in fp32, its conv_in widened for the original image's latents where it reads only
    #    the noisy ones; the EMA is made from its live tensors (no second copy from disk).
    widen_conv_in(unet)
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
    #    and on the empty prompt that dropout draws; with --cache_latents, the VAE on each edited image), in their
    #    half precision as the step would run them, then leave the accelerator until validation. The original image
    #    is resized, cropped and flipped as its edited image is. Optimizer, schedule, accelerate; the loop resumes if
    #    asked.
    transform = ImageWithConditioningTransform.from_args(args, pipe)
    frozen = FrozenEncoders(sdxl.image_vae(pipe), text_encoders, transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)

    def encode_prompts(prompts):
        return sdxl.encode_prompts(pipe, prompts, accelerator.device, settings)

    dropout = max(args.caption_dropout, args.conditioning_dropout_prob or 0)
    embeddings = frozen.text_embeddings(captions_with_empty(dataset[args.caption_column], dropout),
                                        encode_prompts, sdxl.prompt_dependencies(pipe, settings))
    shapes = dataset_shapes(transform, dataset, args.image_column)
    examples = frozen.cache_dataset_images(dataset, args.image_column, shapes)

    def preprocess(example, generator):
        laid_out = frozen.dataset_image_with_conditioning(example, example[args.original_image_column], generator)
        prompt = drop_caption(pick_caption(example[args.caption_column], generator), args.caption_dropout, generator)
        # Classifier-free guidance on the instruction and on the image: either, both or neither is dropped.
        drop_prompt, drop_image = conditioning_dropped(args.conditioning_dropout_prob, generator)
        # SDXL is told each image's original size, where it was cropped (after any flip) and the size it trains at
        # (its bucket).
        return {"image": laid_out.pixels, "original_pixel_values": laid_out.conditioning_pixels,
                "prompt": "" if drop_prompt else prompt, "keep_original": torch.tensor(float(not drop_image)),
                "time_ids": sdxl.time_ids(laid_out.original_size, laid_out.crop_top_left, laid_out.size)}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(examples, preprocess, args.seed, args.repeats, shapes), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    prompt_rows = cached_rows(embeddings, accelerator.device)

    size = validation_size(args, shapes)
    validator = make_control_validator(args, pipe, accelerator, at_size(validation_pairs, size), ema=ema,
                                       posthoc=posthoc, schedulers=[noise_scheduler], weight_dtype=weight_dtype,
                                       encoders_on_device=frozen.on_device, call_kwargs={**size, **call_kwargs})
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
            # The original image's latents as the pipeline makes them (zero where dropped), after the noisy ones.
            with frozen.vae_on_device():
                original = original_image_latents(pipe.vae, batch["original_pixel_values"], weight_dtype)
            original = original * batch["keep_original"].to(original.dtype).view(-1, 1, 1, 1)
            noisy = with_conditioning(noise_scheduler.add_noise(latents, noise, timesteps), original)
            inputs = sdxl.model_inputs(pipe, noisy, timesteps, text)
            output = models["unet"](**inputs, return_dict=False)[0]
            target = prediction_target(noise_scheduler, latents, noise, timesteps)
            loss = diffusion_loss(sdxl.prediction(pipe, output, latents), target, noise_scheduler, timesteps,
                                  args.snr_gamma)
            loop.backward_and_step(loss)

    # 6. Save the pipeline (its VAE the one trained with) with the raw UNet and the EMA UNet from memory, check the
    #    files, write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        finish_run(args, "InstructPix2Pix fine-tune for SDXL", instruct_pix2pix_how_to_load(args, pipe, ema),
                   loop.records, saved, "UNet")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
