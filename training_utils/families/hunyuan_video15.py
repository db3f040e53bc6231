"""HunyuanVideo 1.5: its conditioning and latent layout for training, taken from the pipelines themselves
(`HunyuanVideo15Pipeline`, `HunyuanVideo15ImageToVideoPipeline`).

The transformer reads:

- the text as ``pipe.encode_prompt`` makes it (`encode_prompts`): the Qwen2.5-VL language model's third-to-last
  hidden states of the prompt in the pipeline's chat template, padded to 1000 tokens past the template's system
  turn, with their mask (``encoder_hidden_states``, ``encoder_attention_mask``), and the ByT5 glyph encoder's states
  of the prompt's quoted text, zeros and an empty mask where it quotes none (``encoder_hidden_states_2``,
  ``encoder_attention_mask_2``);
- ``hidden_states``: the video's VAE latents ``(B, C, frames, H, W)`` times the VAE's ``scaling_factor``
  (`normalized_latents`; sampling divides by it before decoding), with a condition's latents and its mask beside them
  on the channels: for text-to-video zeros (`model_inputs`), for image-to-video the first frame's latents and a mask
  of ones on the first latent frame (`image_to_video_conditioning`);
- ``image_embeds``: for text-to-video zeros (729 tokens, which the transformer reads as "no image"), for
  image-to-video the SigLIP vision encoder's last hidden states of the first frame;
- ``timestep``: the flow-matching scheduler's timestep (1000 × sigma, shifted by its ``shift``), one per sample.

It predicts the velocity (`prediction`). One transformer denoises every noise level: the video protocol's denoiser
functions (`protocol.VideoFamily`) name it alone. The pipelines have no LoRA loader: the transformer loads its
adapter itself (`adapters.export.ModelLoraExport`, `load_adapter_lines`).
"""

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image

from . import base
from ..errors import require
from ..flow_matching import sample_flow_matching_timesteps
from .base import VideoGeometry, stacked
from .layout import Family

FAMILY = Family("hunyuan_video15", "HunyuanVideo 1.5", ("HunyuanVideo15Pipeline",
                                                       "HunyuanVideo15ImageToVideoPipeline"), "transformer")
DENOISERS = ("transformer",)
# A VAE of 16× in space and 4× in time, 1×1×1 patches (sides of multiples of 16), 24 frames a second (the original
# release writes its videos so), frames as NumPy arrays (the pipelines' default).
VIDEO = VideoGeometry(spatial=16, temporal=4, size_multiple=16, fps=24, output_type="np")
video_geometry = base.fixed_geometry(VIDEO)
call_kwargs = base.call_kwargs
normalized_latents = base.scaled_latents  # the video's latents (B, C, frames, H, W)
prediction = base.output_as_is  # the velocity, in the latents' layout


def check_model(args, pipeline):
    """Fail in one line, before any weights load, on what this family's scripts do not train or render: a local
    ``--pretrained_model_name_or_path`` that is not a ``pipeline`` (a class name) or whose transformer is
    step-distilled by MeanFlow (read from its ``model_index.json`` and ``transformer/config.json``), and
    ``--validation_guidance_scale``, which the pipelines do not take (their ``guider`` component holds the scale)."""
    require(args.validation_guidance_scale is None, "--validation_guidance_scale", args.validation_guidance_scale,
            f"none: {pipeline} takes its guidance from its guider component (guider/config.json's guidance_scale)")
    folder = Path(args.pretrained_model_name_or_path)
    if (folder / "model_index.json").is_file():
        found = json.loads((folder / "model_index.json").read_text()).get("_class_name")
        require(found == pipeline, "--pretrained_model_name_or_path", args.pretrained_model_name_or_path,
                f"a {pipeline} (it is a {found})")
    if (folder / "transformer" / "config.json").is_file():
        config = json.loads((folder / "transformer" / "config.json").read_text())
        require(not config.get("use_meanflow"), "--pretrained_model_name_or_path", args.pretrained_model_name_or_path,
                "a transformer trained by flow matching (its use_meanflow is set: a step-distilled model, which "
                "trains on pairs of timesteps)")


def image_vae(pipe):
    """The pipeline's VAE, encoding and decoding one clip at a time: its attention's causal mask does not broadcast
    over a batch (diffusers 0.42), so a batch is split into clips, each encoded as alone."""
    pipe.vae.enable_slicing()
    return pipe.vae


def prompt_settings(pipe, args):
    """Nothing to set: the pipelines encode every prompt at their own lengths (``tokenizer_max_length``,
    ``tokenizer_2_max_length``)."""
    return {}


def prompt_dependencies(pipe, settings):
    return [encode_prompts, pipe.tokenizer, pipe.tokenizer_2, pipe.system_message, pipe.prompt_template_encode_start_idx,
            pipe.tokenizer_max_length, pipe.tokenizer_2_max_length, settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(prompt_embeds, prompt_embeds_mask, prompt_embeds_2, prompt_embeds_mask_2)`` of ``pipe.encode_prompt``, one
    row per prompt (no negative prompt: that is validation's)."""
    return pipe.encode_prompt(prompts, device=device, batch_size=len(prompts), **settings)


def text_inputs(rows):
    return {"encoder_hidden_states": stacked(rows, 0), "encoder_attention_mask": stacked(rows, 1),
            "encoder_hidden_states_2": stacked(rows, 2), "encoder_attention_mask_2": stacked(rows, 3)}


def model_inputs(pipe, noisy_latents, timesteps, text, frame_rate=None):
    """All the transformer's inputs at ``timesteps`` as the text-to-video pipeline's loop passes them: the latents
    with a zero condition and mask beside them, zero image embeddings, the timesteps in the latents' dtype. The
    model does not condition on the clips' ``frame_rate``."""
    batch, channels, frames, height, width = noisy_latents.shape
    conditioning = {"condition": torch.zeros_like(noisy_latents),
                    "mask": noisy_latents.new_zeros(batch, 1, frames, height, width),
                    "image_embeds": noisy_latents.new_zeros(batch, pipe.vision_num_semantic_tokens,
                                                            pipe.vision_states_dim)}
    return image_to_video_inputs(pipe, noisy_latents, timesteps, text, conditioning, frame_rate)


def training_noise_scheduler(pipe):
    """The flow-matching scheduler the pipelines sample with (its ``shift``), over its 1000 training timesteps."""
    return FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)


trained_denoisers = base.only_transformer
step_denoiser = base.only_denoiser


def sample_denoiser_timesteps(pipe, noise_scheduler, args, latents, denoiser):
    return sample_flow_matching_timesteps(noise_scheduler, args, latents)


def load_adapter_lines(export, output_dir):
    """The model card's lines that load the adapter of ``export`` from ``output_dir``: a LoRA or DoRA with the
    transformer's ``load_lora_adapter`` (the pipelines have no ``load_lora_weights``), any other adapter with peft."""
    if export.kind == "peft":
        return "\n".join(["from peft import PeftModel",
                          f'PeftModel.from_pretrained(pipe.transformer, "{output_dir}/transformer")'
                          f'  # or "{output_dir}/ema/transformer"'])
    return (f'pipe.transformer.load_lora_adapter("{output_dir}", prefix=None, use_safetensors=True)'
            f'  # or "{output_dir}/ema"')


def image_to_video_conditioning(pipe, first_frames, latents):
    """``{"condition", "mask", "image_embeds"}`` for a batch's first frames (``(B, 3, H, W)`` in [-1, 1]) of clips
    whose latents are ``latents``, exactly as ``HunyuanVideo15ImageToVideoPipeline`` makes them for its image: its
    ``prepare_cond_latents_and_mask`` (the VAE's mode of the frame times ``scaling_factor`` on the first latent frame,
    zeros after it; a mask of ones there) and its ``encode_image`` (SigLIP's last hidden states of the frame as a
    PIL image, through the pipeline's feature extractor)."""
    vae = pipe.vae
    with torch.no_grad():
        first = vae.encode(first_frames[:, :, None].to(vae.device, vae.dtype)).latent_dist.mode()
        condition = torch.zeros_like(latents)
        condition[:, :, :1] = first.to(latents.dtype) * vae.config.scaling_factor
        mask = torch.zeros_like(latents[:, :1])
        mask[:, :, 0] = 1.0
        images = [Image.fromarray(((frame.float().permute(1, 2, 0).cpu().numpy() + 1) * 127.5).round()
                                  .clip(0, 255).astype(np.uint8)) for frame in first_frames]
        image_embeds = pipe.encode_image(images, 1, latents.device, pipe.transformer.dtype)
    return {"condition": condition, "mask": mask, "image_embeds": image_embeds}


def image_to_video_inputs(pipe, noisy_latents, timesteps, text, conditioning, frame_rate=None):
    """The transformer's inputs as the pipelines' loop passes them: the noisy latents, the condition's latents and
    its mask on the channels, the image embeddings, the timesteps in the latents' dtype."""
    hidden_states = torch.cat([noisy_latents, conditioning["condition"].to(noisy_latents.dtype),
                               conditioning["mask"].to(noisy_latents.dtype)], dim=1)
    return {"hidden_states": hidden_states, "timestep": timesteps.to(noisy_latents.dtype),
            "image_embeds": conditioning["image_embeds"].to(noisy_latents.dtype), **text}
