"""Wan (2.1 and 2.2): its conditioning and latent layout for training, taken from the pipelines themselves
(`WanPipeline`, `WanImageToVideoPipeline`), its experts, and its LoRA layout in ComfyUI.

The Wan transformer reads:

- ``encoder_hidden_states``: what ``pipe.encode_prompt`` returns for the prompt (`encode_prompts`): UMT5's last
  hidden states, zeroed past the prompt's tokens, ``max_sequence_length`` long (the pipeline's ``__call__`` default,
  512, unless ``--max_sequence_length`` says otherwise, and then in every render too);
- ``hidden_states``: the video's VAE latents ``(B, C, frames, H, W)`` standardised with the VAE's ``latents_mean``
  and ``latents_std`` (`normalized_latents`; sampling undoes it before decoding), and for image-to-video the first
  frame's mask and latents beside them on the channels (`image_to_video_conditioning`);
- ``timestep``: the scheduler's timestep, one per sample, or with TI2V's ``expand_timesteps`` one per token
  (`model_inputs`), and for Wan 2.1 I2V the CLIP image embedding (``encoder_hidden_states_image``).

It predicts the velocity (`prediction`). The training noise levels are those of the pipeline's sampler: flow
matching with its ``flow_shift`` (`training_noise_scheduler`). Wan 2.2 A14B has two experts: ``transformer``
denoises the timesteps at or above ``boundary_ratio × 1000``, ``transformer_2`` those below; ``--train_expert``
trains a LoRA on one of them (`trained_denoisers`), drawing only its timesteps (`sample_denoiser_timesteps`), or on
both, each optimizer step training one expert drawn with its share of the schedule (`step_denoiser`). These are
the video protocol's (`protocol.VideoFamily`): the script's loop names no expert.
"""

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

from . import base
from ..errors import require
from ..flow_matching import sample_flow_matching_timesteps
from .base import VideoGeometry
from .layout import Family, Rename

BLOCKS = r"blocks\.(\d+)\."
# The original release's module tree (ComfyUI's WAN21 model): diffusers' convert_wan_to_diffusers, read backwards.
COMFYUI_LAYOUT = (
    *(Rename(BLOCKS + rf"attn1\.{ours}", rf"blocks.\1.self_attn.{theirs}")
      for ours, theirs in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), (r"to_out\.0", "o"))),
    *(Rename(BLOCKS + rf"attn2\.{ours}", rf"blocks.\1.cross_attn.{theirs}")
      for ours, theirs in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), (r"to_out\.0", "o"),
                           ("add_k_proj", "k_img"), ("add_v_proj", "v_img"))),
    Rename(BLOCKS + r"ffn\.net\.0\.proj", r"blocks.\1.ffn.0"),
    Rename(BLOCKS + r"ffn\.net\.2", r"blocks.\1.ffn.2"),
    Rename(r"condition_embedder\.text_embedder\.linear_1", "text_embedding.0"),
    Rename(r"condition_embedder\.text_embedder\.linear_2", "text_embedding.2"),
    Rename(r"condition_embedder\.time_embedder\.linear_1", "time_embedding.0"),
    Rename(r"condition_embedder\.time_embedder\.linear_2", "time_embedding.2"),
    Rename(r"condition_embedder\.time_proj", "time_projection.1"),
    Rename(r"proj_out", "head.head"),
)
FAMILY = Family("wan", "Wan", ("WanPipeline", "WanImageToVideoPipeline"), "transformer", {}, COMFYUI_LAYOUT)
EXPERTS = {"high": "transformer", "low": "transformer_2"}
# The components that denoise, quantised with --quantize_base (``transformer_2`` where the pipeline has one).
DENOISERS = ("transformer", "transformer_2")
# Wan 2.1 and 2.2 A14B: a VAE of 8× in space and 4× in time, 1×2×2 patches (``WanPipeline.check_inputs`` asks sides
# of multiples of 16), 16 frames a second, frames as NumPy arrays (the pipeline's default). TI2V-5B's VAE is 16×
# in space (`video_geometry` reads it from the VAE's config).
VIDEO = VideoGeometry(spatial=8, temporal=4, size_multiple=16, fps=16, output_type="np")
PATCH = 2  # the transformer's spatial patch, in every released Wan
call_kwargs = base.call_kwargs
image_vae = base.image_vae
normalized_latents = base.standardised_latents  # the video's latents (B, C, frames, H, W)
prediction = base.output_as_is  # the velocity, in the latents' layout


def add_args(parser):
    group = parser.add_argument_group("Wan")
    base.add_max_sequence_length(group, "tokens per prompt (default: the pipeline's, 512)")
    group.add_argument("--train_expert", choices=["high", "low", "both"], default=None,
                       help="Wan 2.2 A14B: the expert that trains, high-noise (transformer), low-noise "
                            "(transformer_2) or both (default: both where the pipeline has two)")


def check_args(args):
    """Fail in one line on a bad setting, before any weights load: ``--train_expert`` against the pipeline's
    ``model_index.json`` (a local folder's)."""
    base.check_max_sequence_length(args)
    index = Path(args.pretrained_model_name_or_path) / "model_index.json"
    if index.is_file():
        experts = json.loads(index.read_text()).get("transformer_2", [None])[0] is not None
        require(args.train_expert in (None, "high") or experts, "--train_expert", args.train_expert,
                "high or nothing: the pipeline has one transformer, no low-noise expert (transformer_2)")


def video_geometry(args):
    """`VIDEO` with the compression the pipeline's VAE states in its config (``scale_factor_spatial`` and
    ``scale_factor_temporal``), read before any weights load: TI2V-5B's VAE is 16× in space, so its sides are
    multiples of 32. Where the config cannot be read, loading will say why; until then, `VIDEO`."""
    config = base.component_config(AutoencoderKLWan, args, "vae")
    spatial = config.get("scale_factor_spatial") or VIDEO.spatial
    return VIDEO._replace(spatial=spatial, temporal=config.get("scale_factor_temporal") or VIDEO.temporal,
                          size_multiple=spatial * PATCH)


prompt_settings = base.call_length_settings  # the pipeline's 512 tokens by default


def prompt_dependencies(pipe, settings):
    return [encode_prompts, pipe.tokenizer, settings]


encode_prompts = base.prompt_embeds


text_inputs = base.embeds_text_inputs


def model_inputs(pipe, noisy_latents, timesteps, text, frame_rate=None):
    """All the transformer's inputs at ``timesteps`` as the sampling loop passes them: the latents, and the
    timesteps per sample, or with ``expand_timesteps`` (TI2V) per token of 1×2×2 latents. Wan does not condition
    on the clips' ``frame_rate``."""
    if not pipe.config.expand_timesteps:
        return {"hidden_states": noisy_latents, "timestep": timesteps, **text}
    frames, height, width = noisy_latents.shape[2:]
    tokens = torch.ones(frames, height, width, device=noisy_latents.device)[:, ::2, ::2].flatten()
    per_token = tokens[None] * timesteps.to(tokens.dtype)[:, None]
    return {"hidden_states": noisy_latents, "timestep": per_token, **text}


def training_noise_scheduler(pipe):
    """Flow matching with the shift the pipeline samples with (its UniPC sampler's ``flow_shift``, or a flow
    scheduler's ``shift``), over the training schedule's 1000 timesteps."""
    config = pipe.scheduler.config
    shift = config.get("flow_shift") if config.get("use_flow_sigmas") else config.get("shift", 1.0)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.num_train_timesteps, shift=shift)


def trained_denoisers(pipe, args):
    """``{component: transformer}`` of the experts that train: the one transformer, or the A14B's
    ``--train_expert`` (both by default)."""
    if pipe.transformer_2 is None:
        return {"transformer": pipe.transformer}
    train_expert = args.train_expert
    names = list(EXPERTS.values()) if train_expert in (None, "both") else [EXPERTS[train_expert]]
    return {name: getattr(pipe, name) for name in names}


def expert_ranges(pipe, noise_scheduler):
    """``{component: (first, end)}``: the indices of the training schedule (highest noise first) that each expert
    denoises in the pipeline's loop: ``transformer`` the timesteps at or above the boundary."""
    count = len(noise_scheduler.timesteps)
    if pipe.config.boundary_ratio is None:
        return {"transformer": (0, count)}
    boundary = pipe.config.boundary_ratio * noise_scheduler.config.num_train_timesteps
    high = int((noise_scheduler.timesteps >= boundary).sum())
    return {"transformer": (0, high), "transformer_2": (high, count)}


def step_denoiser(pipe, noise_scheduler, trained, seed, step):
    """The expert that optimizer step ``step`` trains: the only one, or with both, one drawn from (seed, step) alone
    (the same on every process and after resuming) with the share of the schedule it denoises."""
    if len(trained) == 1:
        return next(iter(trained))
    ranges = expert_ranges(pipe, noise_scheduler)
    generator = torch.Generator().manual_seed(hash((seed, step)) & 0x7FFF_FFFF_FFFF_FFFF)
    first, end = ranges["transformer"]
    share = (end - first) / len(noise_scheduler.timesteps)
    return "transformer" if torch.rand((), generator=generator) < share else "transformer_2"


def sample_denoiser_timesteps(pipe, noise_scheduler, args, latents, denoiser):
    """``(timesteps, sigmas)`` as `flow_matching.sample_flow_matching_timesteps` draws them, squeezed into the
    timesteps that the expert ``denoiser`` denoises (the density keeps its shape there)."""
    first, end = expert_ranges(pipe, noise_scheduler)[denoiser]
    count = len(noise_scheduler.timesteps)
    if (first, end) == (0, count):
        return sample_flow_matching_timesteps(noise_scheduler, args, latents)
    timesteps, _ = sample_flow_matching_timesteps(noise_scheduler, args, latents)
    positions = (noise_scheduler.timesteps.to(timesteps.device)[None] == timesteps[:, None]).float().argmax(1)
    indices = first + (positions * (end - first)) // count
    sigmas = noise_scheduler.sigmas[indices.cpu()].to(device=latents.device, dtype=latents.dtype)
    return noise_scheduler.timesteps[indices.cpu()].to(latents.device), sigmas.reshape(-1, *[1] * (latents.ndim - 1))


def load_adapter_lines(export, output_dir):
    """`base.load_adapter_lines`, with a Wan 2.2 low-noise expert's LoRA loaded into ``transformer_2``."""
    trained = list(export.adapter_configs)
    if export.kind == "peft" or "transformer_2" not in trained:
        return base.load_adapter_lines(export, output_dir)
    if trained == ["transformer_2"]:
        return f'pipe.load_lora_weights("{output_dir}", load_into_transformer_2=True)  # or "{output_dir}/ema"'
    return "\n".join([base.load_adapter_lines(export, output_dir),
                      f'pipe.load_lora_weights("{output_dir}/transformer_2", load_into_transformer_2=True)'])


# The first frame's mask beside the latents: one channel per frame of the VAE's 4-frame steps in time.
MASK_CHANNELS = 4
IMAGE_TO_VIDEO = (f"an image-to-video pipeline (WanImageToVideoPipeline) whose transformer takes the noisy latents, "
                  f"the first frame's mask ({MASK_CHANNELS} channels) and its latents: Wan 2.1 I2V, Wan 2.2 A14B I2V")
NOT_TI2V = "TI2V-5B's per-token timesteps are not built for image-to-video yet"


def check_image_to_video_model(args):
    """Stop in one line, before any weights load, if a local ``--pretrained_model_name_or_path`` is no image-to-video
    model this script trains (read from its ``model_index.json`` and ``transformer/config.json``): a text-to-video
    model's transformer takes the latents alone, and would fail at the first step on the conditioning's channels."""
    folder = Path(args.pretrained_model_name_or_path)
    if not (folder / "model_index.json").is_file() or not (folder / "transformer" / "config.json").is_file():
        return
    index = json.loads((folder / "model_index.json").read_text())
    config = json.loads((folder / "transformer" / "config.json").read_text())
    found = f"it is a {index.get('_class_name')} whose transformer takes {config.get('in_channels')} channels"
    require(not index.get("expand_timesteps"), "--pretrained_model_name_or_path", args.pretrained_model_name_or_path,
            f"{IMAGE_TO_VIDEO}; {NOT_TI2V}")
    require(index.get("_class_name") == "WanImageToVideoPipeline" and takes_first_frame(config),
            "--pretrained_model_name_or_path", args.pretrained_model_name_or_path,
            f"{IMAGE_TO_VIDEO} ({found}; a text-to-video model trains with train_text_to_video_lora_wan.py)")


def takes_first_frame(config):
    """Whether a transformer of ``config`` reads the first frame's mask and latents beside the noisy latents."""
    return config.get("in_channels") == 2 * config.get("out_channels", 0) + MASK_CHANNELS


def check_image_to_video(pipe):
    """Stop in one line on a pipeline whose image-to-video conditioning this script does not build: a transformer that
    does not read the first frame's mask and latents (a text-to-video model, of a hub name that
    `check_image_to_video_model` could not read before loading), or TI2V's (``expand_timesteps``: the first frame's
    clean latents in place of its noise, and no loss there)."""
    require(not pipe.config.expand_timesteps, "--pretrained_model_name_or_path", pipe.name_or_path,
            f"{IMAGE_TO_VIDEO}; {NOT_TI2V}")
    require(takes_first_frame(pipe.transformer.config), "--pretrained_model_name_or_path", pipe.name_or_path,
            f"{IMAGE_TO_VIDEO} (its transformer takes {pipe.transformer.config.in_channels} channels)")


def image_to_video_conditioning(pipe, first_frames, latents):
    """``{"condition", "encoder_hidden_states_image"}`` for a batch's first frames (``(B, 3, H, W)`` in [-1, 1]) of
    clips whose latents are ``latents``,
    exactly as ``WanImageToVideoPipeline`` makes them for its image: its ``prepare_latents`` (the mask of the first
    frame beside the VAE's mode of the first frame followed by black frames, standardised), one image at a time as
    the pipeline takes one, and its ``encode_image`` (the CLIP image encoder's second-to-last hidden states) where
    the transformer reads an image embedding."""
    height, width = first_frames.shape[-2:]
    latent_shape = (1, *latents.shape[1:])
    num_frames = (latents.shape[2] - 1) * pipe.vae_scale_factor_temporal + 1
    with torch.no_grad():
        condition = torch.cat([pipe.prepare_latents(
            frame[None].float(), 1, latent_shape[1], height, width, num_frames, torch.float32, latents.device,
            latents=torch.zeros(latent_shape))[1] for frame in first_frames])
        image_embeds = None
        if pipe.transformer.config.image_dim is not None:
            images = [((frame.float().permute(1, 2, 0).cpu().numpy() + 1) * 127.5).round().clip(0, 255)
                      .astype("uint8") for frame in first_frames]
            image_embeds = pipe.encode_image(images, latents.device)
    return {"condition": condition, "encoder_hidden_states_image": image_embeds}


def image_to_video_inputs(pipe, noisy_latents, timesteps, text, conditioning, frame_rate=None):
    """The transformer's inputs for image-to-video: the noisy latents with the conditioning beside them on the
    channels, the timesteps, and the image embedding, as the pipeline's loop passes them."""
    hidden_states = torch.cat([noisy_latents, conditioning["condition"].to(noisy_latents.dtype)], dim=1)
    return {**model_inputs(pipe, hidden_states, timesteps, text, frame_rate),
            "encoder_hidden_states_image": conditioning["encoder_hidden_states_image"]}

