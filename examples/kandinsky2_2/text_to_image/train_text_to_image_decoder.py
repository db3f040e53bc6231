#!/usr/bin/env python
# Copied from examples/text_to_image/train_text_to_image.py; tests/test_drift.py keeps what they share alike.
"""Fine-tune every parameter of the Kandinsky 2.2 decoder UNet on images, conditioned on their CLIP image embeddings.

    accelerate launch train_text_to_image_decoder.py \\
      --pretrained_decoder_model_name_or_path=kandinsky-community/kandinsky-2-2-decoder \\
      --pretrained_prior_model_name_or_path=kandinsky-community/kandinsky-2-2-prior \\
      --dataset_name=lambdalabs/naruto-blip-captions --resolution=768 --output_dir=out --use_ema \\
      --validation_prompts "A robot naruto, 4k photo" --validation_steps=100

The decoder learns to render an image from its CLIP image embedding (the prior pipeline's image encoder on the
training image), so no caption is read. Writes a ``KandinskyV22Pipeline`` folder holding the trained UNet to
``output_dir`` (the MoVQ and scheduler hard-linked from the base) and, with ``--use_ema``, the EMA UNet to
``output_dir/ema/unet``; validation images of ``--validation_prompts`` rendered through
``KandinskyV22CombinedPipeline`` (the frozen prior turns each prompt into an image embedding), checkpoints to resume
from, and a model card. The MoVQ runs once per image before training with ``--cache_latents``; the image encoder runs
in each step, on the accelerator.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

from diffusers import KandinskyV22Pipeline

from training_utils import kandinsky
from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import (add_cache_args, add_diffusion_loss_args, check_args, check_pretrained_path,
                                 fill_dependent_defaults, training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import TrainDataset, load_train_dataset, make_dataloader, stack_collate
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform, read_image
from training_utils.diffusion import diffusion_loss, prediction_target, sample_noise, sample_timesteps
from training_utils.ema import make_ema
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

# The flags of upstream's script that this one does not carry, besides those no script here carries.
REFUSED = {}


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], resolution=768, interpolation="bicubic",
                             tracker_project_name="text2image-fine-tune",
                             pretrained_model_aliases=["--pretrained_decoder_model_name_or_path"])
    parser.add_argument("--pretrained_prior_model_name_or_path", required=True,
                        help="the Kandinsky 2.2 prior pipeline whose image encoder and processor embed the training "
                             "images (and which renders the validation prompts)")
    add_diffusion_loss_args(parser)
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    check_pretrained_path(args.pretrained_prior_model_name_or_path, "--pretrained_prior_model_name_or_path")
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, {"--image_column": args.image_column})
    accelerator = make_accelerator(args, run)

    # 2. The decoder pipeline, once, and the frozen prior pipeline beside it: the prior's image encoder embeds the
    #    training images, and the two render the validation prompts as one combined pipeline of these same modules.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    pipe = load_pipeline(KandinskyV22Pipeline, args, weight_dtype, trained_in_fp32=["unet"])
    prior = kandinsky.load_prior(args, weight_dtype)
    unet = pipe.unet
    noise_scheduler = training_noise_scheduler(pipe, prediction_type=args.prediction_type)

    # 3. The whole UNet trains, in fp32; the EMA is made from its live tensors (no second copy from disk).
    trained = {"unet": unet}
    unet.requires_grad_(True)
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.movq])
    prior.to(accelerator.device)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    compile_repeated_blocks(unet, args.torch_compile)
    parameters = trainable_parameters(trained)
    export = PipelineExport(pipe, trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: with --cache_latents the MoVQ runs once per image, here, then leaves the accelerator until validation;
    #    each example also carries its CLIP pixels (the prior's processor on the whole image). Optimizer, schedule,
    #    accelerate; the loop resumes if asked.
    transform = ImageTransform.from_args(args, pipe)
    frozen = FrozenEncoders(kandinsky.MoVQLatents(pipe.movq), [], transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)
    shapes = None
    examples = frozen.cache_dataset_images(dataset, args.image_column, shapes)

    def preprocess(example, generator):
        image = frozen.dataset_image(example, generator).pixels
        return {"image": image, "clip_pixels": kandinsky.clip_pixels(prior, read_image(example[args.image_column]))}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(examples, preprocess, args.seed, args.repeats, shapes), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)

    validator = make_validator(args, kandinsky.combined_pipeline(pipe, prior), accelerator, ema=ema, posthoc=posthoc,
                               schedulers=[noise_scheduler], weight_dtype=weight_dtype,
                               encoders_on_device=frozen.on_device,
                               call_kwargs={**validation_size(args, shapes),
                                            "prior_num_inference_steps": args.validation_inference_steps})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: the denoising loss on the MoVQ latents, conditioned on the images' CLIP embeddings (`kandinsky`);
    # after each optimizer step the loop updates the EMA, checkpoints and validates when due (the final step
    # included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            latents = frozen.latents(batch["image"])
            noise = sample_noise(latents, args.noise_offset)
            timesteps = sample_timesteps(noise_scheduler, latents.shape[0], latents.device)
            image_embeds = kandinsky.image_embeddings(prior, batch["clip_pixels"])
            inputs = kandinsky.model_inputs(noise_scheduler.add_noise(latents, noise, timesteps), timesteps,
                                            image_embeds)
            output = models["unet"](**inputs, return_dict=False)[0]
            target = prediction_target(noise_scheduler, latents, noise, timesteps)
            loss = diffusion_loss(kandinsky.prediction(output, latents), target, noise_scheduler, timesteps,
                                  args.snr_gamma)
            loop.backward_and_step(loss)

    # 6. Save the decoder pipeline with the raw UNet and the EMA UNet from memory, check the files, write the model
    #    card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        finish_run(args, "Kandinsky 2.2 decoder fine-tune", fine_tuned_unet_how_to_load(args, pipe, ema),
                   loop.records, saved, "UNet")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
