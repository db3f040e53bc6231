#!/usr/bin/env python
# Copied from examples/text_to_image/train_text_to_image.py; tests/test_drift.py keeps what they share alike.
"""Fine-tune every parameter of the Kandinsky 2.2 prior (text to CLIP image embedding), with an optional EMA.

    accelerate launch train_text_to_image_prior.py \\
      --pretrained_prior_model_name_or_path=kandinsky-community/kandinsky-2-2-prior \\
      --pretrained_decoder_model_name_or_path=kandinsky-community/kandinsky-2-2-decoder \\
      --train_data_dir=my_images --output_dir=out --use_ema \\
      --validation_prompt "a red circle" --validation_steps=100

The prior learns to predict the CLIP image embedding of each training image (from the pipeline's image encoder,
normalised with the prior's ``clip_mean`` and ``clip_std``) from its caption's CLIP text embedding. Writes a prior
pipeline holding the trained prior to ``output_dir`` (``KandinskyV22PriorPipeline.from_pretrained`` loads it;
the untouched encoders are linked, not copied) and, with ``--use_ema``, the EMA prior to ``output_dir/ema/prior``;
validation images rendered through the prior and the decoder (``--pretrained_decoder_model_name_or_path``, frozen)
with ``validation/log.jsonl``, checkpoints to resume from, and a model card. The image encoder's processor resizes
and centre-crops every image (``--resolution`` is the validation size); ``--random_flip`` flips before it. The frozen
text encoder runs once per distinct caption before training, the image encoder in every step.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import torch
from diffusers import KandinskyV22Pipeline, KandinskyV22PriorPipeline
from PIL import ImageOps

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import check_args, check_pretrained_path, fill_dependent_defaults, training_parser
from training_utils.compile import compile_repeated_blocks
from training_utils.data.datasets import (TrainDataset, captions_with_empty, drop_caption, load_train_dataset,
                                          make_dataloader, pick_caption, stack_collate)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import read_image
from training_utils.data.prompts import cached_rows
from training_utils.diffusion import diffusion_loss, prediction_target, sample_timesteps
from training_utils.ema import make_ema
from training_utils.kandinsky import clip_pixels, combined_pipeline, image_embeddings
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import PipelineExport, save_with_ema
from training_utils.outputs.hub import fine_tuned_how_to_load, finish_run
from training_utils.outputs.run_status import run_script
from training_utils.parser import add_refused_args
from training_utils.pipeline import (from_pretrained, load_pipeline, prepare_components, trainable_parameters,
                                     training_noise_scheduler, weight_dtype_for)
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.validation import make_validator

# Flags every script here has that this one cannot honour.
REFUSED = {"--gradient_checkpointing": "diffusers' PriorTransformer has no gradient checkpointing"}

# The model card's loading code: the prior pipeline renders image embeddings, which the decoder turns into images.
HOW_TO_LOAD = """
from diffusers import {pipeline_class}, {model_class}, KandinskyV22Pipeline

pipe = {pipeline_class}.from_pretrained("{output_dir}")
{swap_in_ema}decoder = KandinskyV22Pipeline.from_pretrained("{decoder}")
image_embeds, negative_image_embeds = pipe("{prompt}").to_tuple()
image = decoder(image_embeds=image_embeds, negative_image_embeds=negative_image_embeds).images[0]
"""


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], resolution=768, validation_inference_steps=25,
                             tracker_project_name="text2image-fine-tune",
                             pretrained_model_aliases=["--pretrained_prior_model_name_or_path"])
    parser.add_argument("--pretrained_decoder_model_name_or_path", required=True,
                        help="the decoder pipeline that renders validation images from the prior's embeddings")
    parser.add_argument("--snr_gamma", type=float, default=None, help="min-SNR loss weighting gamma (5.0 is usual)")
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    check_pretrained_path(args.pretrained_decoder_model_name_or_path, "--pretrained_decoder_model_name_or_path")
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_train_dataset(args, {"--image_column": args.image_column, "--caption_column": args.caption_column})
    accelerator = make_accelerator(args, run)

    # 2. The prior pipeline, once, and the decoder that validation renders its embeddings with; together they are
    #    the combined pipeline, built on the same live modules. Prompts are encoded as the prior pipeline does.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    pipe = load_pipeline(KandinskyV22PriorPipeline, args, weight_dtype, trained_in_fp32=["prior"])
    decoder = from_pretrained(KandinskyV22Pipeline, args.pretrained_decoder_model_name_or_path, dtype=weight_dtype)
    render = combined_pipeline(decoder, pipe)
    prior = pipe.prior
    # The prior predicts the clean (normalised) image embedding, as its UnCLIP scheduler says ("sample").
    noise_scheduler = training_noise_scheduler(pipe)

    # 3. The whole prior trains, in fp32, but for the CLIP statistics it normalises with (frozen, kept in fp32); the
    #    EMA is made from its live tensors (no second copy from disk).
    trained = {"prior": prior}
    prior.requires_grad_(True)
    prior.clip_mean.requires_grad_(False)
    prior.clip_std.requires_grad_(False)
    clip_stats = prior.clip_mean.data, prior.clip_std.data  # as loaded, in fp32: not through the half cast
    prepare_components(render, trained, accelerator.device, weight_dtype)
    prior.clip_mean.data, prior.clip_std.data = (stat.to(accelerator.device) for stat in clip_stats)
    compile_repeated_blocks(prior, args.torch_compile)
    parameters = trainable_parameters(trained)
    export = PipelineExport(pipe, trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: the frozen text encoder runs once, here, on each distinct caption (as the prior pipeline encodes a
    #    prompt), then leaves the accelerator until validation; each image as the image encoder's processor makes it,
    #    with its caption. Optimizer, schedule, accelerate; the loop resumes if asked.
    frozen = FrozenEncoders(None, [pipe.text_encoder], None, accelerator.device, weight_dtype, seed=args.seed)

    def encode_prompts(prompts):
        return pipe._encode_prompt(prompts, accelerator.device, 1, False)

    embeddings = frozen.text_embeddings(captions_with_empty(dataset[args.caption_column], args.caption_dropout),
                                        encode_prompts, [pipe.tokenizer])

    def preprocess(example, generator):
        image = read_image(example[args.image_column])
        if args.random_flip and torch.rand((), generator=generator) < 0.5:
            image = ImageOps.mirror(image)
        pixels = clip_pixels(pipe, image)
        prompt = drop_caption(pick_caption(example[args.caption_column], generator), args.caption_dropout, generator)
        return {"pixels": pixels, "prompt": prompt}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(dataset, preprocess, args.seed, args.repeats), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    prompt_rows = cached_rows(embeddings, accelerator.device)

    size = {"height": args.validation_height or args.resolution, "width": args.validation_width or args.resolution}
    validator = make_validator(args, render, accelerator, ema=ema, posthoc=posthoc,
                               schedulers=[noise_scheduler, pipe.scheduler], weight_dtype=weight_dtype,
                               encoders_on_device=frozen.on_device,
                               call_kwargs={**size, "prior_num_inference_steps": args.validation_inference_steps})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: the prior denoises the normalised CLIP image embedding, conditioned on the caption's CLIP text
    # embedding and hidden states; after each optimizer step the loop updates the EMA, checkpoints and validates
    # when due (the final step included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            with torch.no_grad():
                text_embeds, hidden_states, mask = (torch.stack(part) for part in zip(*prompt_rows(batch["prompt"])))
                embeds = (image_embeddings(pipe, batch["pixels"]).float() - prior.clip_mean) / prior.clip_std
            noise = torch.randn_like(embeds)
            timesteps = sample_timesteps(noise_scheduler, embeds.shape[0], embeds.device)
            output = models["prior"](noise_scheduler.add_noise(embeds, noise, timesteps), timestep=timesteps,
                                      proj_embedding=text_embeds, encoder_hidden_states=hidden_states,
                                      attention_mask=mask, return_dict=False)[0]
            target = prediction_target(noise_scheduler, embeds, noise, timesteps)
            loss = diffusion_loss(output, target, noise_scheduler, timesteps, args.snr_gamma)
            loop.backward_and_step(loss)

    # 6. Save the prior pipeline with the raw prior and the EMA prior from memory, check the files, write the card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        finish_run(args, "Kandinsky 2.2 prior fine-tune", fine_tuned_how_to_load(
            args, pipe, ema, "prior", HOW_TO_LOAD, decoder=args.pretrained_decoder_model_name_or_path),
                   loop.records, saved, "prior")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
