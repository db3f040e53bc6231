#!/usr/bin/env python
# Copied from examples/controlnet/train_controlnet_sd3.py; tests/test_drift.py keeps what they share alike.
"""Train a ControlNet for FLUX.1 [dev] or [schnell] from (image, conditioning image, caption) triples, by flow matching.

    accelerate launch train_controlnet_flux.py \\
      --pretrained_model_name_or_path=black-forest-labs/FLUX.1-dev \\
      --dataset_name=fusing/fill50k --output_dir=out --resolution=512 --use_ema --mixed_precision=bf16 \\
      --num_double_layers=4 --num_single_layers=0 --gradient_checkpointing \\
      --validation_prompt "red circle with blue background" --validation_image ./conditioning_image_1.png

Without ``--controlnet_model_name_or_path`` the ControlNet (InstantX's kind: it reads the conditioning image's
latents) starts as a copy of the transformer's first ``--num_double_layers`` double-stream and
``--num_single_layers`` single-stream blocks, its embeddings (the guidance's among them, for [dev]) included, with
zero-initialised outputs. Only the ControlNet trains. It is fed what ``FluxControlNetPipeline`` feeds it: the
conditioning image through the VAE (in every step: it is not cached), shifted, scaled and packed as the latents are,
beside the noisy latents, the timestep, the prompt and, where it embeds one, ``--guidance_scale``. The frozen text
encoders run once per distinct caption before training, and with ``--cache_latents`` the VAE runs once per training
image (both flips).

Writes the ControlNet to ``output_dir`` (and the EMA to ``output_dir/ema``), which
``FluxControlNetModel.from_pretrained`` loads, validation images with ``validation/log.jsonl``,
checkpoints to resume from, and a model card.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxControlNetModel, FluxControlNetPipeline, FluxPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import add_cache_args, check_args, fill_dependent_defaults, training_parser
from training_utils.compile import compile_repeated_blocks
from training_utils.controlnet import (add_controlnet_args, cast_residuals_to_denoiser_dtype, check_controlnet_args,
                                       conditioning_latents, controlnet_how_to_load, dataset_columns,
                                       load_controlnet_pipeline, load_validation_pairs, make_controlnet_validator)
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import (TrainDataset, captions_with_empty, dataset_shapes, drop_caption,
                                          load_train_dataset, make_dataloader, pick_caption, stack_collate)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageWithConditioningTransform
from training_utils.data.prompts import cached_rows
from training_utils.ema import make_ema
from training_utils.errors import require
from training_utils.families import flux
from training_utils.flow_matching import (add_flow_matching_args, add_noise, check_flow_matching_args,
                                          flow_matching_loss, sample_flow_matching_timesteps)
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import ModelExport, save_with_ema
from training_utils.outputs.hub import finish_run
from training_utils.outputs.run_status import run_script
from training_utils.parser import add_refused_args
from training_utils.pipeline import prepare_components, trainable_parameters, training_noise_scheduler, weight_dtype_for
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.quantization import quantization_config

# The flags of upstream's script that this one does not carry, besides those no script here carries.
REFUSED = {
    "--pretrained_vae_model_name_or_path": "the VAE is the pipeline's own (FLUX.1's 16-channel VAE, stable in bf16)",
    **dict.fromkeys(["--crops_coords_top_left_h", "--crops_coords_top_left_w"],
                    "FLUX.1 takes no crop coordinates (upstream's script reads these flags nowhere)"),
    "--use_adafactor": "AdamW is the only optimizer here (--use_8bit_adam for bitsandbytes' 8-bit AdamW)",
    "--jsonl_for_train": "give the triples as a dataset: --train_data_dir (an imagefolder with metadata.jsonl) or "
                         "--dataset_name",
    "--enable_model_cpu_offload": "--offload keeps the frozen encoders off the accelerator whenever unused, "
                                  "validation included",
}


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=28, interpolation="lanczos",
                             tracker_project_name="flux_train_controlnet")
    flux.add_args(parser)
    add_controlnet_args(parser, denoiser="transformer")
    group = parser.add_argument_group("FLUX.1 ControlNet")
    group.add_argument("--num_double_layers", type=int, default=4,
                       help="double-stream blocks of a new ControlNet (copies of the transformer's first ones)")
    group.add_argument("--num_single_layers", type=int, default=4,
                       help="single-stream blocks of a new ControlNet (copies of the transformer's first ones)")
    group.add_argument("--save_weight_dtype", default="fp32", choices=["fp32"],
                       help="upstream's flag; the ControlNet and its EMA are saved in fp32, as they train")
    add_flow_matching_args(parser)
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    flux.check_args(args)
    check_flow_matching_args(args)
    controlnet_config = check_controlnet_args(args, FluxControlNetModel) or {}
    require(controlnet_config.get("conditioning_embedding_channels") is None, "--controlnet_model_name_or_path",
            args.controlnet_model_name_or_path, "an InstantX-style FluxControlNetModel, which reads the conditioning "
            "image's latents (XLabs' reads its pixels through a hint block, which this script does not train)")
    require(args.num_double_layers >= 0, "--num_double_layers", args.num_double_layers, "a count, 0 or more")
    require(args.num_single_layers >= 0, "--num_single_layers", args.num_single_layers, "a count, 0 or more")
    fill_dependent_defaults(args)
    return args


def controlnet_maker(args):
    """``from_denoiser`` for `load_controlnet_pipeline`: a ControlNet copying the transformer's first
    ``--num_double_layers`` and ``--num_single_layers`` blocks (as many as it has, where it has fewer)."""
    def from_transformer(transformer, base):
        config = transformer.config
        return FluxControlNetModel.from_transformer(
            transformer, num_layers=args.num_double_layers, num_single_layers=args.num_single_layers,
            attention_head_dim=config.attention_head_dim, num_attention_heads=config.num_attention_heads)
    return from_transformer


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, dataset_columns(args))
    validation_pairs = load_validation_pairs(args)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once, with the ControlNet among its components (without --controlnet_model_name_or_path,
    # one made from the loaded transformer's first blocks).
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    quantization = quantization_config(args, weight_dtype, base=["transformer"],
                                       text_encoders=["text_encoder", "text_encoder_2"])
    pipe = load_controlnet_pipeline(FluxControlNetPipeline, FluxPipeline, args, weight_dtype, quantization,
                                    FluxControlNetModel, controlnet_maker(args))
    controlnet, transformer = pipe.controlnet, pipe.transformer
    text_encoders = [pipe.text_encoder, pipe.text_encoder_2]
    noise_scheduler = training_noise_scheduler(pipe, FlowMatchEulerDiscreteScheduler)
    settings = flux.prompt_settings(pipe, args)
    call_kwargs = flux.call_kwargs(pipe, settings)

    # 3. Only the ControlNet trains; the transformer, VAE and text encoders are frozen. The EMA tracks the ControlNet.
    trained = {"controlnet": controlnet}
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, *text_encoders])
    if args.gradient_checkpointing:
        controlnet.enable_gradient_checkpointing()
    compile_repeated_blocks(controlnet, args.torch_compile)
    transformer.register_forward_pre_hook(cast_residuals_to_denoiser_dtype, with_kwargs=True)
    parameters = trainable_parameters(trained)
    export = ModelExport.of(trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: the frozen encoders run once, here, not in every step (the text encoders on each distinct caption and
    #    on the empty prompt that --caption_dropout draws; with --cache_latents, the VAE on each target image), then
    #    leave the accelerator until validation. A conditioning image is resized and cropped as its image is (to its
    #    bucket, with buckets). Optimizer, schedule, accelerate; the loop resumes if asked.
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
        # An empty prompt now and then teaches the ControlNet to follow the conditioning image alone.
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
    validator = make_controlnet_validator(
        args, pipe, accelerator, validation_pairs, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
        weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
        call_kwargs={**validation_size(args, shapes), **call_kwargs})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: flow matching in the transformer's own layout (`flux`): the latents move on a straight line to
    # noise and the ControlNet-guided transformer predicts the velocity; the ControlNet reads the conditioning image's
    # latents and the prompt as the pipeline gives them to it (`flux.controlnet_inputs`). After each optimizer step the
    # loop updates the EMA, checkpoints and validates when due (the final step included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            latents = flux.normalized_latents(pipe, frozen.latents(batch["image"]))
            noise = torch.randn_like(latents)
            timesteps, sigmas = sample_flow_matching_timesteps(noise_scheduler, args, latents)
            text = flux.text_inputs(prompt_rows(batch["prompt"]))
            inputs = flux.model_inputs(pipe, add_noise(latents, noise, sigmas), timesteps, text)
            # The ControlNet turns the conditioning image into a residual for each of the frozen transformer's blocks.
            conditioning = conditioning_latents(frozen, batch["conditioning_pixel_values"])
            block_samples, single_block_samples = models["controlnet"](
                **flux.controlnet_inputs(pipe, inputs, conditioning, settings), return_dict=False)
            output = transformer(**inputs, controlnet_block_samples=block_samples,
                                 controlnet_single_block_samples=single_block_samples, return_dict=False)[0]
            loss = flow_matching_loss(flux.prediction(pipe, output, latents), latents, noise, sigmas, args)
            loop.backward_and_step(loss)

    # 6. Save the raw and EMA ControlNet from memory, check the files against it, and write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        finish_run(args, "ControlNet for FLUX.1", controlnet_how_to_load(args, pipe), loop.records, saved, "ControlNet")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
