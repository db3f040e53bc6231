"""A wider SD 1.x pipeline than the tiny test fixture, for a CPU figure closer to real workloads.

Same VAE, text encoder and tokenizer as ``training_utils.testing.tiny``; the UNet has SD's two-layer blocks
and four times the channels (about 17M parameters instead of 0.4M).
"""

from pathlib import Path

from training_utils.testing.tiny import build
from training_utils.testing.tiny import parts as tiny


def build_wide_sd(path):
    from diffusers import StableDiffusionPipeline

    tokenizer = tiny.tiny_clip_tokenizer()
    StableDiffusionPipeline(
        unet=tiny.tiny_unet(block_out_channels=(128, 256), layers_per_block=2, attention_head_dim=(8, 8),
                            norm_num_groups=32),
        vae=tiny.tiny_vae(),
        text_encoder=tiny.tiny_clip_text_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        scheduler=tiny.sd_inference_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    ).save_pretrained(path)


def model_path(name, fixtures_dir, tiny_fixture="sd"):
    """The pipeline folder for ``name``, built under ``fixtures_dir`` if missing: "tiny" is the
    ``tiny_fixture`` of `training_utils.testing.tiny` (the script's own model family), "wide" the wider SD 1.x
    pipeline; any other ``name`` is a path, returned as it is."""
    if name == "tiny":
        path = Path(fixtures_dir) / tiny_fixture
        if not (path / "model_index.json").exists():
            build(fixtures_dir, [tiny_fixture])
        return str(path)
    if name == "wide":
        path = Path(fixtures_dir) / "sd-wide"
        if not (path / "model_index.json").exists():
            build_wide_sd(path)
        return str(path)
    return name
