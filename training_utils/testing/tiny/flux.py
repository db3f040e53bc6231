"""Tiny FLUX.1 [dev] and FLUX.1 Kontext: a FLUX.1 transformer with a guidance embedding, CLIP and T5 (Kontext is
FLUX.1's transformer and encoders, conditioned on a reference image's tokens); an InstantX-style ControlNet made
from the transformer; and Kontext's edit dataset, one reference a row at most."""

import json
from pathlib import Path

import torch

from .data import build_shapes_edit
from .parts import SEED, tiny_clip_text_encoder, tiny_clip_tokenizer, tiny_t5_encoder, tiny_t5_tokenizer, tiny_vae


def flux_components():
    """A FLUX.1 [dev] pipeline's components: a FLUX.1 transformer (one double-stream and two single-stream blocks,
    embedding the guidance as [dev] does), a VAE with FLUX.1's shift and scale, a CLIP encoder (the pooled prompt), a
    T5 encoder with a real T5 tokenizer (the prompt's tokens), and FLUX.1's resolution-shifted flow-matching
    scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    clip, t5 = tiny_clip_text_encoder(len(clip_tokenizer)), tiny_t5_encoder(len(t5_tokenizer))
    vae = tiny_vae(use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611)
    torch.manual_seed(SEED)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=1, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=t5.config.d_model,
        pooled_projection_dim=clip.config.hidden_size, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    return dict(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tokenizer, text_encoder_2=t5,
                tokenizer_2=t5_tokenizer, transformer=transformer)


def build_flux(path):
    """A FLUX.1 [dev] pipeline of `flux_components`."""
    from diffusers import FluxPipeline

    FluxPipeline(**flux_components()).save_pretrained(path)


def build_flux_kontext(path):
    """A FLUX.1 Kontext [dev] pipeline of the same components (Kontext adds no module: its transformer reads the
    reference's tokens after the target's), without the optional IP-Adapter image encoder."""
    from diffusers import FluxKontextPipeline

    FluxKontextPipeline(**flux_components()).save_pretrained(path)


def build_flux_controlnet(path):
    """A FluxControlNetModel made from the tiny transformer's first double-stream and first single-stream blocks,
    as upstream's FLUX.1 ControlNet script makes one (InstantX's layout: the conditioning image's latents, no hint
    block; the guidance embedding)."""
    from diffusers import FluxControlNetModel

    transformer = flux_components()["transformer"]
    FluxControlNetModel.from_transformer(
        transformer, num_layers=1, num_single_layers=1, attention_head_dim=transformer.config.attention_head_dim,
        num_attention_heads=transformer.config.num_attention_heads).save_pretrained(path)


def build_shapes_edit_one_reference(path):
    """The edit dataset (`data.build_shapes_edit`) with at most one reference a row, each row's first: Kontext takes
    one. Rows with none stay so (text-to-image rows)."""
    build_shapes_edit(path)
    metadata = Path(path) / "metadata.jsonl"
    rows = [json.loads(line) for line in metadata.read_text().splitlines()]
    metadata.write_text("".join(json.dumps({**row, "reference_file_names": row["reference_file_names"][:1]}) + "\n"
                                for row in rows))


FIXTURES = {"flux": build_flux, "flux_kontext": build_flux_kontext, "flux_controlnet": build_flux_controlnet,
            "shapes_edit_one_reference": build_shapes_edit_one_reference}
