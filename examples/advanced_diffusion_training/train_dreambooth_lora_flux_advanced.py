#!/usr/bin/env python
# Copied from examples/dreambooth/train_dreambooth_lora_flux.py; tests/test_drift.py keeps what they share alike.
"""Teach FLUX.1 [dev] or [schnell] a subject by pivotal tuning: new tokens' embeddings in CLIP (and T5) and a LoRA.

    accelerate launch train_dreambooth_lora_flux_advanced.py \\
      --pretrained_model_name_or_path=black-forest-labs/FLUX.1-dev \\
      --instance_data_dir=dog --instance_prompt="a photo of TOK dog" --output_dir=out --resolution=1024 \\
      --train_text_encoder_ti --enable_t5_ti --token_abstraction=TOK --num_new_tokens_per_abstraction=2 \\
      --train_text_encoder_ti_frac=0.5 --mixed_precision=bf16 --validation_prompt "a photo of TOK dog in a bucket"

With ``--train_text_encoder_ti`` each ``--token_abstraction`` of the prompts stands for new tokens (``<s0><s1>``)
whose embeddings train in the CLIP encoder, and with ``--enable_t5_ti`` in T5 too (every other row stays bitwise as
it loaded), for the first ``--train_text_encoder_ti_frac`` of the optimizer steps, then stay as they are while the
LoRA goes on (for its ``--train_transformer_frac``; 0 trains the tokens alone). ``--train_text_encoder`` trains a
LoRA on the CLIP encoder instead of new tokens, as upstream's. Writes ``pytorch_lora_weights.safetensors`` (the
transformer's adapter and, with ``--train_text_encoder``, CLIP's), which ``FluxPipeline.load_lora_weights(output_dir)``
loads, and ``<output folder name>_emb.safetensors`` (``clip_l``, and ``t5``), which ``pipe.load_textual_inversion``
loads into each text encoder and the UIs load as an embedding; with ``--use_ema`` both again under ``ema/``;
validation images with ``validation/log.jsonl``, checkpoints to resume from, and a model card. Missing class images
are generated into ``--class_data_dir`` by the pipeline that trains, before training starts. While a text encoder
trains both run in every step; else they embed the prompts once, and ``--cache_latents`` encodes each image once
(both flips), before training.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.adapters.config import adapter_config
from training_utils.adapters.export import adapter_export
from training_utils.adapters.injection import CLIP_ATTENTION_PROJECTIONS, add_adapter, linear_layers_named
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
from training_utils.data.prompts import cached_rows, encoded_rows
from training_utils.ema import make_ema
from training_utils.embeddings import load_tokenizers
from training_utils.errors import require
from training_utils.families import flux
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
from training_utils.pivotal import (FLUX_EMBEDDING_KEYS, PivotalExport, PivotalTokens, TrainingStops,
                                    abstraction_tokens, add_pivotal_args, check_new_tokens, check_pivotal_args,
                                    embedding_file, stop_step)
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.quantization import quantization_config
from training_utils.validation import make_validator

# Upstream's default targets: every block's attention projections (the single-stream blocks' q, k and v among
# them), and the double-stream blocks' feed-forward layers, of the image and the text stream.
LORA_LAYERS = ("attn.to_k,attn.to_q,attn.to_v,attn.to_out.0,attn.add_k_proj,attn.add_q_proj,attn.add_v_proj,"
               "attn.to_add_out,ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2")
# The flags of upstream's script that this one does not carry, besides those no script here carries.
REFUSED = transformer_dreambooth_refusals(text_encoder_trains=True)


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=50, interpolation="lanczos")
    add_lora_args(parser, FluxPipeline, train_text_encoder=True)
    parser.set_defaults(text_encoder_lr=5e-6, adam_weight_decay_text_encoder=1e-3)  # upstream's
    add_dreambooth_args(parser)
    flux.add_args(parser)
    add_flow_matching_args(parser, weighting_scheme="none")
    add_lora_layers_arg(parser, LORA_LAYERS, "single_transformer_blocks.0.proj_mlp")
    add_pivotal_args(parser)
    group = parser.add_argument_group("FLUX.1 pivotal tuning")
    group.add_argument("--enable_t5_ti", action="store_true",
                       help="train the new tokens' embeddings in T5 too, not only in CLIP")
    group.add_argument("--train_transformer_frac", type=float, default=1.0,
                       help="the fraction of the optimizer steps during which the transformer's LoRA trains (0: "
                            "the new tokens alone train, textual inversion)")
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    check_dreambooth_args(args)
    check_flow_matching_args(args)
    check_pivotal_args(args)
    # Upstream's rules: the CLIP encoder trains a LoRA or new tokens, not both; the LoRA stops early only beside
    # new tokens that train to the end.
    require(not (args.train_text_encoder and args.train_text_encoder_ti), "--train_text_encoder", True,
            "no --train_text_encoder_ti beside it (CLIP trains either a LoRA or new tokens)")
    require(args.train_text_encoder_ti or not args.enable_t5_ti, "--enable_t5_ti", True,
            "--train_text_encoder_ti beside it (T5's new tokens are those of the pivotal tuning)")
    require(0 <= args.train_transformer_frac <= 1, "--train_transformer_frac", args.train_transformer_frac,
            "a fraction in [0, 1]")
    require(args.train_transformer_frac == 1 or args.train_text_encoder_ti, "--train_transformer_frac",
            args.train_transformer_frac, "1 unless --train_text_encoder_ti trains new tokens")
    require(args.train_transformer_frac == 1 or args.train_text_encoder_ti_frac == 1, "--train_transformer_frac",
            args.train_transformer_frac, "1 unless --train_text_encoder_ti_frac is 1 (one of the two trains to the end)")
    flux.check_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    instance_images = instance_images_from_args(args)
    tokenizers = load_tokenizers(args, ("tokenizer", "tokenizer_2") if args.enable_t5_ti else ("tokenizer",))
    abstractions = abstraction_tokens(args, *tokenizers.values()) if args.train_text_encoder_ti else {}
    check_new_tokens(tokenizers, abstractions, args.initializer_concept)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once. Its modules train, render validation images and generate the class images. Prompts are
    #    encoded as its own encode_prompt does, with the same settings everywhere: training, validation, class images.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    quantization = quantization_config(args, weight_dtype, base=["transformer"],
                                       text_encoders=["text_encoder", "text_encoder_2"])
    pipe = load_pipeline(FluxPipeline, args, weight_dtype, quantization=quantization, **tokenizers)
    transformer, text_encoders = pipe.transformer, [pipe.text_encoder, pipe.text_encoder_2]
    noise_scheduler = training_noise_scheduler(pipe, FlowMatchEulerDiscreteScheduler)
    settings = flux.prompt_settings(pipe, args)
    call_kwargs = flux.call_kwargs(pipe, settings)

    # 3. The new tokens (--train_text_encoder_ti) in CLIP (and with --enable_t5_ti in T5), their rows in fp32; adapters
    #    (--adapter) on the transformer (and with --train_text_encoder on CLIP instead of new tokens). The EMA tracks
    #    them all; each stops training at its fraction of the run.
    token_encoders = {"text_encoder": "tokenizer", **({"text_encoder_2": "tokenizer_2"} if args.enable_t5_ti else {})}
    tokens = PivotalTokens(pipe, token_encoders, abstractions, args.initializer_concept,
                           args.seed or 0) if abstractions else None
    add_adapter(transformer, adapter_config(args, linear_layers_named(transformer, comma_separated(args.lora_layers))))
    adapted = {"transformer": transformer}
    if args.train_text_encoder:
        adapted["text_encoder"] = pipe.text_encoder
        add_adapter(pipe.text_encoder, adapter_config(args, CLIP_ATTENTION_PROJECTIONS))
    trained = {**adapted, **(tokens.text_encoders if tokens is not None else {})}
    # Unless a text encoder trains, both run once, to cache the prompts' embeddings, and stay off the accelerator; if
    # one does, both run in every step, on the accelerator.
    text_encoders_train = len(trained) > 1
    if text_encoders_train:
        text_encoders = []
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, *text_encoders])
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
        for name, module in trained.items():
            if name != "transformer":
                module.gradient_checkpointing_enable()
    compile_repeated_blocks(transformer, args.torch_compile)
    export = adapter_export(type(pipe), adapted, export_formats(args))
    if tokens is not None:
        export = PivotalExport(export, tokens.parameter_names(trained), tokens.tokens,
                               embedding_file(args.output_dir), trained, keys=FLUX_EMBEDDING_KEYS)
    parameters = trainable_parameters(trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: class images first (only the missing ones are generated; the fresh adapters change nothing yet).
    #    Frozen encoders run once, here, not in every step (frozen text encoders on the prompts; with
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

    if not text_encoders_train:
        embeddings = frozen.text_embeddings(dreambooth_prompts(args, instance_images), encode_prompts,
                                            flux.prompt_dependencies(pipe, settings))
    dataset = dreambooth_dataset(instance_images, class_images, frozen, args.seed, args.repeats, args.caption_dropout,
                                 args.class_prompt)
    dataloader = accelerator.prepare(make_dataloader(dataset, args.train_batch_size, args.dataloader_num_workers,
                                                     instance_then_class_collate, args.seed))

    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    # The new rows stop training after --train_text_encoder_ti_frac of the steps, CLIP's adapter after
    # --train_text_encoder_frac and the transformer's after --train_transformer_frac (upstream's pivots; its 0, pure
    # textual inversion, never trains it): from then on the optimizer leaves them bitwise as they are.
    stops = {}

    def stop(step, component):
        stops.setdefault(step, []).extend(parameter for name, parameter in parameters.items()
                                          if name.startswith(f"{component}."))

    if tokens is not None:
        for component in tokens.text_encoders:
            stop(stop_step(args.train_text_encoder_ti_frac, max_train_steps), component)
    if args.train_text_encoder:
        stop(stop_step(args.train_text_encoder_frac, max_train_steps), "text_encoder")
    if args.train_transformer_frac < 1:
        stop(stop_step(args.train_transformer_frac, max_train_steps) if args.train_transformer_frac else 0,
             "transformer")
    stops = TrainingStops(optimizer, stops)
    if tokens is not None:  # while they train, the new rows are kept near the vocabulary's scale, as upstream's are
        tokens.keep_scale(optimizer, stops)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    if text_encoders_train:  # the step encodes its prompts through the wrapped encoders, so gradients sync
        def replaced(prompts):
            return [tokens.replaced(prompt) for prompt in prompts] if tokens is not None else list(prompts)

        prompt_rows = encoded_rows(lambda prompts: flux.encode_prompts(pipe, replaced(prompts), accelerator.device,
                                                                       settings, text_encoders=models))
    else:
        prompt_rows = cached_rows(embeddings, accelerator.device)

    # Validation's prompts name the abstractions as the training prompts do; it renders them spelled out.
    validation_prompts = ([tokens.replaced(prompt) for prompt in args.validation_prompt]
                          if tokens is not None and args.validation_prompt else None)
    validator = make_validator(args, pipe, accelerator, prompts=validation_prompts, ema=ema, posthoc=posthoc,
                               schedulers=[noise_scheduler], weight_dtype=weight_dtype,
                               encoders_on_device=frozen.on_device,
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
        stops.at(loop.global_step)
        with accelerator.accumulate(*models.values()):
            latents = flux.normalized_latents(pipe, frozen.latents(batch["images"]))
            noise = torch.randn_like(latents)
            timesteps, sigmas = sample_flow_matching_timesteps(noise_scheduler, args, latents)
            text = flux.text_inputs(prompt_rows(batch["prompts"]))
            inputs = flux.model_inputs(pipe, add_noise(latents, noise, sigmas), timesteps, text)
            output = models["transformer"](**inputs, return_dict=False)[0]
            loss = flow_matching_loss(flux.prediction(pipe, output, latents), latents, noise, sigmas, args)
            loop.backward_and_step(loss)

    # 6. Save raw and EMA adapters (and the new tokens' embeddings) from memory, check the files against it, and write
    #    the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        prompt = (args.validation_prompt or [args.instance_prompt])[0]
        if tokens is not None:
            how_to_load_text = export.loading_code(args, pipe, tokens.replaced(prompt))
        else:
            how_to_load_text = how_to_load(export.loading_code, args, pipe, prompt=prompt)
        finish_run(args, f"DreamBooth {export.title} (FLUX.1)", how_to_load_text, loop.records, saved,
                   export.title, captions=training_captions(instance_images))
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
