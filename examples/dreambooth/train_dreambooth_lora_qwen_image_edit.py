#!/usr/bin/env python
# Copied from examples/dreambooth/train_dreambooth_lora_qwen_image.py; tests/test_drift.py keeps what they share alike.
"""Teach Qwen-Image-Edit an edit from examples (a target, its reference images and an instruction) with a LoRA on
its transformer, by flow matching.

    accelerate launch train_dreambooth_lora_qwen_image_edit.py \\
      --pretrained_model_name_or_path=Qwen/Qwen-Image-Edit-2509 \\
      --dataset_name=edits --image_column=image --cond_image_column=references --caption_column=instruction \\
      --output_dir=out --rank=16 --use_ema --mixed_precision=bf16 --resolution=1024 --cache_latents \\
      --quantize_base=nf4 --validation_prompt "make the dog wear a hat" --validation_image dog.png

The model's pipeline class chooses the pipeline: ``QwenImageEditPlusPipeline`` (2509, 2511) takes one to three
references a row, ``QwenImageEditPipeline`` (the first Edit) one; an Edit Plus row without a reference trains as
text-to-image. Writes ``pytorch_lora_weights.safetensors`` (with ``--use_ema`` also
``ema/pytorch_lora_weights.safetensors``), which the pipeline's ``load_lora_weights(output_dir)`` loads, validation
images rendered from ``--validation_image`` with ``validation/log.jsonl`` (each grid shows the references, then
raw, then EMA), checkpoints to resume from, and a model card. The text encoder (Qwen2.5-VL) sees the references, so
each row's instruction is embedded with its references, once, before training, exactly as the pipeline's
``encode_prompt`` does; the references' latents are cached with ``--cache_latents``; what is cached stays off the
accelerator except while validating.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImageEditPlusPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.adapters.config import adapter_config
from training_utils.adapters.export import adapter_export
from training_utils.adapters.injection import ATTENTION_PROJECTIONS, add_adapter, linear_layers_named
from training_utils.args import (add_cache_args, add_lora_args, add_lora_layers_arg, check_args, comma_separated,
                                 export_formats, fill_dependent_defaults, training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import make_dataloader
from training_utils.data.dreambooth import training_captions, transformer_dreambooth_refusals
from training_utils.data.edit import add_edit_args, check_edit_args, edit_rows_from_args, how_to_edit, validation_inputs
from training_utils.data.edit_samples import References, edit_collate, edit_dataset, embeddings_with_references
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform
from training_utils.data.prompts import cached_rows
from training_utils.ema import make_ema
from training_utils.errors import require
from training_utils.families import qwen_image_edit
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
from training_utils.validation import make_validator

# Qwen-Image's default targets: the image stream's attention projections in every block.
LORA_LAYERS = ",".join(ATTENTION_PROJECTIONS)
# The Qwen-Image script's flags that this one does not carry.
REFUSED = {
    **dict.fromkeys(["--class_data_dir", "--class_prompt", "--with_prior_preservation", "--prior_loss_weight",
                     "--num_class_images", "--sample_batch_size", "--class_inference_steps"],
                    "no prior preservation: an edit model learns an edit from its examples, not a subject"),
    "--max_sequence_length": "the Qwen-Image-Edit pipelines never cut a prompt",
    **transformer_dreambooth_refusals(text_encoder_trains=False),
}


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=50)
    add_lora_args(parser, QwenImageEditPlusPipeline)
    add_edit_args(parser)
    qwen_image_edit.add_args(parser)
    add_flow_matching_args(parser, weighting_scheme="none")
    add_lora_layers_arg(parser, LORA_LAYERS, "transformer_blocks.0.attn.add_q_proj")
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    check_edit_args(args)
    check_flow_matching_args(args)
    qwen_image_edit.check_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load: the model's pipeline
    #    class says how many references a row may have (the first Edit's needs its one).
    pipeline_class = qwen_image_edit.pipeline_class(args)
    fewest, most = qwen_image_edit.REFERENCES[pipeline_class.__name__]
    rows = edit_rows_from_args(args, max_references=most)
    require(min(map(len, rows.references)) >= fewest, "--cond_image_column", args.cond_image_column,
            f"{fewest} reference image in every row for {pipeline_class.__name__}")
    single_reference = pipeline_class is QwenImageEditPipeline
    validation = validation_inputs(args, single_reference=single_reference)
    require(all(validation["conditioning_images"]), "--validation_image", args.validation_image,
            "reference images for every --validation_prompt (the edit pipelines render from references)")
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once (its processor without a video processor: no torchvision). Its modules train and render
    #    validation images; prompts with their references are encoded as its own encode_prompt does.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    quantization = quantization_config(args, weight_dtype, base=["transformer"], text_encoders=["text_encoder"])
    pipe = load_pipeline(pipeline_class, args, weight_dtype, quantization=quantization,
                         processor=qwen_image_edit.load_processor(args.pretrained_model_name_or_path, args.revision,
                                                                  args.cache_dir))
    transformer, text_encoders = pipe.transformer, [pipe.text_encoder]
    with qwen_image_edit.references_at_area(pipe, args.reference_area):  # in training and validation alike
        noise_scheduler = training_noise_scheduler(pipe, FlowMatchEulerDiscreteScheduler)
        settings = qwen_image_edit.prompt_settings(pipe, args)
        call_kwargs = qwen_image_edit.call_kwargs(pipe, settings)

        # 3. An adapter (--adapter) on the transformer; the EMA tracks it. The text encoder and the VAE stay frozen.
        add_adapter(transformer,
                    adapter_config(args, linear_layers_named(transformer, comma_separated(args.lora_layers))))
        trained = {"transformer": transformer}
        prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, *text_encoders])
        if args.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        compile_repeated_blocks(transformer, args.torch_compile)
        parameters = trainable_parameters(trained)
        export = adapter_export(type(pipe), trained, export_formats(args))
        ema = make_ema(args, parameters, accelerator)
        posthoc = make_posthoc_ema(args, parameters, accelerator, export)

        # 4. Data: targets bucketed, references laid out as the pipeline lays them out. The frozen encoders run once,
        #    here, not in every step (the text encoder on each row's instructions with its references; with
        #    --cache_latents, the VAE on each target and reference), then leave the accelerator until validation.
        #    Optimizer, schedule, accelerate; the loop resumes if asked.
        transform = ImageTransform.from_args(args, pipe)
        frozen = FrozenEncoders(qwen_image_edit.image_vae(pipe), text_encoders, transform, accelerator.device,
                                weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                                offload=args.offload, seed=args.seed)

        def encode_prompts(prompts):
            return qwen_image_edit.encode_prompts(pipe, prompts, accelerator.device, settings)

        embeddings = embeddings_with_references(frozen, rows, args.caption_dropout, encode_prompts,
                                                qwen_image_edit.prompt_dependencies(pipe, settings), args.random_flip)
        lay_out, layout_dependencies = qwen_image_edit.reference_layout(pipe)
        references = References(lay_out, frozen, layout_dependencies)
        dataset = edit_dataset(rows, frozen, references, args.seed, args.repeats, args.caption_dropout)
        dataloader = accelerator.prepare(make_dataloader(dataset, args.train_batch_size, args.dataloader_num_workers,
                                                         edit_collate, args.seed))

        max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
        optimizer = make_optimizer(args, parameters, accelerator.num_processes)
        lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
        models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
        prompt_rows = cached_rows(embeddings, accelerator.device)  # each sample's by its (row, instruction, flip)

        validator = make_validator(args, pipe, accelerator, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
                                   weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
                                   call_kwargs={**validation_size(args, dataset.target_shapes), **call_kwargs},
                                   **validation)
        loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                            steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
        accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

        # 5. The loop: flow matching in the transformer's own layout and conventions (the family module's): the target's
        # latents move on a straight line to noise and the transformer predicts the velocity, noise - latents, reading
        # the clean references' tokens after the target's, and each sample's instruction embedded with its references.
        # After each optimizer step the loop updates the EMA, checkpoints and validates when due (the final step
        # included, once).
        for model in models.values():
            model.train()
        for batch in loop:
            with accelerator.accumulate(*models.values()):
                latents = qwen_image_edit.normalized_latents(pipe, frozen.latents(batch["images"]))
                reference_latents = qwen_image_edit.reference_latents(pipe, references.parameters(batch["references"]))
                noise = torch.randn_like(latents)
                timesteps, sigmas = sample_flow_matching_timesteps(noise_scheduler, args, latents)
                text = qwen_image_edit.text_inputs(prompt_rows(zip(batch["rows"], batch["prompts"], batch["flips"])))
                inputs = qwen_image_edit.model_inputs(pipe, add_noise(latents, noise, sigmas), timesteps, text,
                                                      reference_latents)
                output = models["transformer"](**inputs, return_dict=False)[0]
                loss = flow_matching_loss(qwen_image_edit.prediction(pipe, output, latents), latents, noise, sigmas,
                                          args)
                loop.backward_and_step(loss)

    # 6. Save raw and EMA adapters from memory, check the files against it, and write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        captions = training_captions(rows)
        template, fields = how_to_edit(export.loading_code, args, single_reference=single_reference)
        how_to_load_text = how_to_load(template, args, pipe, prompt=(args.validation_prompt or captions)[0], **fields)
        finish_run(args, f"Edit {export.title} (Qwen-Image-Edit)", how_to_load_text, loop.records, saved,
                   export.title, captions=captions)
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
