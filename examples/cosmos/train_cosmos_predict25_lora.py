#!/usr/bin/env python
# Copied from examples/video/train_text_to_video_lora_wan.py
"""Train a LoRA on Cosmos Predict 2.5's transformer for Text-, Image- and Video2World, by flow matching.

    accelerate launch --mixed_precision=bf16 train_cosmos_predict25_lora.py \\
      --pretrained_model_name_or_path=nvidia/Cosmos-Predict2.5-2B --revision diffusers/base/post-trained \\
      --train_data_dir=gr1_dataset/train --output_dir=out --height 432 --width 768 --num_frames 93 \\
      --lora_rank 32 --lora_alpha 32 --gradient_checkpointing --use_ema --cache_latents \\
      --validation_prompt "a robot arm picks up a red cube" --num_validation_images=1

Each sample starts from clean conditioning latent frames, as the pipeline's Image2World (one) and Video2World (two)
start from the frames they are given, in the shares ``--conditional_frames_probs`` draws (default: one and two
alike); the loss counts the frames the model generates. Writes ``pytorch_lora_weights.safetensors`` (with
``--use_ema`` also ``ema/…``), which ``Cosmos2_5_PredictBasePipeline.load_lora_weights(output_dir)`` loads,
validation videos started from ``--validation_image`` (default: the first clip's first frame; mp4 and a PNG frame
strip each) with ``validation/log.jsonl``, checkpoints to resume from, and a model card. ``--train_data_dir`` holds
videos with captions in ``metadata.jsonl``, sidecar ``.txt`` files, or upstream's layout (``videos/`` beside
``metas/<name>.txt``). The text encoder (Qwen2.5-VL) embeds the captions once, before training, exactly as the
pipeline's ``encode_prompt`` does, and ``--cache_latents`` encodes each clip once.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

from pathlib import Path

import torch
from diffusers import Cosmos2_5_PredictBasePipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.adapters.config import adapter_config
from training_utils.adapters.export import adapter_export
from training_utils.adapters.injection import add_adapter, linear_layers_named
from training_utils.args import (add_aliases, add_cache_args, add_lora_args, add_lora_layers_arg, check_args,
                                 comma_separated, export_formats, fill_dependent_defaults, training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import (TrainDataset, captions_with_empty, drop_caption, make_dataloader,
                                          pick_caption, stack_collate)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform, read_image
from training_utils.data.prompts import cached_rows
from training_utils.data.video import (VideoTransform, add_video_args, cache_clip_latents, check_video_args,
                                       clip_latents, clip_sample, data_flag, find_clips, read_frames)
from training_utils.ema import make_ema
from training_utils.errors import require
from training_utils.families import cosmos
from training_utils.flow_matching import add_flow_matching_args, add_noise, check_flow_matching_args, flow_matching_loss
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_optimizer, training_length
from training_utils.outputs.export import save_with_ema
from training_utils.outputs.hub import VIDEO_LORA_HOW_TO_LOAD, finish_run, how_to_load
from training_utils.outputs.run_status import run_script
from training_utils.pipeline import load_pipeline, prepare_components, trainable_parameters, weight_dtype_for
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.quantization import quantization_config
from training_utils.validation import make_validator

# Upstream's: every block's attention projections and feed-forward layers.
LORA_LAYERS = "to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2"


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=36, resolution=704)
    add_lora_args(parser, Cosmos2_5_PredictBasePipeline)
    add_video_args(parser, Cosmos2_5_PredictBasePipeline)
    cosmos.add_args(parser)
    add_aliases(parser, cosmos.UPSTREAM_NAMES)
    add_flow_matching_args(parser, weighting_scheme="logit_normal")
    add_lora_layers_arg(parser, LORA_LAYERS, "transformer_blocks.0.attn1.to_q")
    add_cache_args(parser)
    parser.add_argument("--validation_image", nargs="+", default=None,
                        help="the image each validation prompt starts from (one, or one per prompt; default: the "
                             "first frame of the first clip)")
    parser.set_defaults(pretrained_model_name_or_path="nvidia/Cosmos-Predict2.5-2B",
                        revision="diffusers/base/post-trained", learning_rate=2 ** -14.5, adam_weight_decay=0.001,
                        rank=32, lora_alpha=32)
    args = parser.parse_args(argv)
    check_args(args)
    check_flow_matching_args(args)
    cosmos.check_args(args)
    check_video_args(args, cosmos.video_geometry(args))
    images = args.validation_image or []
    require(all(Path(path).is_file() for path in images) and len(images) in (0, 1, len(args.validation_prompt or [])),
            "--validation_image", images, "image files, one for every --validation_prompt or one for all")
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load: every clip is probed.
    geometry = cosmos.video_geometry(args)
    clips = find_clips(args, geometry)
    cosmos.check_conditional_frames(clips, args, geometry, *data_flag(args))
    cosmos.validate_first_clip(args, clips)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once, with a safety checker that passes everything (`cosmos.PassThroughSafetyChecker`). Its
    #    modules train and render the validation videos. Prompts are encoded as its own encode_prompt does; the noise
    #    levels are Cosmos's training ones.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    quantization = quantization_config(args, weight_dtype, base=list(cosmos.DENOISERS),
                                       text_encoders=["text_encoder"])
    pipe = load_pipeline(Cosmos2_5_PredictBasePipeline, args, weight_dtype, quantization=quantization,
                         safety_checker=cosmos.PassThroughSafetyChecker())
    noise_scheduler = cosmos.training_noise_scheduler(pipe)
    if args.enable_vae_tiling:
        pipe.vae.enable_tiling()
    settings = cosmos.prompt_settings(pipe, args)
    call_kwargs = cosmos.call_kwargs(pipe, settings)

    # 3. An adapter (--adapter) on the transformer; the EMA tracks it.
    trained = cosmos.trained_denoisers(pipe, args)
    for transformer in trained.values():
        layers = linear_layers_named(transformer, comma_separated(args.lora_layers))
        add_adapter(transformer, adapter_config(args, layers))
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, pipe.text_encoder])
    for transformer in trained.values():
        if args.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        compile_repeated_blocks(transformer, args.torch_compile)
    parameters = trainable_parameters(trained)
    export = adapter_export(type(pipe), trained, export_formats(args))
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: each clip trains at its (frames, height, width) bucket, with the count of conditioning latent frames
    #    drawn for it. The frozen encoders run once, here (the text encoder on each caption; with --cache_latents, the
    #    VAE on each clip), then leave the accelerator.
    transform = VideoTransform(ImageTransform.from_args(args, pipe))
    frozen = FrozenEncoders(cosmos.image_vae(pipe), [pipe.text_encoder], transform.images, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)

    def encode_prompts(prompts):
        return cosmos.encode_prompts(pipe, prompts, accelerator.device, settings)

    embeddings = frozen.text_embeddings(captions_with_empty([clip.caption for clip in clips], args.caption_dropout),
                                        encode_prompts, cosmos.prompt_dependencies(pipe, settings))
    shapes = [transform.shape_of(clip) for clip in clips]
    cached = cache_clip_latents(frozen, clips, transform, shapes) if args.cache_latents else [None] * len(clips)

    def preprocess(index, generator):
        video = clip_sample(clips[index], transform, generator, cached[index])
        prompt = drop_caption(pick_caption(clips[index].caption, generator), args.caption_dropout, generator)
        conditional_frames = cosmos.draw_conditional_frames(args.conditional_frames_probs, generator)
        return {"video": video, "prompt": prompt, "frame_rate": clips[index].fps,
                "conditional_frames": conditional_frames}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(list(range(len(clips))), preprocess, args.seed, args.repeats, shapes), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    cosmos.checkpoint_every_epochs(args, steps_per_epoch)
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = cosmos.lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    prompt_rows = cached_rows(embeddings, accelerator.device)

    num_frames = args.validation_num_frames or args.num_frames
    prompts = args.validation_prompt or []
    images = [read_image(path) for path in args.validation_image or []] or read_frames(clips[0].source, [0])
    images = images * len(prompts) if len(images) == 1 else images
    validator = make_validator(args, pipe, accelerator, prompt_kwargs=cosmos.validation_starts(images, args),
                               conditioning_images=images, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
                               weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
                               video_fps=args.validation_fps,
                               call_kwargs={**validation_size(args, [shape[1:] for shape in shapes]),
                                            "num_frames": num_frames, "output_type": cosmos.VIDEO.output_type,
                                            "conditional_frame_timestep": args.conditional_frame_timestep,
                                            **call_kwargs})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: flow matching on the video latents, the conditioning frames clean and given their own timestep as
    # the pipeline gives them, the loss on the generated frames only. After each optimizer step the loop updates the
    # EMA, checkpoints and validates when due.
    for model in models.values():
        model.train()
    for batch in loop:
        denoiser = cosmos.step_denoiser(pipe, noise_scheduler, trained, args.seed, loop.global_step)
        with accelerator.accumulate(*models.values()):
            latents = cosmos.normalized_latents(pipe, clip_latents(frozen, batch["video"]))
            noise = torch.randn_like(latents)
            timesteps, sigmas = cosmos.sample_denoiser_timesteps(pipe, noise_scheduler, args, latents, denoiser)
            indicator = cosmos.frame_conditioning(latents, batch["conditional_frames"])
            noisy = cosmos.conditioned_latents(add_noise(latents, noise, sigmas), latents, indicator)
            text = cosmos.text_inputs(prompt_rows(batch["prompt"]))
            inputs = cosmos.conditioned_inputs(pipe, noisy, timesteps, text, indicator,
                                               args.conditional_frame_timestep, batch["frame_rate"])
            output = models[denoiser](**inputs, return_dict=False)[0]
            prediction = cosmos.generated_frames_prediction(output, latents, noise, indicator)
            loss = flow_matching_loss(prediction, latents, noise, sigmas, args)
            loop.backward_and_step(loss)

    # 6. Save raw and EMA adapters from memory, check the files against it, and write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        how_to_load_text = how_to_load(VIDEO_LORA_HOW_TO_LOAD, args, pipe, num_frames=num_frames,
                                       fps=cosmos.VIDEO.fps,
                                       load_lora=cosmos.load_adapter_lines(export, args.output_dir))
        finish_run(args, f"Video {export.title} (Cosmos Predict 2.5)", how_to_load_text, loop.records, saved,
                   export.title)
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
