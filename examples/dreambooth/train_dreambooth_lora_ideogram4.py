#!/usr/bin/env python
# Copied from examples/dreambooth/train_dreambooth_lora_flux2_klein.py
"""Teach Ideogram 4 a subject from a few images (DreamBooth) with a LoRA on its transformer, by flow matching.

    accelerate launch train_dreambooth_lora_ideogram4.py \\
      --pretrained_model_name_or_path=ideogram-ai/ideogram-v4 \\
      --instance_data_dir=dog --instance_prompt="a photo of sks dog" --output_dir=out \\
      --rank=16 --use_ema --mixed_precision=bf16 --resolution=1024 --cache_latents --center_crop \\
      --max_sequence_length=512 --validation_prompt "a photo of sks dog in a bucket"

Writes ``pytorch_lora_weights.safetensors`` (with ``--use_ema`` also ``ema/pytorch_lora_weights.safetensors``),
which ``Ideogram4Pipeline.load_lora_weights(output_dir)`` loads, validation images with ``validation/log.jsonl``,
checkpoints to resume from, and a model card. The adapter is on the conditional ``transformer``; the
``unconditional_transformer`` of the pipeline's asymmetric guidance stays frozen, as upstream leaves it. With
``--with_prior_preservation``, missing class images are generated into ``--class_data_dir`` by the pipeline that
trains, before training starts. The text encoder (Qwen3-VL) embeds the prompts once, before training, exactly as the
pipeline's ``encode_prompt`` does (its chat template, its tapped layers), each prompt's features kept apart from the
image size, and ``--cache_latents`` encodes each image once (both flips); what is cached stays off the accelerator
except while validating. Flags of the upstream script that this one does not carry stop the run with one line
saying why.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.adapters.config import adapter_config
from training_utils.adapters.export import adapter_export
from training_utils.adapters.injection import add_adapter, linear_layers_named
from training_utils.args import (add_cache_args, add_lora_args, add_lora_layers_arg, check_args, comma_separated,
                                 export_formats, fill_dependent_defaults, training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import make_dataloader
from training_utils.data.dreambooth import (add_dreambooth_args, check_dreambooth_args, class_images_from_args,
                                            dreambooth_dataset, dreambooth_prompts, instance_images_from_args,
                                            instance_then_class_collate, training_captions,
                                            transformer_dreambooth_refusals)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform
from training_utils.data.prompts import cached_rows
from training_utils.ema import make_ema
from training_utils.families import ideogram4
from training_utils.flow_matching import add_flow_matching_args, add_noise, check_flow_matching_args, flow_matching_loss
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

# Upstream's default targets: each block's attention projections and its feed-forward's three layers.
LORA_LAYERS = "to_q,to_k,to_v,to_out.0,w1,w2,w3"
# Upstream's training draws noise levels from a logit-normal of this spread, the pipeline's sampling schedule's.
LOGIT_STD = 1.5
# The flags of upstream's script that this one does not carry, besides those no script here carries.
REFUSED = {
    "--guidance_scale": "upstream's flag is a FLUX.1 leftover that its script never reads: Ideogram 4's transformer "
                        "takes no guidance embedding; validation and class images use Ideogram4Pipeline's own "
                        "asymmetric guidance",
    "--disable_training_autocast": "the autocast damage it avoids (the image's rotary positions rounded in bf16) "
                                   "is fixed in diffusers' Ideogram 4 transformer, which computes them outside "
                                   "autocast; training runs under the usual mixed precision",
    "--upsample_prompt": "prompt upsampling (the prompt-enhancer head, sampling JSON captions) is not carried; "
                         "write the captions in Ideogram 4's JSON schema (--caption_extension, --caption_column)",
    "--prompt_enhancer_head_id": "it names the head of --upsample_prompt, which is not carried",
    **transformer_dreambooth_refusals(text_encoder_trains=False),
}


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=48)
    add_lora_args(parser, Ideogram4Pipeline)
    add_dreambooth_args(parser)
    ideogram4.add_args(parser)
    add_flow_matching_args(parser, weighting_scheme="logit_normal", logit_std=LOGIT_STD)
    add_lora_layers_arg(parser, LORA_LAYERS, "layers.0.adaln_modulation")
    add_cache_args(parser)
    add_fsdp_text_encoder_arg(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    check_dreambooth_args(args)
    check_flow_matching_args(args)
    ideogram4.check_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    instance_images = instance_images_from_args(args)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once. Its modules train, render validation images and generate the class images. Prompts are
    #    encoded as its own encode_prompt does, with the same settings everywhere: training, validation, class images.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    quantization = quantization_config(args, weight_dtype, base=["transformer", "unconditional_transformer"],
                                       text_encoders=["text_encoder"])
    pipe = load_pipeline(Ideogram4Pipeline, args, weight_dtype, quantization=quantization)
    transformer, text_encoders = pipe.transformer, [pipe.text_encoder]
    noise_scheduler = training_noise_scheduler(pipe, FlowMatchEulerDiscreteScheduler)
    settings = ideogram4.prompt_settings(pipe, args)
    call_kwargs = ideogram4.call_kwargs(pipe, settings)

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

    # 4. Data: class images first (only the missing ones are generated; the fresh adapter changes nothing yet).
    #    The frozen encoders run once, here, not in every step (the text encoder on the prompts; with
    #    --cache_latents, the VAE on each image), then leave the accelerator until validation. Optimizer,
    #    schedule, accelerate; the loop resumes if asked.
    transform = ImageTransform.from_args(args, pipe)
    frozen = FrozenEncoders(ideogram4.image_vae(pipe), text_encoders, transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)
    class_images = class_images_from_args(args, pipe, accelerator, [noise_scheduler], weight_dtype, frozen.on_device,
                                          call_kwargs=call_kwargs)

    def encode_prompts(prompts):
        return ideogram4.encode_prompts(pipe, prompts, accelerator.device, settings)

    embeddings = frozen.text_embeddings(dreambooth_prompts(args, instance_images), encode_prompts,
                                        ideogram4.prompt_dependencies(pipe, settings))
    dataset = dreambooth_dataset(instance_images, class_images, frozen, args.seed, args.repeats, args.caption_dropout,
                                 args.class_prompt)
    dataloader = accelerator.prepare(make_dataloader(dataset, args.train_batch_size, args.dataloader_num_workers,
                                                     instance_then_class_collate, args.seed))

    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
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
            latents = ideogram4.normalized_latents(pipe, frozen.latents(batch["images"]))
            noise = torch.randn_like(latents)
            timesteps, sigmas = ideogram4.sample_timesteps(pipe, noise_scheduler, args, latents)
            text = ideogram4.text_inputs(prompt_rows(batch["prompts"]))
            inputs = ideogram4.model_inputs(pipe, add_noise(latents, noise, sigmas), timesteps, text)
            output = models["transformer"](**inputs, return_dict=False)[0]
            loss = flow_matching_loss(ideogram4.prediction(pipe, output, latents), latents, noise, sigmas, args)
            loop.backward_and_step(loss)

    # 6. Save raw and EMA adapters from memory, check the files against it, and write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        how_to_load_text = how_to_load(export.loading_code, args, pipe,
                                       prompt=(args.validation_prompt or [args.instance_prompt])[0])
        finish_run(args, f"DreamBooth {export.title} (Ideogram 4)", how_to_load_text, loop.records, saved,
                   export.title, captions=training_captions(instance_images))
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
