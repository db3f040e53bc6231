#!/usr/bin/env python
# Copied from examples/dreambooth/train_dreambooth_lora.py; tests/test_drift.py keeps what they share alike.
"""Teach Stable Diffusion 1.x a subject from a few images (DreamBooth) by fine-tuning the whole UNet.

    accelerate launch train_dreambooth.py \\
      --pretrained_model_name_or_path=stable-diffusion-v1-5/stable-diffusion-v1-5 \\
      --instance_data_dir=dog --instance_prompt="a photo of sks dog" --output_dir=out \\
      --with_prior_preservation --class_data_dir=dogs --class_prompt="a photo of a dog" \\
      --train_text_encoder --use_ema --ema_device=cpu --validation_prompt "a photo of sks dog in a bucket"

Every parameter of the UNet trains (and, with ``--train_text_encoder``, of the text encoder), in fp32. Writes a
full pipeline holding what trained to ``output_dir`` (``StableDiffusionPipeline.from_pretrained`` loads it) and,
with ``--use_ema``, the EMA of what trained to ``output_dir/ema/unet`` (and ``ema/text_encoder``); validation
images with ``validation/log.jsonl``, checkpoints to resume from, and a model card. Missing class images are
generated into ``--class_data_dir`` by the pipeline that trains, before training starts. Unless it trains, the
text encoder embeds the prompts once, and ``--cache_latents`` encodes each instance and class image once (both
flips), before training; what is cached stays off the accelerator except while validating.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

from diffusers import StableDiffusionPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import (add_cache_args, add_diffusion_loss_args, check_args, fill_dependent_defaults,
                                 training_parser)
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
from training_utils.families import sd
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import PipelineExport, save_with_ema
from training_utils.outputs.hub import fine_tuned_unet_how_to_load, finish_run
from training_utils.outputs.run_status import run_script
from training_utils.parser import add_refused_args
from training_utils.pipeline import (load_pipeline, prepare_components, trainable_parameters, training_noise_scheduler,
                                     weight_dtype_for)
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.validation import make_validator

# The flags of upstream's script that this one does not carry, besides those no script here carries: DeepFloyd IF's,
# and the few its full fine-tune adds.
REFUSED = {
    **dict.fromkeys(["--tokenizer_max_length", "--text_encoder_use_attention_mask"],
                    "DeepFloyd IF's T5 prompt options; Stable Diffusion's prompts are tokenized as its pipeline's "
                    "encode_prompt does (CLIP, the tokenizer's length, no attention mask)"),
    "--validation_images": "images for DeepFloyd IF's super-resolution stage; this script validates from prompts",
    "--class_labels_conditioning": "DeepFloyd IF's stage-2 class labels; Stable Diffusion's UNet takes none",
    "--offset_noise": "use --noise_offset 0.1 (upstream's --offset_noise is that scale, fixed)",
    "--set_grads_to_none": "gradients are always set to None between steps (PyTorch's default)",
    "--skip_save_text_encoder": "the output folder is a whole pipeline, which needs its text encoder to load",
    "--validation_scheduler": "validation renders with the pipeline's own scheduler, as the saved pipeline does",
}


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], interpolation="lanczos", tracker_project_name="dreambooth")
    parser.add_argument("--train_text_encoder", action="store_true",
                        help="fine-tune every parameter of the text encoder too")
    add_diffusion_loss_args(parser)
    add_dreambooth_args(parser)
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    check_dreambooth_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    instance_images = instance_images_from_args(args)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once. Its modules train, render validation images and generate the class images. Prompts are
    #    encoded as its own encode_prompt does, with the same settings everywhere: training, validation, class images.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    trained_names = ["unet", "text_encoder"] if args.train_text_encoder else ["unet"]
    pipe = load_pipeline(StableDiffusionPipeline, args, weight_dtype, trained_in_fp32=trained_names)
    unet, text_encoders = pipe.unet, [pipe.text_encoder]
    noise_scheduler = training_noise_scheduler(pipe, prediction_type=args.prediction_type)
    settings = sd.prompt_settings(pipe, args)
    call_kwargs = sd.call_kwargs(pipe, settings)

    # 3. The whole UNet (and maybe the whole text encoder) trains, in fp32; the EMA is made from their live tensors.
    trained = {name: getattr(pipe, name) for name in trained_names}
    for module in trained.values():
        module.requires_grad_(True)
    # Unless it trains, the text encoder runs once, to cache the prompts' embeddings, and stays off the accelerator;
    # if it does, it runs in every step, on the accelerator.
    if args.train_text_encoder:
        text_encoders = []
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, *text_encoders])
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        for name, module in trained.items():
            if name != "unet":
                module.gradient_checkpointing_enable()
    compile_repeated_blocks(unet, args.torch_compile)
    parameters = trainable_parameters(trained)
    export = PipelineExport(pipe, trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: class images first (only the missing ones are generated, by the base model: nothing has trained yet).
    #    The frozen encoders run once, here, not in every step (a frozen text encoder on the prompts; with
    #    --cache_latents, the VAE on each image), then leave the accelerator until validation. Optimizer,
    #    schedule, accelerate; the loop resumes if asked.
    transform = ImageTransform.from_args(args, pipe)
    frozen = FrozenEncoders(sd.image_vae(pipe), text_encoders, transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)
    class_images = class_images_from_args(args, pipe, accelerator, [noise_scheduler], weight_dtype, frozen.on_device,
                                          call_kwargs=call_kwargs)

    def encode_prompts(prompts):
        return sd.encode_prompts(pipe, prompts, accelerator.device, settings)

    if not args.train_text_encoder:
        embeddings = frozen.text_embeddings(dreambooth_prompts(args, instance_images), encode_prompts,
                                            sd.prompt_dependencies(pipe, settings))
    dataset = dreambooth_dataset(instance_images, class_images, frozen, args.seed, args.repeats, args.caption_dropout,
                                 args.class_prompt)
    dataloader = accelerator.prepare(make_dataloader(dataset, args.train_batch_size, args.dataloader_num_workers,
                                                     instance_then_class_collate, args.seed))

    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    if args.train_text_encoder:  # the step encodes its prompts through the wrapped encoder, so gradients sync
        prompt_rows = encoded_rows(lambda prompts: sd.encode_prompts(pipe, prompts, accelerator.device, settings,
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

    # 6. Save the pipeline with what trained and the EMA's models from memory, check the files, write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        how_to_load_text = fine_tuned_unet_how_to_load(args, pipe, ema,
                                                       prompt=(args.validation_prompt or [args.instance_prompt])[0])
        finish_run(args, "DreamBooth fine-tune", how_to_load_text, loop.records, saved,
                   "UNet and text encoder" if args.train_text_encoder else "UNet",
                   captions=training_captions(instance_images))
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
