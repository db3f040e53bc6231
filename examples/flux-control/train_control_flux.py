#!/usr/bin/env python
# Copied from examples/flux-control/train_control_lora_flux.py; tests/test_drift.py keeps what they share alike.
"""Fine-tune a FLUX.1 transformer for Control from (image, conditioning image, caption) triples, with an optional EMA.

    accelerate launch train_control_flux.py \\
      --pretrained_model_name_or_path=black-forest-labs/FLUX.1-dev \\
      --dataset_name=raulc0399/open_pose_controlnet --output_dir=pose-control \\
      --mixed_precision=bf16 --resolution=1024 --gradient_checkpointing --use_ema --ema_device=cpu \\
      --validation_image 2_pose_1024.jpg --validation_prompt "two friends sitting by each other in a park"

The conditioning image goes through the VAE as the image does; its latents are concatenated with the noisy latents
along the channels, as ``FluxControlPipeline`` concatenates them, and the transformer's input layer (``x_embedder``)
takes twice the features, the new input columns starting as zeros. The whole transformer trains, in fp32 (with
``--only_target_transformer_blocks``, the input layer and the blocks only). The frozen text encoders embed each
distinct caption once, before training; with ``--cache_latents`` the VAE encodes each image once (both flips), and
the conditioning images in every step.

Writes a full pipeline holding the widened transformer to ``output_dir`` (``FluxControlPipeline.from_pretrained``
loads it, even from a FLUX.1 text-to-image base; the VAE's and text encoders' files are hard links to the base's)
and, with ``--use_ema``, the EMA transformer to ``output_dir/ema/transformer``; validation images with each
conditioning image beside them, ``validation/log.jsonl``, checkpoints to resume from, and a model card. Flags of the
upstream script that this one does not carry stop the run with one line saying why.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxControlPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import add_cache_args, check_args, fill_dependent_defaults, training_parser
from training_utils.compile import compile_repeated_blocks
from training_utils.control import (REFUSED, add_control_args, control_how_to_load, make_control_validator,
                                    widen_input_layer, with_conditioning)
from training_utils.controlnet import conditioning_latents, dataset_columns, load_validation_pairs
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import (TrainDataset, captions_with_empty, dataset_shapes, drop_caption,
                                          load_train_dataset, make_dataloader, pick_caption, stack_collate)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageWithConditioningTransform
from training_utils.data.prompts import cached_rows
from training_utils.errors import require
from training_utils.ema import make_ema
from training_utils.families import flux
from training_utils.flow_matching import (add_flow_matching_args, add_noise, check_flow_matching_args,
                                          flow_matching_loss, sample_flow_matching_timesteps)
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
REFUSED = {**REFUSED, "--upcast_before_saving": "the transformer trains in fp32 and is always saved in fp32"}


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=50, resolution=1024,
                             tracker_project_name="flux_train_control")
    add_control_args(parser)
    parser.add_argument("--only_target_transformer_blocks", action="store_true",
                        help="train the input layer and the transformer blocks only, not the embedders and the "
                             "output layers")
    flux.add_args(parser)
    parser.set_defaults(guidance_scale=30.0)  # upstream's: FLUX.1 Control [dev] embeds a high guidance
    add_flow_matching_args(parser, weighting_scheme="none")
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    require(not (args.only_target_transformer_blocks and args.ema_posthoc_sigma_rels), "--ema_posthoc_sigma_rels",
            args.ema_posthoc_sigma_rels, "none with --only_target_transformer_blocks (a post-hoc synthesis writes the "
                                         "whole transformer, from the tensors that trained)")
    check_flow_matching_args(args)
    flux.check_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, dataset_columns(args))
    validation_pairs = load_validation_pairs(args)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once: FLUX.1's components in FluxControlPipeline. Its modules train and render the validation
    #    images. Prompts are encoded as its own encode_prompt does, with the same settings in training and validation.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    pipe = load_pipeline(FluxControlPipeline, args, weight_dtype, trained_in_fp32=["transformer"])
    transformer, text_encoders = pipe.transformer, [pipe.text_encoder, pipe.text_encoder_2]
    noise_scheduler = training_noise_scheduler(pipe, FlowMatchEulerDiscreteScheduler)
    settings = flux.prompt_settings(pipe, args)
    call_kwargs = flux.call_kwargs(pipe, settings)

    # 3. The input layer widened for the conditioning latents (its new columns zeros); the whole transformer trains
    #    (or the input layer and the blocks only), the VAE and both text encoders are frozen. The EMA tracks what
    #    trains.
    widen_input_layer(transformer, "x_embedder")
    transformer.requires_grad_(not args.only_target_transformer_blocks)
    if args.only_target_transformer_blocks:
        for module in (transformer.x_embedder, transformer.transformer_blocks, transformer.single_transformer_blocks):
            module.requires_grad_(True)
    trained = {"transformer": transformer}
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, *text_encoders])
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    compile_repeated_blocks(transformer, args.torch_compile)
    parameters = trainable_parameters(trained)
    export = PipelineExport(pipe, trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: the frozen encoders run once, here, not in every step (the text encoders on each distinct caption and
    #    on the empty prompt that --caption_dropout draws; with --cache_latents, the VAE on each target image), then
    #    leave the accelerator until validation. A conditioning image is resized, cropped and flipped as its image
    #    is. Optimizer, schedule, accelerate; the loop resumes if asked.
    transform = ImageWithConditioningTransform.from_args(args, pipe)
    frozen = FrozenEncoders(flux.image_vae(pipe), text_encoders, transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)

    def encode_prompts(prompts):
        return flux.encode_prompts(pipe, prompts, accelerator.device, settings)

    embeddings = frozen.text_embeddings(captions_with_empty(dataset[args.caption_column], args.caption_dropout),
                                        encode_prompts, flux.prompt_dependencies(pipe, settings))
    shapes = dataset_shapes(transform, dataset, args.image_column)
    examples = frozen.cache_dataset_images(dataset, args.image_column, shapes)

    def preprocess(example, generator):
        laid_out = frozen.dataset_image_with_conditioning(example, example[args.conditioning_image_column],
                                                          generator)
        prompt = drop_caption(pick_caption(example[args.caption_column], generator), args.caption_dropout, generator)
        return {"image": laid_out.pixels, "conditioning_pixel_values": laid_out.conditioning_pixels, "prompt": prompt}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(examples, preprocess, args.seed, args.repeats, shapes), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    prompt_rows = cached_rows(embeddings, accelerator.device)

    # The pipeline resizes each --validation_image to the validation size (with buckets, the most common one).
    validator = make_control_validator(
        args, pipe, accelerator, validation_pairs, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
        weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
        call_kwargs={**validation_size(args, shapes), **call_kwargs})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: flow matching in the transformer's own layout and conventions (the family module's): the latents
    # move on a straight line to noise and the transformer, reading the conditioning image's latents beside them,
    # predicts the velocity, noise - latents. After each optimizer step the loop updates the EMA, checkpoints and
    # validates when due (the final step included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            latents = flux.normalized_latents(pipe, frozen.latents(batch["image"]))
            control = flux.normalized_latents(pipe, conditioning_latents(frozen, batch["conditioning_pixel_values"]))
            noise = torch.randn_like(latents)
            timesteps, sigmas = sample_flow_matching_timesteps(noise_scheduler, args, latents)
            text = flux.text_inputs(prompt_rows(batch["prompt"]))
            inputs = flux.model_inputs(pipe, with_conditioning(add_noise(latents, noise, sigmas), control), timesteps,
                                       text)
            output = models["transformer"](**inputs, return_dict=False)[0]
            loss = flow_matching_loss(flux.prediction(pipe, output, latents), latents, noise, sigmas, args)
            loop.backward_and_step(loss)

    # 6. Save the pipeline with the trained transformer and the EMA's transformer from memory (the other models'
    #    files linked), check the files, and write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        finish_run(args, "FLUX.1 Control", control_how_to_load(args, pipe, ema), loop.records, saved, "transformer")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
