#!/usr/bin/env python
# Copied from examples/video/train_text_to_video_lora_wan.py
"""Train a LoRA on CogVideoX's transformer (CogVideoX 1.0 and 1.5) for text-to-video, by v-prediction.

    accelerate launch train_cogvideox_lora.py \\
      --pretrained_model_name_or_path=THUDM/CogVideoX-2b \\
      --instance_data_root=clips --caption_column=prompts.txt --video_column=videos.txt --id_token=BW_STYLE \\
      --output_dir=out --height=480 --width=720 --max_num_frames=49 --rank=64 --lora_alpha=64 --use_ema \\
      --mixed_precision=bf16 --gradient_checkpointing --cache_latents --offload \\
      --validation_prompt "BW_STYLE a red fox running through snow" --num_validation_videos=1

Writes ``pytorch_lora_weights.safetensors`` (with ``--use_ema`` also ``ema/…``), which
``CogVideoXPipeline.load_lora_weights(output_dir)`` loads, validation videos (mp4 and a PNG frame strip each) with
``validation/log.jsonl``, checkpoints to resume from, and a model card. The clips come in upstream's layout
(``--instance_data_root`` with a file of prompts and a file of video paths, or a local ``--dataset_name`` of paths
and captions) or as every video script here takes them (``--train_data_dir`` of videos and still images with
captions in ``metadata.jsonl`` or sidecar ``.txt`` files); a clip shorter than ``--num_frames``
(``--max_num_frames``) trains at the longest count (4k+1) it has. The text encoder (T5) embeds the captions once,
before training, exactly as the pipeline's ``encode_prompt`` does, and ``--cache_latents`` encodes each clip once.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import torch
from diffusers import CogVideoXPipeline

from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.adapters.config import adapter_config
from training_utils.adapters.export import adapter_export
from training_utils.adapters.injection import add_adapter, linear_layers_named
from training_utils.args import (add_cache_args, add_lora_args, add_lora_layers_arg, check_args, comma_separated,
                                 export_formats, fill_dependent_defaults, training_parser)
from training_utils.compile import compile_repeated_blocks
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import (TrainDataset, captions_with_empty, drop_caption, make_dataloader,
                                          pick_caption, stack_collate)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform
from training_utils.data.prompts import cached_rows
from training_utils.data.video import (VideoTransform, add_video_args, cache_clip_latents, check_video_args,
                                       clip_latents, clip_sample)
from training_utils.data.video_lists import (add_video_list_args, check_video_list_args, fill_video_list_args,
                                             find_listed_clips, video_list_folder)
from training_utils.ema import make_ema
from training_utils.families import cogvideox
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import save_with_ema
from training_utils.outputs.hub import VIDEO_LORA_HOW_TO_LOAD, finish_run, how_to_load
from training_utils.outputs.run_status import run_script
from training_utils.pipeline import load_pipeline, prepare_components, trainable_parameters, weight_dtype_for
from training_utils.posthoc_ema import make_posthoc_ema
from training_utils.quantization import quantization_config
from training_utils.validation import make_validator

# The attention projections of every block (upstream's target modules).
LORA_LAYERS = "to_q,to_k,to_v,to_out.0"


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=50, resolution=480,
                             tracker_project_name="cogvideox-lora")
    add_lora_args(parser, CogVideoXPipeline)
    add_video_args(parser, CogVideoXPipeline, num_frames=49)  # upstream's --max_num_frames default
    add_video_list_args(parser)
    cogvideox.add_args(parser)
    add_lora_layers_arg(parser, LORA_LAYERS, "transformer_blocks.0.attn1.to_q")
    add_cache_args(parser)
    parser.set_defaults(rank=128, lora_alpha=128, output_dir="cogvideox-lora", num_validation_images=1)
    args = parser.parse_args(argv)
    fill_video_list_args(args, cogvideox.VIDEO)
    check_args(args)
    check_video_list_args(args)
    check_video_args(args, cogvideox.video_geometry(args))
    cogvideox.check_args(args)
    fill_dependent_defaults(args)
    if args.instance_data_root is not None and args.dataset_name is None:
        args.train_data_dir = video_list_folder(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load: every clip is probed.
    clips = find_listed_clips(args, cogvideox.video_geometry(args))
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once. Its modules train and render the validation videos. Prompts are encoded as its own
    #    encode_prompt does, with the same settings in training and validation; the noise schedule is its sampler's.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    quantization = quantization_config(args, weight_dtype, base=list(cogvideox.DENOISERS),
                                       text_encoders=["text_encoder"])
    pipe = load_pipeline(CogVideoXPipeline, args, weight_dtype, quantization=quantization)
    noise_scheduler = cogvideox.training_noise_scheduler(pipe)
    if args.enable_vae_tiling:
        pipe.vae.enable_tiling()
    if args.enable_slicing:
        pipe.vae.enable_slicing()
    settings = cogvideox.prompt_settings(pipe, args)
    call_kwargs = cogvideox.call_kwargs(pipe, settings)

    # 3. An adapter (--adapter) on the transformer; the EMA tracks it.
    trained = cogvideox.trained_denoisers(pipe, args)
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

    # 4. Data: each clip trains at its (frames, height, width) bucket. The frozen encoders run once, here (the text
    #    encoder on each caption; with --cache_latents, the VAE on each clip), then leave the accelerator.
    transform = VideoTransform(ImageTransform.from_args(args, pipe))
    frozen = FrozenEncoders(cogvideox.image_vae(pipe), [pipe.text_encoder], transform.images, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)

    def encode_prompts(prompts):
        return cogvideox.encode_prompts(pipe, prompts, accelerator.device, settings)

    embeddings = frozen.text_embeddings(captions_with_empty([clip.caption for clip in clips], args.caption_dropout),
                                        encode_prompts, cogvideox.prompt_dependencies(pipe, settings))
    shapes = [transform.shape_of(clip) for clip in clips]
    cached = cache_clip_latents(frozen, clips, transform, shapes) if args.cache_latents else [None] * len(clips)

    def preprocess(index, generator):
        video = clip_sample(clips[index], transform, generator, cached[index])
        prompt = drop_caption(pick_caption(clips[index].caption, generator), args.caption_dropout, generator)
        return {"video": video, "prompt": prompt, "frame_rate": clips[index].fps}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(list(range(len(clips))), preprocess, args.seed, args.repeats, shapes), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    prompt_rows = cached_rows(embeddings, accelerator.device)

    num_frames = args.validation_num_frames or args.num_frames
    validator = make_validator(args, pipe, accelerator, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
                               weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
                               video_fps=args.validation_fps,
                               call_kwargs={**validation_size(args, [shape[1:] for shape in shapes]),
                                            "num_frames": num_frames, "output_type": cogvideox.VIDEO.output_type,
                                            "use_dynamic_cfg": args.use_dynamic_cfg, **call_kwargs})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: v-prediction on the video latents, as upstream trains CogVideoX: the velocity the transformer
    # predicts gives clean latents, compared with the latents and weighted by 1 / (1 - alphas_cumprod[t]). After
    # each optimizer step the loop updates the EMA, checkpoints and validates when due.
    for model in models.values():
        model.train()
    for batch in loop:
        denoiser = cogvideox.step_denoiser(pipe, noise_scheduler, trained, args.seed, loop.global_step)
        with accelerator.accumulate(*models.values()):
            latents = cogvideox.normalized_latents(pipe, clip_latents(frozen, batch["video"]))
            noise = torch.randn_like(latents)
            timesteps, _ = cogvideox.sample_denoiser_timesteps(pipe, noise_scheduler, args, latents, denoiser)
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            text = cogvideox.text_inputs(prompt_rows(batch["prompt"]))
            inputs = cogvideox.model_inputs(pipe, noisy_latents, timesteps, text, batch["frame_rate"])
            output = models[denoiser](**inputs, return_dict=False)[0]
            predicted = noise_scheduler.get_velocity(cogvideox.prediction(pipe, output, latents), noisy_latents,
                                                     timesteps)
            weights = 1 / (1 - noise_scheduler.alphas_cumprod.to(latents.device, torch.float32)[timesteps])
            loss = (weights.view(-1, 1, 1, 1, 1) * (predicted.float() - latents.float()) ** 2).mean()
            loop.backward_and_step(loss)

    # 6. Save raw and EMA adapters from memory, check the files against it, and write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        how_to_load_text = how_to_load(VIDEO_LORA_HOW_TO_LOAD, args, pipe, num_frames=num_frames,
                                       fps=cogvideox.VIDEO.fps,
                                       load_lora=cogvideox.load_adapter_lines(export, args.output_dir))
        finish_run(args, f"Text-to-video {export.title} (CogVideoX)", how_to_load_text, loop.records, saved,
                   export.title)
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
