#!/usr/bin/env python
# Copied from examples/consistency_distillation/train_lcm_distill_sd_wds.py; tests/test_drift.py keeps what
# they share alike.
"""Distill an SDXL pipeline into a latent consistency model (LCM) from WebDataset shards: a full UNet that renders in
2-8 steps with LCMScheduler, the guidance scale an input of it.

    accelerate launch train_lcm_distill_sdxl_wds.py \\
      --pretrained_teacher_model=stabilityai/stable-diffusion-xl-base-1.0 \\
      --pretrained_vae_model_name_or_path=madebyollin/sdxl-vae-fp16-fix \\
      --train_shards_path_or_url "laion/{00000..00099}.tar" --output_dir=out --resolution=1024 \\
      --learning_rate=1e-6 --max_train_steps=1000 --ema_decay=0.95 --validation_prompt "a red circle"

The shards (`training_utils.data.shards`) are local tars of samples, each an image (.jpg, .png, .jpeg, .webp) and a
caption (.txt, .text, .caption), read once into an on-disk table by datasets' webdataset builder: then they train
as any dataset does (seeded shuffling, exact resume). Upstream streams them, resampled with replacement; here each
epoch sees each sample once. SDXL's micro-conditioning is each image's own size and crop, as the SDXL scripts here
give it (upstream reads the original size from each sample's .json); ``--use_fix_crop_and_size`` tells the UNets
instead that every image was its training size, uncropped.

Latent consistency distillation (`training_utils.lcm`): the teacher is the pipeline's frozen UNet, which takes one
DDIM step of the skipping-step schedule (``--num_ddim_timesteps``) along the guided probability-flow ODE, at a
guidance scale w drawn from ``[--w_min, --w_max]`` (unconditional: zero embeddings). The student is a copy of it with
a guidance-scale embedding (``time_cond_proj_dim``, ``--unet_time_cond_proj_dim`` where the teacher has none), which
takes w as an input; its consistency output at the noisier timestep must match the target network's at the teacher's
step (``--loss_type l2|huber``). The target network is the student's EMA (``--ema_decay``, 0.95, updated after each
optimizer step; the EMA here, so kept always: ``--use_ema`` is implied), as upstream's ``target_unet``; its first
update copies the student (upstream's blends the initial weights in). The target's output is computed before the
student's, with the EMA swapped into the student's parameters: no second UNet in memory (with ``--ema_device cpu``,
each step copies the UNet to and from the CPU).

The frozen UNet (the teacher) and VAE run in the mixed-precision dtype (``--cast_teacher_unet`` is always so here);
the student trains, and is saved, in fp32. SDXL's own VAE overflows in fp16, so with ``--mixed_precision fp16`` pass
an fp16-safe one (as above) with ``--pretrained_vae_model_name_or_path``, or train in bf16. That VAE replaces the
pipeline's, for training and validation alike, and is saved in the pipeline folder.

The frozen text encoders run once per distinct caption before training, not in every step; with
``--cache_latents`` the VAE encodes each image once too. Cached encoders leave the accelerator until validation.

Validation renders the student and its EMA (upstream's ``target_unet``) side by side with an LCMScheduler (swapped
in only while it renders) in ``--validation_inference_steps`` (4) steps at the pipeline's guidance scale (or
``--validation_guidance_scale``), which the UNet takes as its w embedding (no classifier-free guidance). Writes a
pipeline holding the student (``StableDiffusionXLPipeline.from_pretrained(output_dir)``, then
``pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)``), the EMA UNet under ``ema/unet``, validation
images with ``validation/log.jsonl``, checkpoints to resume from, and a model card.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import torch
from diffusers import LCMScheduler, StableDiffusionXLPipeline

from training_utils import lcm
from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import add_cache_args, check_args, fill_dependent_defaults, training_parser
from training_utils.compile import compile_repeated_blocks
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import (TrainDataset, captions_with_empty, dataset_shapes, drop_caption,
                                          make_dataloader, pick_caption, stack_collate)
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform
from training_utils.data.prompts import cached_rows
from training_utils.data.shards import add_shard_args, load_shards
from training_utils.ema import make_ema
from training_utils.families import sdxl
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
from training_utils.validation_guidance import guidance_used, with_validation_guidance

# The flags of upstream's script that this one does not carry, besides those no script here carries.
REFUSED = {"--vae_encode_batch_size": "the VAE encodes each training batch whole (or each image once, "
                                      "--cache_latents)",
           **dict.fromkeys(["--dataset_name", "--dataset_config_name", "--train_data_dir", "--image_column",
                            "--caption_column"], "the data are WebDataset shards: --train_shards_path_or_url")}


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=4, resolution=1024)
    add_shard_args(parser)
    sdxl.add_args(parser)
    parser.add_argument("--cast_teacher_unet", action="store_true",
                        help="accepted for upstream's commands: the frozen UNet (the teacher) is always in the "
                             "mixed-precision dtype here")
    parser.add_argument("--use_fix_crop_and_size", action="store_true",
                        help="micro-condition on each image as its training size, uncropped (not its own size and "
                             "crop)")
    lcm.add_student_args(parser)
    parser.set_defaults(learning_rate=1e-4)
    lcm.add_args(parser)
    add_cache_args(parser)
    add_refused_args(parser, REFUSED)
    args = parser.parse_args(argv)
    check_args(args)
    sdxl.check_args(args)
    lcm.check_args(args)
    fill_dependent_defaults(args)
    return args


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    dataset = load_shards(args)
    accelerator = make_accelerator(args, run)

    # 2. The pipeline, once (with the replacement VAE, if any), its UNet in fp32 until the student is copied from it.
    #    That UNet is the teacher; the student takes its place in the pipeline, whose modules render validation
    #    images. The DDIM solver steps the teacher on the training noise schedule's alphas.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    vae_replacement = sdxl.vae_components(args.pretrained_vae_model_name_or_path, weight_dtype)
    pipe = load_pipeline(StableDiffusionXLPipeline, args, weight_dtype, trained_in_fp32=["unet"], **vae_replacement)
    if args.pretrained_vae_model_name_or_path:
        accelerator.print(f"VAE: {args.pretrained_vae_model_name_or_path}")
    teacher, text_encoders = pipe.unet, [pipe.text_encoder, pipe.text_encoder_2]
    pipe.unet = unet = lcm.student_unet(teacher, args.unet_time_cond_proj_dim)
    noise_scheduler = training_noise_scheduler(pipe)
    lcm.check_args(args, noise_scheduler.config.num_train_timesteps)
    solver = lcm.DDIMSolver(noise_scheduler.alphas_cumprod, args.num_ddim_timesteps)
    settings = sdxl.prompt_settings(pipe, args)
    call_kwargs = sdxl.call_kwargs(pipe, settings)

    # 3. The whole student trains, in fp32; the EMA (the target network) is made from its live tensors.
    trained = {"unet": unet}
    unet.requires_grad_(True)
    prepare_components(pipe, trained, accelerator.device, weight_dtype, encoders=[pipe.vae, *text_encoders])
    teacher.requires_grad_(False).eval().to(accelerator.device, dtype=weight_dtype)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    compile_repeated_blocks(unet, args.torch_compile)
    parameters = trainable_parameters(trained)
    export = PipelineExport(pipe, trained)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: the frozen encoders run once, here, not in every step (both text encoders on each distinct caption;
    #    with --cache_latents, the VAE on each image), then leave the accelerator until validation. Optimizer,
    #    schedule, accelerate; the loop resumes if asked.
    transform = ImageTransform.from_args(args, pipe)
    frozen = FrozenEncoders(sdxl.image_vae(pipe), text_encoders, transform, accelerator.device,
                            weight_dtype, cache_latents=args.cache_latents, cache_dir=args.feature_cache_dir,
                            offload=args.offload, seed=args.seed)

    def encode_prompts(prompts):
        return sdxl.encode_prompts(pipe, prompts, accelerator.device, settings)

    embeddings = frozen.text_embeddings(captions_with_empty(dataset["text"], args.caption_dropout),
                                        encode_prompts, sdxl.prompt_dependencies(pipe, settings))
    shapes = dataset_shapes(transform, dataset, "image")
    examples = frozen.cache_dataset_images(dataset, "image", shapes)

    def preprocess(example, generator):
        laid_out = frozen.dataset_image(example, generator)
        prompt = drop_caption(pick_caption(example["text"], generator), args.caption_dropout, generator)
        # SDXL is told each image's original size, where it was cropped (after any flip) and the size it trains at
        # (its bucket); with --use_fix_crop_and_size, that it was the size it trains at, uncropped.
        original_size, crop_top_left = ((laid_out.size, (0, 0)) if args.use_fix_crop_and_size
                                        else (laid_out.original_size, laid_out.crop_top_left))
        return {"image": laid_out.pixels, "prompt": prompt,
                "time_ids": sdxl.time_ids(original_size, crop_top_left, laid_out.size)}

    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(examples, preprocess, args.seed, args.repeats, shapes), args.train_batch_size,
        args.dataloader_num_workers, stack_collate, args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)
    prompt_rows = cached_rows(embeddings, accelerator.device)

    # Validation renders as an LCM is used: LCMScheduler (in place of the pipeline's only while it renders), few
    # steps, the guidance scale embedded (the pipeline does so for a UNet with time_cond_proj_dim).
    validator = make_validator(args, pipe, accelerator, ema=ema, posthoc=posthoc, schedulers=[noise_scheduler],
                               weight_dtype=weight_dtype, encoders_on_device=frozen.on_device,
                               render_scheduler=LCMScheduler.from_config(pipe.scheduler.config),
                               call_kwargs={**validation_size(args, shapes), **call_kwargs})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: the consistency distillation loss on the family's latents and conditioning (`sdxl`), each image's
    # micro-conditioning beside its prompt's; after each optimizer step the loop updates the EMA (the target
    # network), checkpoints and validates when due (the final step included, once).
    student = models["unet"]
    student.train()
    for batch in loop:
        with accelerator.accumulate(student):
            latents = sdxl.normalized_latents(pipe, frozen.latents(batch["image"]))
            # A timestep t_{n+k} of the DDIM schedule and the one a skip earlier, t_n; the latents noised to t_{n+k};
            # a guidance scale per image, and its embedding (as the pipeline embeds it when rendering).
            index, start_timesteps, timesteps = solver.sample(latents.shape[0], latents.device)
            noisy_latents = noise_scheduler.add_noise(latents, torch.randn_like(latents), start_timesteps)
            w = lcm.sample_guidance_scales(latents.shape[0], args.w_min, args.w_max, 1, "cpu", torch.float32)
            w_embedding = pipe.get_guidance_scale_embedding(w, embedding_dim=unet.config.time_cond_proj_dim)
            w_embedding = w_embedding.to(latents.device, latents.dtype)
            w = w.reshape(-1, 1, 1, 1).to(latents.device, latents.dtype)
            text = sdxl.text_inputs(prompt_rows(batch["prompt"]))
            text["added_cond_kwargs"]["time_ids"] = batch["time_ids"]
            uncond = {"encoder_hidden_states": torch.zeros_like(text["encoder_hidden_states"]),
                      "added_cond_kwargs": {"text_embeds": torch.zeros_like(text["added_cond_kwargs"]["text_embeds"]),
                                            "time_ids": batch["time_ids"]}}
            guided_text = {**text, "timestep_cond": w_embedding}

            def unet_output(model, sample, at, conditioning):
                return model(**sdxl.model_inputs(pipe, sample, at, conditioning), return_dict=False)[0]

            with torch.no_grad():
                # The teacher (frozen, in the mixed-precision dtype, under autocast as the student runs), guided: one
                # DDIM step from t_{n+k} to t_n.
                with accelerator.autocast():
                    teacher_outputs = [unet_output(teacher, noisy_latents, start_timesteps, conditioning)
                                       for conditioning in (text, uncond)]
                pred_x0, pred_noise = (
                    lcm.guided(*(predict(output, start_timesteps, noisy_latents, noise_scheduler)
                                 for output in teacher_outputs), w)
                    for predict in (lcm.predicted_original_sample, lcm.predicted_noise))
                x_prev = solver.step(pred_x0, pred_noise, index).to(noisy_latents.dtype)
                # The target: the target network's (the EMA's) consistency output at t_n, before the student's own
                # forward pass, which the swap would otherwise change under autograd.
                with ema.swapped_in():
                    target = lcm.consistency_output(unet_output(student, x_prev, timesteps, guided_text), timesteps,
                                                    x_prev, noise_scheduler, args.timestep_scaling_factor)
            # The student's consistency output at t_{n+k}.
            prediction = lcm.consistency_output(unet_output(student, noisy_latents, start_timesteps, guided_text),
                                                start_timesteps, noisy_latents, noise_scheduler,
                                                args.timestep_scaling_factor)
            loss = lcm.consistency_loss(prediction, target, args.loss_type, args.huber_c)
            loop.backward_and_step(loss)

    # 6. Save the pipeline with the student and its EMA UNet from memory, check the files, write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        how_to_load_text = lcm.with_lcm_scheduler(fine_tuned_unet_how_to_load(args, pipe, ema),
                                                  args.validation_inference_steps,
                                                  guidance_used(pipe, with_validation_guidance(args, pipe, {}))
                                                  ["guidance_scale"])
        finish_run(args, "Latent consistency model distilled from SDXL", how_to_load_text,
                   loop.records, saved, "UNet")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
