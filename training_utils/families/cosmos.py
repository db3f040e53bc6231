"""Cosmos Predict 2.5: its conditioning and latent layout for training, taken from `Cosmos2_5_PredictBasePipeline`.

The Cosmos transformer reads:

- ``encoder_hidden_states``: what the pipeline's ``encode_prompt`` returns for the prompt (`encode_prompts`): every
  layer's hidden states of Qwen2.5-VL over the prompt in its chat format, each standardised, side by side,
  ``max_sequence_length`` tokens long (the pipeline's ``__call__`` default, 512, unless ``--max_sequence_length``);
  the empty prompt, the classifier-free dropout's, is a zero embedding, as Cosmos is trained (upstream's
  ``--cfg_dropout_prob`` zeroes it);
- ``hidden_states``: the video's Wan VAE latents ``(B, C, frames, H, W)`` standardised with the VAE's ``latents_mean``
  and ``latents_std`` (`normalized_latents`), where the first 1 or 2 latent frames, the conditioning frames (one for
  Image2World, two for Video2World: ``--conditional_frames_probs``), are clean (`conditioned_latents`);
- ``condition_mask``: 1 on the conditioning frames; ``padding_mask``: zeros the size of the video in pixels;
- ``timestep``: the noise level σ itself, one per latent frame: ``--conditional_frame_timestep`` on the conditioning
  frames, the sample's σ on the others (`conditioned_inputs`).

It predicts the velocity ``noise - latents``; on the conditioning frames the pipeline replaces the prediction with the
true velocity, so the loss counts only the generated frames (`generated_frames_prediction`). The training noise
levels are Cosmos's: σ = 5t / (1 + 4t) for t drawn logit-normal (`training_noise_scheduler`'s shift 5, with
``--weighting_scheme logit_normal``). Text2World is the case of no conditioning frame (`model_inputs`).
"""

import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.transformers import transformer_cosmos

from . import base
from ..errors import require
from .base import VideoGeometry
from .layout import Family

FAMILY = Family("cosmos", "Cosmos Predict 2.5", ("Cosmos2_5_PredictBasePipeline",), "transformer")
DENOISERS = ("transformer",)
# The Wan 2.1 VAE: 8× in space, 4× in time; 1×2×2 patches (``check_inputs`` asks sides of multiples of 16); 16 frames
# a second (upstream's eval videos); PIL frames by default. A still image would be all conditioning: no stills.
VIDEO = VideoGeometry(spatial=8, temporal=4, size_multiple=16, fps=16, output_type="pil", stills=False)
# The shift of Cosmos Predict 2.5's training noise levels (its trainer's, and upstream's script's).
TRAINING_SHIFT = 5.0
# Upstream's names for flags every LoRA script has.
UPSTREAM_NAMES = {"--rank": "--lora_rank", "--adam_weight_decay": "--weight_decay",
                  "--validation_inference_steps": "--num_inference_steps"}
video_geometry = base.fixed_geometry(VIDEO)
call_kwargs = base.call_kwargs
image_vae = base.image_vae
normalized_latents = base.standardised_latents
trained_denoisers = base.only_transformer
step_denoiser = base.only_denoiser


class NearestResize:
    """What diffusers' Cosmos transformer takes from torchvision (``transforms.functional.resize`` with
    ``InterpolationMode.NEAREST``, to size its padding mask to the latents), as torch's own nearest interpolation,
    which is the operation torchvision runs on a tensor."""

    class InterpolationMode:
        NEAREST = "nearest"

    class functional:
        @staticmethod
        def resize(tensor, size, interpolation="nearest"):
            return F.interpolate(tensor, size=size, mode="nearest")


# The Cosmos transformer resizes its padding mask with torchvision, which it imports only where installed (and which
# does not import beside the CPU build of torch): without it, the transformer gets torch's nearest resize.
if not hasattr(transformer_cosmos, "transforms"):
    transformer_cosmos.transforms = NearestResize


def add_args(parser):
    """Upstream's Cosmos flags: the conditioning frames and their timestep, the text dropout, the training size, the
    learning-rate schedule, checkpoints by epoch, a final render (its names for flags every script has are
    `UPSTREAM_NAMES`)."""
    group = parser.add_argument_group("Cosmos")
    base.add_max_sequence_length(group, "tokens per prompt (default: the pipeline's, 512)")
    group.add_argument("--height", type=int, default=None,
                       help="train every clip at this height (with --width; default: --resolution's buckets)")
    group.add_argument("--width", type=int, default=None, help="train every clip at this width (with --height)")
    group.add_argument("--scheduler_warm_up_steps", type=int, default=None,
                       help="upstream's schedule: warm up over this many steps to --scheduler_f_max times the "
                            "learning rate, then fall linearly to --scheduler_f_min times it at --num_training_steps "
                            "(given any of the four, this schedule replaces --lr_scheduler; upstream's defaults: "
                            "1000, 100000, 0.5, 0.2)")
    group.add_argument("--num_training_steps", type=int, default=None, help="see --scheduler_warm_up_steps")
    group.add_argument("--scheduler_f_max", type=float, default=None, help="see --scheduler_warm_up_steps")
    group.add_argument("--scheduler_f_min", type=float, default=None, help="see --scheduler_warm_up_steps")
    group.add_argument("--checkpointing_epochs", type=int, default=None,
                       help="checkpoint every N epochs (upstream's; replaces --checkpointing_steps)")
    group.add_argument("--do_final_eval", action="store_true",
                       help="upstream's final render: without --validation_prompt, validate with the first clip's "
                            "caption, started from its first frame")

    group.add_argument("--conditional_frames_probs", default='{"1": 0.5, "2": 0.5}',
                       help="JSON: the probability of each count of clean conditioning latent frames (0: Text2World, "
                            "1: Image2World, 2: Video2World; default: 1 and 2 alike)")
    group.add_argument("--conditional_frame_timestep", type=float, default=0.0001,
                       help="the timestep the conditioning frames are given (0.0001 for the post-trained model; "
                            "below 0: the sample's own)")
    group.add_argument("--cfg_dropout_prob", dest="caption_dropout", type=float, default=0.2,
                       help="the probability of training a sample on the zero text embedding, for classifier-free "
                            "guidance (upstream's name for --caption_dropout; default 0.2)")


def check_args(args):
    """Fail in one line on a bad Cosmos flag, before any weights load; ``--conditional_frames_probs`` becomes
    ``{count: probability}``."""
    import json

    base.check_max_sequence_length(args)
    expected = 'a JSON object of latent frame counts 0, 1 or 2 and their probabilities, such as {"1": 0.5, "2": 0.5}'
    try:
        probabilities = {int(count): float(p) for count, p in json.loads(args.conditional_frames_probs).items()}
    except (ValueError, TypeError, AttributeError):
        probabilities = {}
    require(probabilities and set(probabilities) <= {0, 1, 2} and all(p >= 0 for p in probabilities.values())
            and sum(probabilities.values()) > 0, "--conditional_frames_probs", args.conditional_frames_probs, expected)
    args.conditional_frames_probs = probabilities


    if args.height is not None or args.width is not None:
        height, width = args.height or args.resolution, args.width or args.resolution
        require(height % VIDEO.size_multiple == 0 and width % VIDEO.size_multiple == 0, "--height/--width",
                f"{height}/{width}", f"multiples of {VIDEO.size_multiple} (the VAE divides sides by {VIDEO.spatial}, "
                "and the pipeline takes whole patches)")
        args.aspect_ratio_buckets = [(height, width)]
    for flag in ("num_training_steps", "scheduler_warm_up_steps", "checkpointing_epochs"):
        value = getattr(args, flag)
        require(value is None or value > 0, f"--{flag}", value, "a positive integer")


def check_conditional_frames(clips, args, geometry, flag, value):
    """Stop in one line if a clip has no latent frame past its most conditioning frames: it would teach nothing."""
    most = max(count for count, p in args.conditional_frames_probs.items() if p > 0)
    shortest = min(len(clip.indices) for clip in clips)
    require((shortest - 1) // geometry.temporal + 1 > most, flag, value,
            f"clips of more than {most} latent frames ({most * geometry.temporal + 1} frames or more), the most "
            f"that --conditional_frames_probs conditions on; the shortest has {shortest}")


def validate_first_clip(args, clips):
    """``--do_final_eval`` without ``--validation_prompt``: validate with the first clip's caption (upstream renders
    the first training sample after training; here each validation, the last included, renders it)."""
    if args.do_final_eval and not args.validation_prompt:
        caption = clips[0].caption
        args.validation_prompt = [caption if isinstance(caption, str) else caption[0]]


def validation_starts(images, args):
    """What each validation render starts from, as the pipeline takes it: the image as a one-frame ``video`` and one
    conditioning latent frame (the pipeline's Image2World, without the torchvision its ``image`` argument needs), or
    nothing where training conditions on no frame (Text2World)."""
    if set(args.conditional_frames_probs) == {0}:
        return [{} for _ in images]
    return [{"video": [image], "num_latent_conditional_frames": 1} for image in images]


def checkpoint_every_epochs(args, steps_per_epoch):
    """``--checkpointing_epochs``: checkpoints every that many epochs of ``steps_per_epoch`` steps."""
    if args.checkpointing_epochs is not None:
        args.checkpointing_steps = args.checkpointing_epochs * steps_per_epoch


def lr_scheduler(args, optimizer, max_train_steps, num_processes):
    """``--lr_scheduler``'s schedule, or given any of upstream's schedule flags, upstream's: a linear warm-up to
    ``--scheduler_f_max`` times the learning rate, then a linear fall to ``--scheduler_f_min`` times it at
    ``--num_training_steps`` (diffusers' ``get_linear_schedule_with_warmup``), each flag unset taking upstream's
    default."""
    from diffusers.optimization import get_linear_schedule_with_warmup

    from ..optimization import make_lr_scheduler

    flags = (args.scheduler_warm_up_steps, args.num_training_steps, args.scheduler_f_max, args.scheduler_f_min)
    if all(flag is None for flag in flags):
        return make_lr_scheduler(args, optimizer, max_train_steps, num_processes)
    warm_up, total, f_max, f_min = (default if flag is None else flag
                                    for flag, default in zip(flags, (1000, 100_000, 0.5, 0.2)))
    # accelerate steps a prepared scheduler once per process per optimizer step.
    return get_linear_schedule_with_warmup(optimizer, warm_up * num_processes, total * num_processes, f_min=f_min,
                                           f_max=f_max)


def draw_conditional_frames(probabilities, generator):
    """A sample's count of conditioning latent frames, drawn from ``generator`` with ``probabilities``."""
    counts = sorted(probabilities)
    weights = torch.tensor([probabilities[count] for count in counts], dtype=torch.float64)
    return counts[int(torch.multinomial(weights, 1, generator=generator))]


class PassThroughSafetyChecker:
    """The pipeline's safety checker during training: it passes every prompt and video. The Cosmos Guardrail models
    (``cosmos_guardrail``) are not loaded for the validation renders the trainer looks at, as upstream's script does
    not; a released model is rendered with the pipeline's own checker."""

    def to(self, *args, **kwargs):
        return self

    def check_text_safety(self, prompt):
        return True

    def check_video_safety(self, video):
        return video


prompt_settings = base.call_length_settings  # the pipeline's 512 tokens by default


def prompt_dependencies(pipe, settings):
    return [encode_prompts, pipe.tokenizer, settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(prompt_embeds,)`` of ``pipe.encode_prompt``, one row per prompt; the empty prompt's is zeros, the
    unconditional input Cosmos is trained with."""
    embeds = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=device, **settings)[0]
    empty = torch.tensor([prompt == "" for prompt in prompts], device=embeds.device)
    return (torch.where(empty[:, None, None], torch.zeros_like(embeds), embeds),)


text_inputs = base.embeds_text_inputs


def training_noise_scheduler(pipe):
    """Flow matching shifted by Cosmos's training shift (`TRAINING_SHIFT`) over 1000 timesteps: with
    ``--weighting_scheme logit_normal``, σ = 5t / (1 + 4t) for t drawn logit-normal, as Cosmos trains."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=TRAINING_SHIFT)


def sample_denoiser_timesteps(pipe, noise_scheduler, args, latents, denoiser):
    """``(timesteps, sigmas)`` drawn as `flow_matching.sample_flow_matching_timesteps` draws them, the timesteps in
    the transformer's unit: σ itself."""
    from ..flow_matching import sample_flow_matching_timesteps

    _, sigmas = sample_flow_matching_timesteps(noise_scheduler, args, latents)
    return sigmas.flatten(), sigmas


def frame_conditioning(latents, conditional_frames):
    """``(B, 1, frames, 1, 1)``: 1 on each sample's first ``conditional_frames[i]`` latent frames, as the pipeline's
    ``create_condition_mask`` marks them."""
    frames = torch.arange(latents.shape[2], device=latents.device)
    counts = torch.as_tensor(conditional_frames, device=latents.device)
    return (frames[None] < counts[:, None]).to(torch.float32)[:, None, :, None, None]


def conditioned_latents(noisy_latents, latents, indicator):
    """The noisy latents with the conditioning frames clean, as the pipeline's loop feeds them."""
    return indicator * latents + (1 - indicator) * noisy_latents


def conditioned_inputs(pipe, noisy_latents, timesteps, text, indicator, conditional_frame_timestep, frame_rate=None):
    """All the transformer's inputs as the pipeline's loop passes them: the latents (conditioning frames clean: see
    `conditioned_latents`), the condition mask over them, σ per latent frame (the conditioning frames'
    ``conditional_frame_timestep``, unless below 0), the text and a zero padding mask of the video's size in pixels.
    Cosmos Predict 2.5's pipeline gives the transformer no frame rate, so neither does training."""
    sigma = timesteps.reshape(-1, 1, 1, 1, 1).to(torch.float32)
    per_frame = indicator * conditional_frame_timestep + (1 - indicator) * sigma if conditional_frame_timestep >= 0 \
        else sigma
    height, width = (side * pipe.vae_scale_factor_spatial for side in noisy_latents.shape[-2:])
    dtype = noisy_latents.dtype
    return {"hidden_states": noisy_latents, "timestep": per_frame,
            "condition_mask": indicator.expand(-1, -1, -1, *noisy_latents.shape[-2:]).to(dtype),
            "padding_mask": noisy_latents.new_zeros(1, 1, height, width), **text}


def model_inputs(pipe, noisy_latents, timesteps, text, frame_rate=None):
    """The transformer's inputs for Text2World: `conditioned_inputs` with no conditioning frame."""
    indicator = noisy_latents.new_zeros(noisy_latents.shape[0], 1, noisy_latents.shape[2], 1, 1)
    return conditioned_inputs(pipe, noisy_latents, timesteps, text, indicator, 0.0, frame_rate)


def generated_frames_prediction(output, latents, noise, indicator):
    """The predicted velocity with the true one on the conditioning frames, as the pipeline's loop replaces it there:
    the loss counts the generated frames only."""
    from ..flow_matching import velocity

    return indicator * velocity(latents, noise) + (1 - indicator) * output


prediction = base.output_as_is  # the velocity, in the latents' layout
load_adapter_lines = base.load_adapter_lines
