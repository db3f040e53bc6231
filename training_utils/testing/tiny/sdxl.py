"""Tiny Stable Diffusion XL: the pipeline, a ControlNet made from its UNet, and for the T2I-Adapter a pipeline whose
UNet's blocks come in SDXL's own order, with a tiny adapter for it."""

from .parts import SEED, sd_components, tiny_clip_text_encoder, tiny_unet


def tiny_sdxl_unet(seed=SEED, **overrides):
    """An SDXL-style UNet: cross-attention over both encoders' hidden states (32 + 32) and the
    "text_time" addition embedding (pooled text embeds 32 + six size/crop ids of 8 each)."""
    return tiny_unet(
        cross_attention_dim=64, seed=seed, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8, use_linear_projection=True,
        transformer_layers_per_block=(1, 2), **overrides,
    )


def build_sdxl(path, unet=None):
    """A Stable Diffusion XL pipeline: two CLIP encoders (the second with projection), Euler scheduler; ``unet``
    replaces `tiny_sdxl_unet`."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    components = sd_components()
    tokenizer = components["tokenizer"]
    pipe = StableDiffusionXLPipeline(
        unet=unet or tiny_sdxl_unet(),
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


def build_sdxl_adapter_base(path):
    """The tiny SDXL pipeline with its UNet's blocks in SDXL's order: a block without attention first (SDXL's
    ``DownBlock2D``), then one with (``CrossAttnDownBlock2D``), as upstream's tiny SDXL has them. The XL adapter adds
    its first two features after those two blocks, at the same size, which the other tiny SDXL's order (attention
    first, the last block half the size) cannot take."""
    build_sdxl(path, unet=tiny_sdxl_unet(down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                         up_block_types=("CrossAttnUpBlock2D", "UpBlock2D")))


def build_sdxl_t2i_adapter(path):
    """A T2I-Adapter for `build_sdxl_adapter_base`'s UNet (SDXL's ``full_adapter_xl``): a feature for each of its
    two blocks (32 and 64 channels), its pixels unshuffled by 4, twice the tiny VAE's 2, as the real one's 16 is
    twice SDXL's VAE's 8."""
    import torch
    from diffusers import T2IAdapter

    torch.manual_seed(SEED)
    T2IAdapter(in_channels=3, channels=(32, 64), num_res_blocks=2, downscale_factor=4,
               adapter_type="full_adapter_xl").save_pretrained(path)


FIXTURES = {"sdxl": build_sdxl, "sdxl_controlnet": build_sdxl_controlnet, "sdxl_adapter_base": build_sdxl_adapter_base,
            "sdxl_t2i_adapter": build_sdxl_t2i_adapter}
