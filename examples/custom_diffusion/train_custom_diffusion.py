#!/usr/bin/env python
# Copied from examples/dreambooth/train_dreambooth_lora.py; tests/test_drift.py keeps what they share alike.
"""Teach Stable Diffusion 1.x a subject (Custom Diffusion): its cross-attention K/V and a new modifier token train.

    accelerate launch train_custom_diffusion.py \\
      --pretrained_model_name_or_path=CompVis/stable-diffusion-v1-4 \\
      --instance_data_dir=cat --instance_prompt="photo of a <new1> cat" --modifier_token "<new1>" \\
      --with_prior_preservation --class_data_dir=cats --class_prompt="cat" --output_dir=out \\
      --use_ema --validation_prompt "<new1> cat sitting in a bucket"

Writes ``pytorch_custom_diffusion_weights.safetensors``, the cross-attention projections that trained (the key and
value ones; with ``--freeze_model crossattn`` also the query and output ones) as diffusers'
``CustomDiffusionAttnProcessor`` weights, which ``pipe.unet.load_attn_procs(output_dir, weight_name=...,
_pipeline=pipe)`` loads, and ``<new1>.safetensors``, the modifier token's embedding, which
``pipe.load_textual_inversion(output_dir, weight_name="<new1>.safetensors")`` loads (with ``--use_ema`` the EMA's of
both under ``ema/``); validation images with ``validation/log.jsonl``, checkpoints to resume from, and a model card.
Every other weight stays bitwise as it loaded: the token's rows are a parameter of their own
(`training_utils.embeddings`). Missing class images are generated into ``--class_data_dir`` by the pipeline that
trains, before training starts. Without a modifier token the frozen text encoder embeds the prompts once; with one,
it runs in every step (the gradient reaches the token's rows through it). Images are resized and cropped as in every
DreamBooth script here: upstream's random rescaling with a masked loss is not applied (as with its ``--noaug``). As
upstream's, ``--scale_lr`` with prior preservation doubles the learning rate once more.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

from diffusers import StableDiffusionPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import (add_cache_args, add_diffusion_loss_args, check_args, fill_dependent_defaults,
                                 training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.custom_diffusion import PROJECTIONS, CustomDiffusionExport, train_cross_attention
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
from training_utils.embeddings import TextualInversion, check_placeholder_token, load_tokenizers
from training_utils.errors import require
from training_utils.families import sd
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import save_with_ema
from training_utils.outputs.hub import finish_run
from training_utils.outputs.run_status import run_script
from training_utils.parser import add_refused_args
from training_utils.pipeline import (load_pipeline, prepare_components, trainable_parameters, training_noise_scheduler,
                                     weight_dtype_for)
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.validation import make_validator

# The flags of upstream's script that this one does not carry, besides those no script here carries.
REFUSED = {
    "--real_prior": "it retrieves real class images from LAION over the network (upstream's retrieve.py); pass them "
                    "as --class_data_dir instead",
    "--concepts_list": "one concept per run here (--instance_data_dir, --instance_prompt, --modifier_token)",
    "--no_safe_serialization": "every file is written as safetensors; nothing here writes pickles",
}


def add_custom_diffusion_args(parser):
    group = parser.add_argument_group("Custom Diffusion")
    group.add_argument("--freeze_model", default="crossattn_kv", choices=sorted(PROJECTIONS),
                       help="which cross-attention projections train: crossattn_kv the key and value ones, crossattn "
                            "also the query and output ones")
    group.add_argument("--modifier_token", default=None,
                       help="the new token that names the subject, e.g. <new1> (none: only the projections train)")
    group.add_argument("--initializer_token", default="ktn+pll",
                       help="an existing word (one token) whose embedding the modifier token starts from "
                            "(upstream's '+'-joined list: the first)")
    group.add_argument("--hflip", dest="random_flip", action="store_true", help="flip images horizontally at random "
                       "(as --random_flip)")
    group.add_argument("--noaug", action="store_true",
                       help="accepted for upstream's commands: images are never randomly rescaled here")
    group.add_argument("--set_grads_to_none", action="store_true",
                       help="accepted for upstream's commands: the gradients are always freed (set to None) "
                            "between steps")


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], interpolation="bilinear",
                             tracker_project_name="custom-diffusion")
    add_custom_diffusion_args(parser)
    add_diffusion_loss_args(parser)
    add_dreambooth_args(parser)
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    parser.set_defaults(output_dir="custom-diffusion-model", learning_rate=1e-5)  # upstream's
    args = parser.parse_args(argv)
    check_args(args)
    check_dreambooth_args(args)
    require(args.modifier_token is None or "+" not in args.modifier_token, "--modifier_token", args.modifier_token,
            "one token (several, '+'-joined, are not supported here)")
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    instance_images = instance_images_from_args(args)
    tokenizers = load_tokenizers(args, ("tokenizer",))
    initializer_token = args.initializer_token.split("+")[0]
    if args.modifier_token is not None:
        check_placeholder_token(tokenizers, args.modifier_token, 1, initializer_token, token_flag="--modifier_token")
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once. Its modules train, render validation images and generate the class images. Prompts are
    #    encoded as its own encode_prompt does, with the same settings everywhere: training, validation, class images.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    pipe = load_pipeline(StableDiffusionPipeline, args, weight_dtype, **tokenizers)
    unet, text_encoders = pipe.unet, [pipe.text_encoder]
    noise_scheduler = training_noise_scheduler(pipe, prediction_type=args.prediction_type)
    settings = sd.prompt_settings(pipe, args)
    call_kwargs = sd.call_kwargs(pipe, settings)

    # 3. The UNet's cross-attention projections (--freeze_model) train in fp32, and the modifier token's rows of the
    #    text encoder's input embedding; nothing else does. The EMA tracks them all.
    train_cross_attention(unet, args.freeze_model)
    trained = {"unet": unet}
    if args.modifier_token is not None:
        inversion = TextualInversion(pipe, {"text_encoder": "tokenizer"}, args.modifier_token, 1, initializer_token)
        trained.update(inversion.text_encoders)
        # The text encoder runs in every step, on the accelerator: the gradient reaches the token through it.
        text_encoders = []
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, *text_encoders])
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        if args.modifier_token is not None:
            pipe.text_encoder.gradient_checkpointing_enable()
    compile_repeated_blocks(unet, args.torch_compile)
    parameters = trainable_parameters(trained)
    embedding = inversion.export(trained).parameters["text_encoder"] if args.modifier_token is not None else None
    export = CustomDiffusionExport.of(trained, args.modifier_token, embedding)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: class images first (only the missing ones are generated; nothing has trained yet). The VAE runs once
    #    per image with --cache_latents; without a modifier token the frozen text encoder embeds the prompts once,
    #    here, then leaves the accelerator until validation. Optimizer, schedule, accelerate; the loop resumes if asked.
    transform = ImageTransform.from_args(args, pipe)
    frozen = FrozenEncoders(sd.image_vae(pipe), text_encoders, transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)
    class_images = class_images_from_args(args, pipe, accelerator, [noise_scheduler], weight_dtype, frozen.on_device,
                                          call_kwargs=call_kwargs)

    def encode_prompts(prompts):
        return sd.encode_prompts(pipe, prompts, accelerator.device, settings)

    if args.modifier_token is None:
        embeddings = frozen.text_embeddings(dreambooth_prompts(args, instance_images), encode_prompts,
                                            sd.prompt_dependencies(pipe, settings))
    dataset = dreambooth_dataset(instance_images, class_images, frozen, args.seed, args.repeats, args.caption_dropout,
                                 args.class_prompt)
    dataloader = accelerator.prepare(make_dataloader(dataset, args.train_batch_size, args.dataloader_num_workers,
                                                     instance_then_class_collate, args.seed))

    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    if args.scale_lr and args.with_prior_preservation:  # upstream's: each batch holds as many class images again
        for group in optimizer.param_groups:
            group["lr"] *= 2
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    if args.modifier_token is not None:  # through the wrapped encoder, so gradients sync; the token spelled out
        prompt_rows = encoded_rows(lambda prompts: sd.encode_prompts(pipe, inversion.spelled_out(prompts),
                                                                     accelerator.device, settings,
                                                                     text_encoders=models))
    else:
        prompt_rows = cached_rows(embeddings, accelerator.device)

    validator = make_validator(args, pipe, accelerator, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
                               weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
                               call_kwargs={**validation_size(args, dataset.shapes), **call_kwargs})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: DreamBooth's denoising loss on the family's latents and conditioning (`sd`), each image on its
    # prompt's embedding; with prior preservation the loss adds the class half's, weighted. After each optimizer step
    # the loop updates the EMA, checkpoints and validates when due (the final step included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            latents = sd.normalized_latents(pipe, frozen.latents(batch["images"]))
            noise = sample_noise(latents, args.noise_offset)
            timesteps = sample_timesteps(noise_scheduler, latents.shape[0], latents.device)
            text = sd.text_inputs(prompt_rows(batch["prompts"]))
            inputs = sd.model_inputs(pipe, noise_scheduler.add_noise(latents, noise, timesteps), timesteps, text)
            output = models["unet"](**inputs, return_dict=False)[0]
            prediction = sd.prediction(pipe, output, latents)
            target = prediction_target(noise_scheduler, latents, noise, timesteps)
            # The instance half's loss, plus the weighted class half's (prior preservation).
            halves = 2 if args.with_prior_preservation else 1
            predictions, targets, steps = (x.chunk(halves) for x in (prediction, target, timesteps))
            loss = diffusion_loss(predictions[0], targets[0], noise_scheduler, steps[0], args.snr_gamma)
            if args.with_prior_preservation:
                prior_loss = diffusion_loss(predictions[1], targets[1], noise_scheduler, steps[1], args.snr_gamma)
                loss = loss + args.prior_loss_weight * prior_loss
            loop.backward_and_step(loss)

    # 6. Save the raw and EMA weights and token from memory, check the files against it, and write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        finish_run(args, "Custom Diffusion", export.loading_code(args, pipe), loop.records, saved, export.title,
                   captions=training_captions(instance_images))
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
