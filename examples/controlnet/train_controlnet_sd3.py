#!/usr/bin/env python
# Copied from examples/controlnet/train_controlnet_sdxl.py; tests/test_drift.py keeps what they share alike.
"""Train a ControlNet for Stable Diffusion 3 or 3.5 from (image, conditioning image, caption) triples (flow matching).

    accelerate launch train_controlnet_sd3.py \\
      --pretrained_model_name_or_path=stabilityai/stable-diffusion-3.5-medium \\
      --dataset_name=fusing/fill50k --output_dir=out --resolution=1024 --use_ema --mixed_precision=bf16 \\
      --validation_prompt "red circle with blue background" --validation_image ./conditioning_image_1.png

Without ``--controlnet_model_name_or_path`` the ControlNet starts as a copy of the transformer's first 12 blocks
(all but the last, for a smaller transformer), its embeddings included, with zero-initialised outputs. Only the
ControlNet trains. It is fed what ``StableDiffusion3ControlNetPipeline`` feeds it: the conditioning image through the
VAE (in every step: it is not cached), scaled (and shifted, unless the ControlNet takes zero pooled projections, as
one made here does), beside the noisy latents, the timestep and the prompt. The frozen text encoders run once per
distinct caption before training, and with ``--cache_latents`` the VAE runs once per training image (both flips).

Writes the ControlNet to ``output_dir`` (and the EMA to ``output_dir/ema``), which
``SD3ControlNetModel.from_pretrained`` loads, validation images with ``validation/log.jsonl``,
checkpoints to resume from, and a model card.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import torch
from diffusers import (FlowMatchEulerDiscreteScheduler, SD3ControlNetModel, StableDiffusion3ControlNetPipeline,
                       StableDiffusion3Pipeline)

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
from training_utils.families import sd3
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
    "--upcast_vae": "the VAE runs in the frozen weights' dtype (--mixed_precision's), as validation renders with it",
    "--dataset_preprocess_batch_size": "the prompts are embedded once per distinct caption before training, in the "
                                       "frozen encoders' own batches",
}
# How many of the transformer's blocks a new ControlNet copies (upstream's, SD3ControlNetModel.from_transformer's).
CONTROLNET_BLOCKS = 12


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=28,
                             tracker_project_name="train_controlnet")
    sd3.add_args(parser)
    add_controlnet_args(parser, denoiser="transformer")
    parser.add_argument("--num_extra_conditioning_channels", type=int, default=0,
                        help="upstream's flag; only 0: the pipeline gives a ControlNet the conditioning image's VAE "
                             "latents alone")
    add_flow_matching_args(parser, precondition_outputs=1)
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    sd3.check_args(args)
    check_flow_matching_args(args)
    check_controlnet_args(args, SD3ControlNetModel)
    require(args.num_extra_conditioning_channels == 0, "--num_extra_conditioning_channels",
            args.num_extra_conditioning_channels,
            "0: StableDiffusion3ControlNetPipeline gives the ControlNet the conditioning image's latents alone")
    fill_dependent_defaults(args)
    return args


def controlnet_from_transformer(transformer, base):
    """A ControlNet copying the transformer's first `CONTROLNET_BLOCKS` blocks; of a smaller transformer, all but its
    last, which reads the prompt without passing it on (a ControlNet's blocks all pass it on)."""
    return SD3ControlNetModel.from_transformer(
        transformer, num_layers=min(CONTROLNET_BLOCKS, transformer.config.num_layers - 1),
        num_extra_conditioning_channels=0)


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, dataset_columns(args))
    validation_pairs = load_validation_pairs(args)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once, with the ControlNet among its components (without --controlnet_model_name_or_path,
    # one made from the loaded transformer's first blocks).
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    quantization = quantization_config(args, weight_dtype, base=["transformer"],
                                       text_encoders=["text_encoder", "text_encoder_2", "text_encoder_3"])
    pipe = load_controlnet_pipeline(StableDiffusion3ControlNetPipeline, StableDiffusion3Pipeline, args, weight_dtype,
                                    quantization, SD3ControlNetModel, controlnet_from_transformer)
    controlnet, transformer = pipe.controlnet, pipe.transformer
    text_encoders = [pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]
    noise_scheduler = training_noise_scheduler(pipe, FlowMatchEulerDiscreteScheduler)
    settings = sd3.prompt_settings(pipe, args)
    call_kwargs = sd3.call_kwargs(pipe, settings)

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
    frozen = FrozenEncoders(sd3.image_vae(pipe), text_encoders, transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)

    def encode_prompts(prompts):
        return sd3.encode_prompts(pipe, prompts, accelerator.device, settings)

    embeddings = frozen.text_embeddings(captions_with_empty(dataset[args.caption_column], args.caption_dropout),
                                        encode_prompts, sd3.prompt_dependencies(pipe, settings))
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

    # 5. The loop: flow matching in the transformer's own layout (`sd3`): the latents move on a straight line to
    # noise and the ControlNet-guided transformer predicts the velocity; the ControlNet reads the conditioning image's
    # latents and the prompt as the pipeline gives them to it (`sd3.controlnet_inputs`). After each optimizer step the
    # loop updates the EMA, checkpoints and validates when due (the final step included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            latents = sd3.normalized_latents(pipe, frozen.latents(batch["image"]))
            noise = torch.randn_like(latents)
            timesteps, sigmas = sample_flow_matching_timesteps(noise_scheduler, args, latents)
            text = sd3.text_inputs(prompt_rows(batch["prompt"]))
            inputs = sd3.model_inputs(pipe, add_noise(latents, noise, sigmas), timesteps, text)
            # The ControlNet turns the conditioning image into a residual for each of the frozen transformer's blocks.
            conditioning = conditioning_latents(frozen, batch["conditioning_pixel_values"])
            block_samples = models["controlnet"](**sd3.controlnet_inputs(pipe, inputs, conditioning),
                                                 return_dict=False)[0]
            output = transformer(**inputs, block_controlnet_hidden_states=block_samples, return_dict=False)[0]
            loss = flow_matching_loss(sd3.prediction(pipe, output, latents), latents, noise, sigmas, args)
            loop.backward_and_step(loss)

    # 6. Save the raw and EMA ControlNet from memory, check the files against it, and write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        finish_run(args, "ControlNet for SD3", controlnet_how_to_load(args, pipe), loop.records, saved, "ControlNet")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
