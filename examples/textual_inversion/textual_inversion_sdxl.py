#!/usr/bin/env python
# Copied from examples/textual_inversion/textual_inversion.py; tests/test_drift.py keeps what they share alike.
"""Teach SDXL a new word from a few images (textual inversion): only the new token's embeddings, in both text encoders,
train.

    accelerate launch textual_inversion.py \\
      --pretrained_model_name_or_path=stabilityai/stable-diffusion-xl-base-1.0 \\
      --train_data_dir=cat_toy --placeholder_token="<cat-toy>" --initializer_token=toy --num_vectors=2 \\
      --output_dir=out --use_ema --validation_prompt "a <cat-toy> on a beach" --validation_steps=100

Writes ``learned_embeds.safetensors`` and ``learned_embeds_2.safetensors`` (the vectors of CLIP-L and CLIP-G), which
``pipe.load_textual_inversion`` loads into each text encoder, and both as ``<token>.safetensors`` (``clip_l`` and
``clip_g``) for AUTOMATIC1111's web UI and ComfyUI (with ``--use_ema`` the EMA's under ``ema/``); both every
``--save_steps`` (``learned_embeds-steps-N.safetensors``, ``learned_embeds_2-steps-N.safetensors``); with
``--save_as_full_pipeline`` the whole pipeline, its tokenizers and text encoders holding the token (the other
models' files hard links to the base's); validation images with ``validation/log.jsonl``, checkpoints to resume
from, and a model card. Every other row of the text encoders' embeddings stays bitwise as it loaded. The frozen text
encoders run in every step (the gradient reaches the new rows through them), the frozen VAE once per image with
``--cache_latents``.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

from diffusers import StableDiffusionXLPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import (add_cache_args, add_diffusion_loss_args, check_args, fill_dependent_defaults,
                                 training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import (TrainDataset, dataset_shapes, load_train_dataset, make_dataloader,
                                          stack_collate)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform
from training_utils.data.prompts import encoded_rows
from training_utils.diffusion import diffusion_loss, prediction_target, sample_noise, sample_timesteps
from training_utils.ema import make_ema
from training_utils.embeddings import (TextualInversion, add_textual_inversion_args, check_placeholder_token,
                                       check_textual_inversion_args, load_tokenizers, write_progress)
from training_utils.families import sdxl
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import save_with_ema
from training_utils.outputs.hub import finish_run
from training_utils.outputs.run_status import run_script
from training_utils.outputs.pipeline_folder import save_pipeline
from training_utils.parser import add_refused_args
from training_utils.pipeline import (load_pipeline, prepare_components, trainable_parameters, training_noise_scheduler,
                                     weight_dtype_for)
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.validation import make_validator

# The flags of upstream's script that this one does not carry, besides those no script here carries.
REFUSED = {
    "--no_safe_serialization": "every file is written as safetensors; nothing here writes pickles",
}


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], interpolation="bicubic",
                             tracker_project_name="textual_inversion")
    add_textual_inversion_args(parser)
    add_diffusion_loss_args(parser)
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    parser.set_defaults(output_dir="text-inversion-model", repeats=100, train_batch_size=16,  # upstream's
                        max_train_steps=5000, adam_weight_decay=1e-2)
    args = parser.parse_args(argv)
    check_args(args)
    check_textual_inversion_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, {"--image_column": args.image_column})
    tokenizers = load_tokenizers(args, ("tokenizer", "tokenizer_2"))
    check_placeholder_token(tokenizers, args.placeholder_token, args.num_vectors, args.initializer_token)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once. Its modules are the ones we train and the ones validation renders with. Prompts are
    #    encoded as its own encode_prompt does, with the same settings everywhere: training and validation.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    pipe = load_pipeline(StableDiffusionXLPipeline, args, weight_dtype, **tokenizers)
    unet = pipe.unet
    noise_scheduler = training_noise_scheduler(pipe, prediction_type=args.prediction_type)
    settings = sdxl.prompt_settings(pipe, args)
    call_kwargs = sdxl.call_kwargs(pipe, settings)

    # 3. The new token's rows of both text encoders' input embeddings train, in fp32; nothing else does. The text
    #    encoders run in every step, on the accelerator; the EMA tracks the new rows.
    inversion = TextualInversion(pipe, {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"},
                                 args.placeholder_token, args.num_vectors, args.initializer_token)
    trained = dict(inversion.text_encoders)
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae])
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        for text_encoder in trained.values():
            text_encoder.gradient_checkpointing_enable()
    # The UNet is frozen, but it is most of the step's compute.
    compile_repeated_blocks(unet, args.torch_compile)
    parameters = trainable_parameters(trained)
    export = inversion.export(trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: each image with a prompt of --learnable_property's that names the token; with --cache_latents the
    #    VAE runs once per image, here. Optimizer, schedule, accelerate; the loop resumes if asked.
    transform = ImageTransform.from_args(args, pipe)
    frozen = FrozenEncoders(sdxl.image_vae(pipe), [], transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)
    shapes = dataset_shapes(transform, dataset, args.image_column)
    examples = frozen.cache_dataset_images(dataset, args.image_column, shapes)

    def preprocess(example, generator):
        laid_out = frozen.dataset_image(example, generator)
        # SDXL is told each image's original size, where it was cropped (after any flip) and the size it trains at.
        return {"image": laid_out.pixels, "prompt": inversion.templated_prompt(args.learnable_property, generator),
                "time_ids": sdxl.time_ids(laid_out.original_size, laid_out.crop_top_left, laid_out.size)}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(examples, preprocess, args.seed, args.repeats, shapes), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    # The step encodes its prompts through the wrapped encoders, so that gradients sync, the token's vectors spelled
    # out by the pipeline as validation's prompts are.
    prompt_rows = encoded_rows(lambda prompts: sdxl.encode_prompts(pipe, inversion.spelled_out(prompts),
                                                                 accelerator.device, settings, text_encoders=models))

    validator = make_validator(args, pipe, accelerator, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
                               weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
                               call_kwargs={**validation_size(args, shapes), **call_kwargs})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: the denoising loss on the family's latents and conditioning (`sdxl`), through the text encoders;
    # after each optimizer step the loop updates the EMA, checkpoints and validates when due (the final step
    # included, once), and every --save_steps the embedding is written as it is.
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            latents = sdxl.normalized_latents(pipe, frozen.latents(batch["image"]))
            noise = sample_noise(latents, args.noise_offset)
            timesteps = sample_timesteps(noise_scheduler, latents.shape[0], latents.device)
            text = sdxl.text_inputs(prompt_rows(batch["prompt"]))
            text["added_cond_kwargs"]["time_ids"] = batch["time_ids"]
            inputs = sdxl.model_inputs(pipe, noise_scheduler.add_noise(latents, noise, timesteps), timesteps, text)
            output = unet(**inputs, return_dict=False)[0]
            target = prediction_target(noise_scheduler, latents, noise, timesteps)
            loss = diffusion_loss(sdxl.prediction(pipe, output, latents), target, noise_scheduler, timesteps,
                                  args.snr_gamma)
            stepped = loop.backward_and_step(loss)
        if stepped and loop.global_step % args.save_steps == 0 and accelerator.is_main_process:
            write_progress(export, args.output_dir, loop.global_step)

    # 6. Save the raw and EMA embeddings from memory (and, if asked, the pipeline holding the token), check the files,
    # write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        if args.save_as_full_pipeline:
            with inversion.merged():
                save_pipeline(pipe, args.output_dir, trained=trained)
        finish_run(args, "Textual inversion", export.loading_code(args, pipe), loop.records, saved, "embedding")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
