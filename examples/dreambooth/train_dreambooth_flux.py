#!/usr/bin/env python
# Copied from examples/dreambooth/train_dreambooth_lora_flux.py; tests/test_drift.py keeps what they share alike.
"""Teach FLUX.1 [dev] or [schnell] a subject from a few images (DreamBooth) by fine-tuning its whole transformer.

    accelerate launch train_dreambooth_flux.py \\
      --pretrained_model_name_or_path=black-forest-labs/FLUX.1-dev \\
      --instance_data_dir=dog --instance_prompt="a photo of sks dog" --output_dir=out \\
      --use_ema --ema_device=cpu --ema_update_every=10 --mixed_precision=bf16 --resolution=1024 \\
      --gradient_checkpointing --validation_prompt "a photo of sks dog in a bucket"

Every parameter of the transformer trains (and, with ``--train_text_encoder``, of the CLIP encoder; T5 stays
frozen), in fp32, by flow matching; [dev]'s transformer embeds ``--guidance_scale`` beside the prompts. Writes a full
pipeline holding what trained to ``output_dir`` (``FluxPipeline.from_pretrained`` loads it) and, with ``--use_ema``,
the EMA of what trained to ``output_dir/ema/transformer`` (and ``ema/text_encoder``); validation images with
``validation/log.jsonl``, checkpoints to resume from, and a model card. With ``--with_prior_preservation``, missing
class images are generated into ``--class_data_dir`` by the pipeline that trains, before training starts. Frozen
text encoders (CLIP and T5) embed the prompts once, exactly as the pipeline's ``encode_prompt`` does, and
``--cache_latents`` encodes each image once (both flips), before training; what is cached stays off the accelerator
except while validating.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import (add_cache_args, add_text_encoder_training_args, check_args, fill_dependent_defaults,
                                 training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import make_dataloader
from training_utils.data.dreambooth import (add_dreambooth_args, check_dreambooth_args, class_images_from_args,
                                            dreambooth_dataset, dreambooth_prompts,
                                            instance_images_from_args, instance_then_class_collate, training_captions)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform
from training_utils.data.prompts import cached_rows, encoded_rows
from training_utils.ema import make_ema
from training_utils.families import flux
from training_utils.flow_matching import (add_flow_matching_args, add_noise, check_flow_matching_args,
                                          flow_matching_loss, sample_flow_matching_timesteps)
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import PipelineExport, save_with_ema
from training_utils.outputs.hub import fine_tuned_how_to_load, finish_run
from training_utils.outputs.run_status import run_script
from training_utils.pipeline import (load_pipeline, prepare_components, trainable_parameters, training_noise_scheduler,
                                     weight_dtype_for)
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.validation import make_validator

def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=50, interpolation="lanczos")
    add_text_encoder_training_args(parser, "fine-tune every parameter of the CLIP text encoder too (T5 stays frozen)")
    parser.set_defaults(text_encoder_lr=5e-6, adam_weight_decay_text_encoder=1e-3)  # upstream's
    add_dreambooth_args(parser)
    flux.add_args(parser)
    add_flow_matching_args(parser, weighting_scheme="none")
    add_cache_args(parser)
    args = parser.parse_args(argv)
    check_args(args)
    check_dreambooth_args(args)
    check_flow_matching_args(args)
    flux.check_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    instance_images = instance_images_from_args(args)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once. Its modules train, render validation images and generate the class images. Prompts are
    #    encoded as its own encode_prompt does, with the same settings everywhere: training, validation, class images.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    trained_names = ["transformer", "text_encoder"] if args.train_text_encoder else ["transformer"]
    pipe = load_pipeline(FluxPipeline, args, weight_dtype, trained_in_fp32=trained_names)
    transformer, text_encoders = pipe.transformer, [pipe.text_encoder, pipe.text_encoder_2]
    noise_scheduler = training_noise_scheduler(pipe, FlowMatchEulerDiscreteScheduler)
    settings = flux.prompt_settings(pipe, args)
    call_kwargs = flux.call_kwargs(pipe, settings)

    # 3. The whole transformer (and maybe the CLIP encoder, never T5) trains, in fp32; the EMA is made from their live
    #    tensors.
    trained = {name: getattr(pipe, name) for name in trained_names}
    for module in trained.values():
        module.requires_grad_(True)
    # Unless they train, the text encoders run once, to cache the prompts' embeddings, and stay off the accelerator;
    # if CLIP's does, both run in every step, on the accelerator.
    if args.train_text_encoder:
        text_encoders = []
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, *text_encoders])
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
        for name, module in trained.items():
            if name != "transformer":
                module.gradient_checkpointing_enable()
    compile_repeated_blocks(transformer, args.torch_compile)
    parameters = trainable_parameters(trained)
    export = PipelineExport(pipe, trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: class images first (only the missing ones are generated, by the base model: nothing has trained yet).
    #    The frozen encoders run once, here, not in every step (the text encoders on the prompts; with
    #    --cache_latents, the VAE on each image), then leave the accelerator until validation. Optimizer,
    #    schedule, accelerate; the loop resumes if asked.
    transform = ImageTransform.from_args(args, pipe)
    frozen = FrozenEncoders(flux.image_vae(pipe), text_encoders, transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)
    class_images = class_images_from_args(args, pipe, accelerator, [noise_scheduler], weight_dtype, frozen.on_device,
                                          call_kwargs=call_kwargs)

    def encode_prompts(prompts):
        return flux.encode_prompts(pipe, prompts, accelerator.device, settings)

    if not args.train_text_encoder:
        embeddings = frozen.text_embeddings(dreambooth_prompts(args, instance_images), encode_prompts,
                                            flux.prompt_dependencies(pipe, settings))
    dataset = dreambooth_dataset(instance_images, class_images, frozen, args.seed, args.repeats, args.caption_dropout,
                                 args.class_prompt)
    dataloader = accelerator.prepare(make_dataloader(dataset, args.train_batch_size, args.dataloader_num_workers,
                                                     instance_then_class_collate, args.seed))

    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    if args.train_text_encoder:  # the step encodes its prompts through the wrapped encoder, so gradients sync
        prompt_rows = encoded_rows(lambda prompts: flux.encode_prompts(pipe, prompts, accelerator.device, settings,
                                                                      text_encoders=models))
    else:
        prompt_rows = cached_rows(embeddings, accelerator.device)

    validator = make_validator(args, pipe, accelerator, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
                               weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
                               call_kwargs={**validation_size(args, dataset.shapes), **call_kwargs})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: flow matching in the transformer's own layout and conventions (the family module's): the latents
    # move on a straight line to noise and the transformer predicts the velocity, noise - latents. Each image trains
    # on its prompt's embedding; with prior preservation the loss adds the class half's, weighted. After each
    # optimizer step the loop updates the EMA, checkpoints and validates when due (the final step included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            latents = flux.normalized_latents(pipe, frozen.latents(batch["images"]))
            noise = torch.randn_like(latents)
            timesteps, sigmas = sample_flow_matching_timesteps(noise_scheduler, args, latents)
            text = flux.text_inputs(prompt_rows(batch["prompts"]))
            inputs = flux.model_inputs(pipe, add_noise(latents, noise, sigmas), timesteps, text)
            output = models["transformer"](**inputs, return_dict=False)[0]
            loss = flow_matching_loss(flux.prediction(pipe, output, latents), latents, noise, sigmas, args)
            loop.backward_and_step(loss)

    # 6. Save the pipeline with what trained and the EMA's models from memory, check the files, write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        how_to_load_text = fine_tuned_how_to_load(args, pipe, ema, "transformer",
                                                  prompt=(args.validation_prompt or [args.instance_prompt])[0])
        finish_run(args, "DreamBooth fine-tune (FLUX.1)", how_to_load_text, loop.records, saved,
                   "transformer and CLIP text encoder" if args.train_text_encoder else "transformer",
                   captions=training_captions(instance_images))
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
