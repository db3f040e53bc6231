#!/usr/bin/env python
# Copied from examples/video/train_image_to_video_lora_wan.py
"""Train a LoRA on HunyuanVideo 1.5's image-to-video transformer, by flow matching.

    accelerate launch train_image_to_video_lora_hunyuan_video15.py \\
      --pretrained_model_name_or_path=hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v \\
      --train_data_dir=clips --output_dir=out --resolution=480 --num_frames=33 --frame_rate=24 \\
      --rank=32 --use_ema --mixed_precision=bf16 --gradient_checkpointing --cache_latents --offload \\
      --validation_prompt "a red fox running through snow" --validation_image fox.png --num_validation_images=1

Each clip's first frame conditions it exactly as ``HunyuanVideo15ImageToVideoPipeline`` conditions a video on its
image: the VAE latents of that frame on the first latent frame (zeros after it) and a mask of that frame, beside the
noisy latents, and the SigLIP image embedding of the frame (all made in every step, from the first frame laid out as
the clip's frames are). Writes ``pytorch_lora_weights.safetensors`` (with ``--use_ema`` also ``ema/…``), which the
pipeline's transformer loads with ``pipe.transformer.load_lora_adapter(output_dir, prefix=None,
use_safetensors=True)`` (the pipeline has no ``load_lora_weights``), validation videos from ``--validation_image``
(default: the first clip's first frame; rendered at the size the pipeline picks for the image, its transformer's
``target_size`` area; mp4 and a PNG frame strip each) with ``validation/log.jsonl``, checkpoints to resume from, and
a model card. ``--train_data_dir`` holds videos and still images (one-frame clips) with captions in
``metadata.jsonl`` or sidecar ``.txt`` files; a clip shorter than ``--num_frames`` trains at the longest count (4k+1)
it has. A still is its own conditioning, which teaches the model to copy its image: a run of stills alone stops
before anything loads, and a quarter or more of them is warned of. The text encoders (Qwen2.5-VL's language model,
and ByT5 for the prompt's quoted text) embed the captions once, before training, exactly as the pipeline's
``encode_prompt`` does, and ``--cache_latents`` encodes each clip once.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

from contextlib import nullcontext
from pathlib import Path

import torch
from diffusers import HunyuanVideo15ImageToVideoPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.adapters.config import adapter_config
from training_utils.adapters.export import ModelLoraExport, adapter_export
from training_utils.adapters.injection import add_adapter, linear_layers_named
from training_utils.args import (add_cache_args, add_lora_args, add_lora_layers_arg, check_args, comma_separated,
                                 export_formats, fill_dependent_defaults, training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.data.datasets import (TrainDataset, captions_with_empty, drop_caption, make_dataloader,
                                          pick_caption, stack_collate)
from training_utils.data.feature_store import encoders_on
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform, read_image
from training_utils.data.prompts import cached_rows
from training_utils.data.video import (VideoTransform, add_video_args, cache_clip_latents, check_image_to_video_clips,
                                       check_video_args, clip_latents, clip_sample_with_first_frame, find_clips,
                                       read_frames)
from training_utils.ema import make_ema
from training_utils.errors import require
from training_utils.families import hunyuan_video15
from training_utils.flow_matching import add_flow_matching_args, add_noise, check_flow_matching_args, flow_matching_loss
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import save_with_ema
from training_utils.outputs.hub import VIDEO_LORA_HOW_TO_LOAD, finish_run, how_to_load
from training_utils.outputs.run_status import run_script
from training_utils.pipeline import load_pipeline, prepare_components, trainable_parameters, weight_dtype_for
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.quantization import quantization_config
from training_utils.validation import make_validator

# The attention projections of the video tokens in every block (and of the text in the token refiner's blocks).
LORA_LAYERS = "to_q,to_k,to_v,to_out.0"


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=50, resolution=480)
    add_lora_args(parser, HunyuanVideo15ImageToVideoPipeline)
    add_video_args(parser, HunyuanVideo15ImageToVideoPipeline)
    add_flow_matching_args(parser, weighting_scheme="none")
    add_lora_layers_arg(parser, LORA_LAYERS, "transformer_blocks.0.attn.to_q")
    add_cache_args(parser)
    parser.add_argument("--validation_image", nargs="+", default=None,
                        help="the image each validation prompt starts from (one, or one per prompt; default: the "
                             "first frame of the first clip)")
    args = parser.parse_args(argv)
    check_args(args)
    check_flow_matching_args(args)
    check_video_args(args, hunyuan_video15.video_geometry(args))
    hunyuan_video15.check_model(args, "HunyuanVideo15ImageToVideoPipeline")
    require(args.validation_height is None and args.validation_width is None, "--validation_height/--validation_width",
            f"{args.validation_height}/{args.validation_width}", "none: the pipeline renders at the size its "
            "transformer's target_size picks for the validation image's aspect ratio")
    images = args.validation_image or []
    require(all(Path(path).is_file() for path in images) and len(images) in (0, 1, len(args.validation_prompt or [])),
            "--validation_image", images, "image files, one for every --validation_prompt or one for all")
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load: every clip is probed.
    geometry = hunyuan_video15.video_geometry(args)
    clips = find_clips(args, geometry)
    check_image_to_video_clips(clips, args, geometry)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once. Its modules train and render the validation videos. Prompts are encoded as its own
    #    encode_prompt does, with the same settings in training and validation; the noise levels are its sampler's.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    quantization = quantization_config(args, weight_dtype, base=list(hunyuan_video15.DENOISERS),
                                       text_encoders=["text_encoder", "text_encoder_2"])
    pipe = load_pipeline(HunyuanVideo15ImageToVideoPipeline, args, weight_dtype, quantization=quantization)
    noise_scheduler = hunyuan_video15.training_noise_scheduler(pipe)
    if args.enable_vae_tiling:
        pipe.vae.enable_tiling()
    settings = hunyuan_video15.prompt_settings(pipe, args)
    call_kwargs = hunyuan_video15.call_kwargs(pipe, settings)

    # 3. An adapter (--adapter) on each denoiser that trains (the family's: its one transformer); the EMA tracks it.
    trained = hunyuan_video15.trained_denoisers(pipe, args)
    for transformer in trained.values():
        layers = linear_layers_named(transformer, comma_separated(args.lora_layers))
        add_adapter(transformer, adapter_config(args, layers))
    # The image encoder stays on the accelerator: it embeds each step's first frames.
    prepare_components(pipe, trained, accelerator.device, weight_dtype,
                       encoders=[pipe.vae, pipe.text_encoder, pipe.text_encoder_2])
    for transformer in trained.values():
        if args.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        compile_repeated_blocks(transformer, args.torch_compile)
    parameters = trainable_parameters(trained)
    export = adapter_export(type(pipe), trained, export_formats(args), lora_export=ModelLoraExport)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: each clip trains at its (frames, height, width) bucket. The frozen encoders run once, here (the text
    #    encoders on each caption; with --cache_latents, the VAE on each clip), then leave the accelerator.
    transform = VideoTransform(ImageTransform.from_args(args, pipe))
    frozen = FrozenEncoders(hunyuan_video15.image_vae(pipe), [pipe.text_encoder, pipe.text_encoder_2],
                            transform.images, accelerator.device, weight_dtype, cache_latents=args.cache_latents,
                            cache_dir=args.feature_cache_dir, offload=args.offload, seed=args.seed)

    def encode_prompts(prompts):
        return hunyuan_video15.encode_prompts(pipe, prompts, accelerator.device, settings)

    embeddings = frozen.text_embeddings(captions_with_empty([clip.caption for clip in clips], args.caption_dropout),
                                        encode_prompts, hunyuan_video15.prompt_dependencies(pipe, settings))
    shapes = [transform.shape_of(clip) for clip in clips]
    cached = cache_clip_latents(frozen, clips, transform, shapes) if args.cache_latents else [None] * len(clips)

    def preprocess(index, generator):
        video, first_frame = clip_sample_with_first_frame(clips[index], transform, generator, cached[index])
        prompt = drop_caption(pick_caption(clips[index].caption, generator), args.caption_dropout, generator)
        return {"video": video, "first_frame": first_frame, "prompt": prompt, "frame_rate": clips[index].fps}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(list(range(len(clips))), preprocess, args.seed, args.repeats, shapes), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    prompt_rows = cached_rows(embeddings, accelerator.device)

    num_frames = args.validation_num_frames or args.num_frames
    prompts = args.validation_prompt or []
    images = [read_image(path) for path in args.validation_image or []] or \
        read_frames(clips[0].source, [0])
    images = images * len(prompts) if len(images) == 1 else images
    validator = make_validator(args, pipe, accelerator, prompt_kwargs=[{"image": image} for image in images],
                               conditioning_images=images, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
                               weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
                               video_fps=args.validation_fps,
                               call_kwargs={"num_frames": num_frames, "output_type": hunyuan_video15.VIDEO.output_type,
                                            **call_kwargs})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: flow matching on the video latents, conditioned on each clip's first frame as the pipeline conditions
    # on its image; each step trains the denoiser the family draws for it and its timesteps (here always the one
    # transformer). After each optimizer step the loop updates the EMA, checkpoints and validates when due.
    for model in models.values():
        model.train()
    for batch in loop:
        denoiser = hunyuan_video15.step_denoiser(pipe, noise_scheduler, trained, args.seed, loop.global_step)
        with accelerator.accumulate(*models.values()):
            latents = hunyuan_video15.normalized_latents(pipe, clip_latents(frozen, batch["video"]))
            noise = torch.randn_like(latents)
            timesteps, sigmas = hunyuan_video15.sample_denoiser_timesteps(pipe, noise_scheduler, args, latents,
                                                                          denoiser)
            with encoders_on(accelerator.device, [pipe.vae]) if args.cache_latents or args.offload else nullcontext():
                conditioning = hunyuan_video15.image_to_video_conditioning(pipe, batch["first_frame"], latents)
            text = hunyuan_video15.text_inputs(prompt_rows(batch["prompt"]))
            inputs = hunyuan_video15.image_to_video_inputs(pipe, add_noise(latents, noise, sigmas), timesteps, text,
                                                           conditioning, batch["frame_rate"])
            output = models[denoiser](**inputs, return_dict=False)[0]
            loss = flow_matching_loss(hunyuan_video15.prediction(pipe, output, latents), latents, noise, sigmas, args)
            loop.backward_and_step(loss)

    # 6. Save raw and EMA adapters from memory, check the files against it, and write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        how_to_load_text = how_to_load(VIDEO_LORA_HOW_TO_LOAD, args, pipe, num_frames=num_frames,
                                       fps=hunyuan_video15.VIDEO.fps,
                                       load_lora=hunyuan_video15.load_adapter_lines(export, args.output_dir))
        finish_run(args, f"Image-to-video {export.title} (HunyuanVideo 1.5)", how_to_load_text, loop.records, saved,
                   export.title)
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
