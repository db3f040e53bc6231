#!/usr/bin/env python
# Copied from examples/dreambooth/train_dreambooth_lora_sdxl.py; tests/test_drift.py keeps what they share alike.
"""Teach Stable Diffusion XL a subject by pivotal tuning: new tokens' embeddings in both text encoders and a LoRA.

    accelerate launch train_dreambooth_lora_sdxl_advanced.py \\
      --pretrained_model_name_or_path=stabilityai/stable-diffusion-xl-base-1.0 \\
      --instance_data_dir=dog --instance_prompt="a photo of TOK dog" --output_dir=out --resolution=1024 \\
      --train_text_encoder_ti --token_abstraction=TOK --num_new_tokens_per_abstraction=2 \\
      --train_text_encoder_ti_frac=0.5 --validation_prompt "a photo of TOK dog in a bucket"

With ``--train_text_encoder_ti`` each ``--token_abstraction`` of the prompts stands for new tokens (``<s0><s1>``)
whose embeddings train in both text encoders (every other row stays bitwise as it loaded) for the first
``--train_text_encoder_ti_frac`` of the optimizer steps, then stay as they are while the LoRA goes on. Writes
``pytorch_lora_weights.safetensors`` (UNet and, with ``--train_text_encoder``, both text encoders' adapters), which
``pipe.load_lora_weights(output_dir)`` loads, and ``<output folder name>_emb.safetensors`` (``clip_l``, ``clip_g``),
which ``pipe.load_textual_inversion`` loads into each text encoder and the UIs load as an embedding; with
``--use_ema`` both again under ``ema/``; validation images with ``validation/log.jsonl``, checkpoints to resume from,
and a model card. Missing class images are generated into ``--class_data_dir`` by the pipeline that trains, before
training starts. While the text encoders train they run in every step; else they embed the prompts once, and
``--cache_latents`` encodes each instance and class image once (both flips), before training. Each image is
micro-conditioned on its own original size and crop, as SDXL was trained.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

from diffusers import StableDiffusionXLPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.adapters.config import adapter_config
from training_utils.adapters.export import adapter_export
from training_utils.adapters.injection import ATTENTION_PROJECTIONS, add_adapter
from training_utils.args import (add_cache_args, add_diffusion_loss_args, add_lora_args, check_args, export_formats,
                                 fill_dependent_defaults, training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import make_dataloader
from training_utils.data.dreambooth import (add_dreambooth_args, check_dreambooth_args, class_images_from_args,
                                            dreambooth_dataset, dreambooth_prompts, instance_images_from_args,
                                            instance_then_class_collate, training_captions)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform
from training_utils.data.prompts import cached_rows, encoded_rows
from training_utils.diffusion import diffusion_loss, prediction_target, sample_noise, sample_timesteps
from training_utils.ema import make_ema
from training_utils.embeddings import load_tokenizers
from training_utils.families import sdxl
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import save_with_ema
from training_utils.outputs.hub import finish_run, how_to_load
from training_utils.outputs.run_status import run_script
from training_utils.parser import add_refused_args
from training_utils.pivotal import (PivotalExport, PivotalTokens, TrainingStops, abstraction_tokens, add_pivotal_args,
                                    check_new_tokens, check_pivotal_args, embedding_file, stop_step)
from training_utils.pipeline import (load_pipeline, prepare_components, trainable_parameters, training_noise_scheduler,
                                     weight_dtype_for)
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.quantization import quantization_config
from training_utils.validation import make_validator

# The flags of upstream's script that this one does not carry, besides those no script here carries.
REFUSED = {
    "--do_edm_style_training": "EDM-style training (Playground v2.5's) is not carried; the UNet trains on its "
                               "scheduler's own objective (--prediction_type)",
    "--clip_skip": "the prompts are encoded as the pipeline's encode_prompt does by default, in training and "
                   "validation alike",
    "--lora_unet_blocks": "the LoRA goes on every attention projection of the UNet (--lora_layers is not carried "
                          "here either)",
    "--use_blora": "B-LoRA (content and style blocks only) is not carried; the LoRA covers the whole UNet",
}


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], resolution=1024, interpolation="lanczos")
    sdxl.add_args(parser)
    add_lora_args(parser, StableDiffusionXLPipeline, train_text_encoder=True)
    parser.set_defaults(text_encoder_lr=5e-6, adam_weight_decay_text_encoder=1e-3)  # upstream's
    add_diffusion_loss_args(parser)
    add_dreambooth_args(parser)
    add_pivotal_args(parser)
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    check_dreambooth_args(args)
    check_pivotal_args(args)
    sdxl.check_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    instance_images = instance_images_from_args(args)
    tokenizers = load_tokenizers(args, ("tokenizer", "tokenizer_2"))
    abstractions = abstraction_tokens(args, tokenizers["tokenizer"]) if args.train_text_encoder_ti else {}
    check_new_tokens(tokenizers, abstractions, args.initializer_concept)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once. Its modules train, render validation images and generate the class images. Prompts are
    #    encoded as its own encode_prompt does, with the same settings everywhere: training, validation, class images.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    vae_replacement = sdxl.vae_components(args.pretrained_vae_model_name_or_path, weight_dtype)
    quantization = quantization_config(args, weight_dtype, base=["unet"],
                                       text_encoders=["text_encoder", "text_encoder_2"])
    pipe = load_pipeline(StableDiffusionXLPipeline, args, weight_dtype, quantization=quantization, **vae_replacement,
                         **tokenizers)
    unet, text_encoders = pipe.unet, [pipe.text_encoder, pipe.text_encoder_2]
    noise_scheduler = training_noise_scheduler(pipe, prediction_type=args.prediction_type)
    settings = sdxl.prompt_settings(pipe, args)
    call_kwargs = sdxl.call_kwargs(pipe, settings)

    # 3. The new tokens (--train_text_encoder_ti) in both text encoders, their rows in fp32; adapters (--adapter) on
    #    the UNet's (and maybe both text encoders') attention, in the layers the loss reads. The EMA tracks them all;
    #    the new rows and the text encoders' adapters stop training at their fractions of the run.
    tokens = PivotalTokens(pipe, {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}, abstractions,
                           args.initializer_concept, args.seed or 0) if abstractions else None
    add_adapter(unet, adapter_config(args, ATTENTION_PROJECTIONS))
    trained = {"unet": unet}
    if args.train_text_encoder:
        for name in ("text_encoder", "text_encoder_2"):
            add_adapter(getattr(pipe, name), adapter_config(args, sdxl.text_encoder_adapter_layers(pipe, name)))
    if args.train_text_encoder or tokens is not None:
        trained.update(text_encoder=pipe.text_encoder, text_encoder_2=pipe.text_encoder_2)
    # Unless they train, the text encoders run once, to cache the prompts' embeddings, and stay off the accelerator;
    # if they do, they run in every step, on the accelerator.
    text_encoders_train = len(trained) > 1
    if text_encoders_train:
        text_encoders = []
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, *text_encoders])
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        for name, module in trained.items():
            if name != "unet":
                module.gradient_checkpointing_enable()
    compile_repeated_blocks(unet, args.torch_compile)
    export = adapter_export(type(pipe), {name: module for name, module in trained.items()
                                         if name == "unet" or args.train_text_encoder}, export_formats(args))
    if tokens is not None:  # the adapters' export is made while only the adapters train
        for embedding in tokens.embeddings.values():
            embedding.new_rows.requires_grad_(True)
        export = PivotalExport(export, tokens.parameter_names(trained), tokens.tokens,
                               embedding_file(args.output_dir), trained)
    parameters = trainable_parameters(trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: class images first (only the missing ones are generated; the fresh adapters change nothing yet).
    #    The frozen encoders run once, here, not in every step (frozen text encoders on the prompts; with
    #    --cache_latents, the VAE on each image), then leave the accelerator until validation. Optimizer,
    #    schedule, accelerate; the loop resumes if asked.
    transform = ImageTransform.from_args(args, pipe)
    frozen = FrozenEncoders(sdxl.image_vae(pipe), text_encoders, transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)
    class_images = class_images_from_args(args, pipe, accelerator, [noise_scheduler], weight_dtype, frozen.on_device,
                                          call_kwargs=call_kwargs)

    def encode_prompts(prompts):
        return sdxl.encode_prompts(pipe, prompts, accelerator.device, settings)

    if not text_encoders_train:
        embeddings = frozen.text_embeddings(dreambooth_prompts(args, instance_images), encode_prompts,
                                            sdxl.prompt_dependencies(pipe, settings))
    dataset = dreambooth_dataset(instance_images, class_images, frozen, args.seed, args.repeats, args.caption_dropout,
                                 args.class_prompt)
    dataloader = accelerator.prepare(make_dataloader(dataset, args.train_batch_size, args.dataloader_num_workers,
                                                     instance_then_class_collate, args.seed))

    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    # The new rows stop training after --train_text_encoder_ti_frac of the steps, the text encoders' adapters after
    # --train_text_encoder_frac (upstream's pivot): from then on the optimizer leaves them bitwise as they are.
    stops = {}
    if tokens is not None:
        stops[stop_step(args.train_text_encoder_ti_frac, max_train_steps)] = [
            parameters[name] for name in export.parameters.values()]
    if args.train_text_encoder:
        stops.setdefault(stop_step(args.train_text_encoder_frac, max_train_steps), []).extend(
            parameter for name, parameter in parameters.items() if name.startswith("text_encoder")
            and name not in getattr(export, "parameters", {}).values())
    stops = TrainingStops(optimizer, stops)
    if tokens is not None:  # while they train, the new rows are kept near the vocabulary's scale, as upstream's are
        tokens.keep_scale(optimizer, stops)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    if text_encoders_train:  # the step encodes its prompts through the wrapped encoders, so gradients sync
        def replaced(prompts):
            return [tokens.replaced(prompt) for prompt in prompts] if tokens is not None else list(prompts)

        prompt_rows = encoded_rows(lambda prompts: sdxl.encode_prompts(pipe, replaced(prompts), accelerator.device,
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

    # 5. The loop: DreamBooth's denoising loss on the family's latents and conditioning (`sdxl`), each image on its
    # prompt's embedding and its own micro-conditioning (original size, crop, bucket); with prior preservation the
    # loss adds the class half's, weighted. After each optimizer step the loop updates the EMA, checkpoints and
    # validates when due (the final step included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        stops.at(loop.global_step)
        with accelerator.accumulate(*models.values()):
            latents = sdxl.normalized_latents(pipe, frozen.latents(batch["images"]))
            noise = sample_noise(latents, args.noise_offset)
            timesteps = sample_timesteps(noise_scheduler, latents.shape[0], latents.device)
            text = sdxl.text_inputs(prompt_rows(batch["prompts"]))
            text["added_cond_kwargs"]["time_ids"] = sdxl.batch_time_ids(batch["layouts"])
            inputs = sdxl.model_inputs(pipe, noise_scheduler.add_noise(latents, noise, timesteps), timesteps, text)
            output = models["unet"](**inputs, return_dict=False)[0]
            prediction = sdxl.prediction(pipe, output, latents)
            target = prediction_target(noise_scheduler, latents, noise, timesteps)
            # The instance half's loss, plus the weighted class half's (prior preservation).
            halves = 2 if args.with_prior_preservation else 1
            predictions, targets, steps = (x.chunk(halves) for x in (prediction, target, timesteps))
            loss = diffusion_loss(predictions[0], targets[0], noise_scheduler, steps[0], args.snr_gamma)
            if args.with_prior_preservation:
                prior_loss = diffusion_loss(predictions[1], targets[1], noise_scheduler, steps[1], args.snr_gamma)
                loss = loss + args.prior_loss_weight * prior_loss
            loop.backward_and_step(loss)

    # 6. Save raw and EMA adapters (and the new tokens' embeddings) from memory, check the files against it, and write
    #    the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        prompt = (args.validation_prompt or [args.instance_prompt])[0]
        if tokens is not None:
            how_to_load_text = export.loading_code(args, pipe, tokens.replaced(prompt))
        else:
            how_to_load_text = how_to_load(export.loading_code, args, pipe, prompt=prompt,
                                           **sdxl.vae_how_to_load(args.pretrained_vae_model_name_or_path, pipe))
        finish_run(args, f"DreamBooth {export.title} (SDXL)", how_to_load_text, loop.records, saved,
                   export.title, captions=training_captions(instance_images))
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
