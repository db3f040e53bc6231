#!/usr/bin/env python
# Copied from examples/dreambooth/train_dreambooth_lora_flux2_klein.py
"""Teach FLUX.2 [klein] an edit (a target rendered from reference images and an instruction) with a LoRA on its
transformer, by flow matching.

    accelerate launch train_dreambooth_lora_flux2_klein_img2img.py \\
      --pretrained_model_name_or_path=black-forest-labs/FLUX.2-klein-base-4B \\
      --dataset_name=edits --image_column=target --cond_image_column=references --caption_column=instruction \\
      --output_dir=out --rank=16 --use_ema --mixed_precision=bf16 --resolution=1024 --cache_latents --center_crop \\
      --validation_prompt "make the dog blue" --validation_image dog.png

Writes ``pytorch_lora_weights.safetensors`` (with ``--use_ema`` also ``ema/pytorch_lora_weights.safetensors``),
which ``Flux2KleinPipeline.load_lora_weights(output_dir)`` loads for ``pipe(prompt, image=[references])``,
validation images (the references, then raw and EMA renders, in each step's grid) with ``validation/log.jsonl``,
checkpoints to resume from, and a model card. A row's references (none, one or several: ``--cond_image_column``)
are laid out, encoded and placed after the target's tokens exactly as the pipeline does its ``image=``; a row
without one trains as text-to-image. The text encoder (Qwen3) embeds the instructions once, before training, as
the pipeline's ``encode_prompt`` does, and ``--cache_latents`` encodes each target (both flips) and each reference
(both flips: it mirrors with its target) once; what is cached stays off the accelerator except while validating.
Flags of the upstream script that this one does not carry stop the run with one line saying why.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.adapters.config import adapter_config
from training_utils.adapters.export import adapter_export
from training_utils.adapters.injection import add_adapter, linear_layers_named
from training_utils.args import (add_cache_args, add_lora_args, add_lora_layers_arg, check_args, comma_separated,
                                 export_formats, fill_dependent_defaults, training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.data.buckets import validation_size
from training_utils.data.captions import distinct_captions
from training_utils.data.datasets import make_dataloader
from training_utils.data.dreambooth import CAPTIONS_ON_THE_CARD, transformer_dreambooth_refusals
from training_utils.data.edit import (EDIT_REFUSALS, add_edit_args, check_edit_args, edit_rows_from_args, how_to_edit,
                                      validation_inputs)
from training_utils.data.edit_samples import References, edit_collate, edit_dataset, edit_prompts
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform
from training_utils.data.prompts import cached_rows
from training_utils.ema import make_ema
from training_utils.families import flux2
from training_utils.flow_matching import (add_flow_matching_args, add_noise, check_flow_matching_args,
                                          flow_matching_loss, sample_flow_matching_timesteps)
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import save_with_ema
from training_utils.outputs.hub import finish_run, how_to_load
from training_utils.outputs.run_status import run_script
from training_utils.parser import add_refused_args
from training_utils.pipeline import (load_pipeline, prepare_components, trainable_parameters, training_noise_scheduler,
                                     weight_dtype_for)
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.quantization import quantization_config
from training_utils.sharding.text_encoders import add_fsdp_text_encoder_arg, shard_text_encoders
from training_utils.validation import make_validator

# Upstream's default targets: the double-stream blocks' attention projections, and the single-stream blocks'
# fused input projection and output (whose linear layer is "attn.to_out" there, "attn.to_out.0" in the others).
LORA_LAYERS = "to_k,to_q,to_v,to_out.0,to_qkv_mlp_proj,attn.to_out"
# The flags of upstream's script that this one does not carry, besides those no script here carries.
REFUSED = {
    "--guidance_scale": "FLUX.2 [klein]'s transformer takes no guidance embedding (Flux2KleinPipeline passes none, "
                        "and upstream's script ignores the flag for it)",
    **transformer_dreambooth_refusals(text_encoder_trains=False),
    **EDIT_REFUSALS,
}


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=50)
    add_lora_args(parser, Flux2KleinPipeline)
    add_edit_args(parser)
    flux2.add_args(parser)
    add_flow_matching_args(parser, weighting_scheme="none")
    add_lora_layers_arg(parser, LORA_LAYERS, "single_transformer_blocks.0.attn.to_qkv_mlp_proj")
    add_cache_args(parser)
    add_fsdp_text_encoder_arg(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    check_edit_args(args)
    check_flow_matching_args(args)
    flux2.check_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load: the rows, their
    #    references and the validation references (read, and their sizes checked against the pipeline's rules).
    rows = edit_rows_from_args(args, check_size=flux2.check_reference_size)
    validation = validation_inputs(args, check_size=flux2.check_reference_size)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once. Its modules train and render validation images. Prompts are encoded as its own
    #    encode_prompt does, with the same settings everywhere: training and validation.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    quantization = quantization_config(args, weight_dtype, base=["transformer"], text_encoders=["text_encoder"])
    pipe = load_pipeline(Flux2KleinPipeline, args, weight_dtype, quantization=quantization)
    transformer, text_encoders = pipe.transformer, [pipe.text_encoder]
    noise_scheduler = training_noise_scheduler(pipe, FlowMatchEulerDiscreteScheduler)
    settings = flux2.prompt_settings(pipe, args)
    call_kwargs = flux2.call_kwargs(pipe, settings)

    # 3. An adapter (--adapter) on the transformer; the EMA tracks it. The text encoder and the VAE stay frozen.
    add_adapter(transformer, adapter_config(args, linear_layers_named(transformer, comma_separated(args.lora_layers))))
    trained = {"transformer": transformer}
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, *text_encoders])
    shard_text_encoders(accelerator, text_encoders, args.fsdp_text_encoder)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    compile_repeated_blocks(transformer, args.torch_compile)
    parameters = trainable_parameters(trained)
    export = adapter_export(type(pipe), trained, export_formats(args))
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: the frozen encoders run once, here, not in every step (the text encoder on the instructions; with
    #    --cache_latents, the VAE on each target and reference), then leave the accelerator until validation.
    #    Samples batch with samples of the same target and reference shapes. Optimizer, schedule, accelerate; the
    #    loop resumes if asked.
    transform = ImageTransform.from_args(args, pipe)
    frozen = FrozenEncoders(flux2.image_vae(pipe), text_encoders, transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)
    lay_out, layout_dependencies = flux2.reference_layout(pipe)
    references = References(lay_out, frozen, layout_dependencies)

    def encode_prompts(prompts):
        return flux2.encode_prompts(pipe, prompts, accelerator.device, settings)

    embeddings = frozen.text_embeddings(edit_prompts(rows, args.caption_dropout), encode_prompts,
                                        flux2.prompt_dependencies(pipe, settings))
    dataset = edit_dataset(rows, frozen, references, args.seed, args.repeats, args.caption_dropout)
    dataloader = accelerator.prepare(make_dataloader(dataset, args.train_batch_size, args.dataloader_num_workers,
                                                     edit_collate, args.seed))

    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    prompt_rows = cached_rows(embeddings, accelerator.device)

    validator = make_validator(args, pipe, accelerator, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
                               weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
                               call_kwargs={**validation_size(args, dataset.target_shapes), **call_kwargs},
                               **validation)
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: flow matching in the transformer's own layout and conventions (the family module's): the target's
    # latents move on a straight line to noise and the transformer predicts the velocity, noise - latents, reading
    # the references' clean tokens after the target's (their output is dropped). Each sample trains on its
    # instruction's embedding. After each optimizer step the loop updates the EMA, checkpoints and validates when
    # due (the final step included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            latents = flux2.normalized_latents(pipe, frozen.latents(batch["images"]))
            reference_latents = flux2.reference_latents(pipe, references.parameters(batch["references"]))
            noise = torch.randn_like(latents)
            timesteps, sigmas = sample_flow_matching_timesteps(noise_scheduler, args, latents)
            text = flux2.text_inputs(prompt_rows(batch["prompts"]))
            inputs = flux2.model_inputs(pipe, add_noise(latents, noise, sigmas), timesteps, text, reference_latents)
            output = models["transformer"](**inputs, return_dict=False)[0]
            loss = flow_matching_loss(flux2.prediction(pipe, output, latents), latents, noise, sigmas, args)
            loop.backward_and_step(loss)

    # 6. Save raw and EMA adapters from memory, check the files against it, and write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        captions = distinct_captions(rows.captions)
        template, fields = how_to_edit(export.loading_code, args)
        how_to_load_text = how_to_load(template, args, pipe, prompt=(args.validation_prompt or captions)[0], **fields)
        finish_run(args, f"Edit {export.title} (FLUX.2 [klein])", how_to_load_text, loop.records, saved,
                   export.title, captions=captions[:CAPTIONS_ON_THE_CARD])
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
