"""Tiny Stable Diffusion XL: the pipeline, and a ControlNet made from its UNet."""

from .parts import SEED, sd_components, tiny_clip_text_encoder, tiny_unet


def tiny_sdxl_unet(seed=SEED):
    """An SDXL-style UNet: cross-attention over both encoders' hidden states (32 + 32) and the
    "text_time" addition embedding (pooled text embeds 32 + six size/crop ids of 8 each)."""
    return tiny_unet(
        cross_attention_dim=64, seed=seed, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8, use_linear_projection=True,
        transformer_layers_per_block=(1, 2),
    )


def build_sdxl(path):
    """A Stable Diffusion XL pipeline: two CLIP encoders (the second with projection), Euler scheduler."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    components = sd_components()
    tokenizer = components["tokenizer"]
    pipe = StableDiffusionXLPipeline(
        unet=tiny_sdxl_unet(),
        text_encoder_2=tiny_clip_text_encoder(len(tokenizer), with_projection=True, seed=SEED + 1),
        tokenizer_2=tokenizer,
        scheduler=EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                         timestep_spacing="leading", steps_offset=1),
        **components,
    )
    pipe.save_pretrained(path)


def build_sdxl_controlnet(path):
    """A ControlNet initialised from the tiny SDXL UNet (text_time embedding included)."""
    from diffusers import ControlNetModel

    ControlNetModel.from_unet(tiny_sdxl_unet(), conditioning_embedding_out_channels=(16, 32)).save_pretrained(path)


FIXTURES = {"sdxl": build_sdxl, "sdxl_controlnet": build_sdxl_controlnet}
