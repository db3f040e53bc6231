"""Tiny CogVideoX: text-to-video in CogVideoX 1.0's layout (rotary embeddings, 2×2 patches) and image-to-video in
CogVideoX 1.5's (1×2×2 patches in time too, the ``ofs`` embedding, ``invert_scale_latents``), a T5 text encoder with
an offline tokenizer, and a CogVideoX VAE of the released ratios (8× in space, 4× in time) with tiny channels; and the
moving-shapes clips in upstream's data layout (a file of prompts, a file of video paths)."""

import csv
from pathlib import Path

import torch

from .parts import SEED, tiny_t5_encoder, tiny_t5_tokenizer

LATENT_CHANNELS = 4


def tiny_cogvideox_vae(seed=SEED, **overrides):
    """Four down blocks (three halve the sides: 8×), two of them halving time too (4×), as the released VAE."""
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(seed)
    return AutoencoderKLCogVideoX(block_out_channels=(8, 8, 8, 8), latent_channels=LATENT_CHANNELS,
                                  layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4,
                                  **overrides).eval()


def tiny_cogvideox_transformer(seed=SEED, in_channels=LATENT_CHANNELS, **overrides):
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    return CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=in_channels,
                                       out_channels=LATENT_CHANNELS, time_embed_dim=4, text_embed_dim=64,
                                       num_layers=2, sample_width=4, sample_height=4, sample_frames=9, patch_size=2,
                                       temporal_compression_ratio=4, max_text_seq_length=226,
                                       use_rotary_positional_embeddings=True, **overrides)


def cogvideox_scheduler():
    """CogVideoX's sampler as released: DDIM on v-prediction, zero terminal SNR, the SNR shifted by 3."""
    from diffusers import CogVideoXDDIMScheduler

    return CogVideoXDDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                  clip_sample=False, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                                  set_alpha_to_one=True, snr_shift_scale=3.0, timestep_spacing="trailing")


def build_cogvideox(path):
    from diffusers import CogVideoXPipeline

    tokenizer = tiny_t5_tokenizer()
    CogVideoXPipeline(tokenizer=tokenizer, text_encoder=tiny_t5_encoder(len(tokenizer)), vae=tiny_cogvideox_vae(),
                      transformer=tiny_cogvideox_transformer(), scheduler=cogvideox_scheduler()).save_pretrained(path)


def build_cogvideox_i2v(path):
    """CogVideoX 1.5 I2V's layout: the transformer reads the noisy latents and the first frame's latents on the
    channels, in patches of two latent frames, with the ``ofs`` embedding."""
    from diffusers import CogVideoXImageToVideoPipeline

    tokenizer = tiny_t5_tokenizer()
    CogVideoXImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=tiny_t5_encoder(len(tokenizer)),
        vae=tiny_cogvideox_vae(invert_scale_latents=True),
        transformer=tiny_cogvideox_transformer(in_channels=2 * LATENT_CHANNELS, patch_size_t=2, ofs_embed_dim=4),
        scheduler=cogvideox_scheduler()).save_pretrained(path)




def build_moving_shapes_lists(path):
    """The moving-shapes clips (`video.CLIPS`) in upstream's CogVideoX layout: ``videos/NN.mp4``, listed one a line
    in ``videos.txt`` (relative to the folder) beside their prompts in ``prompts.txt`` (blank lines between, which
    upstream skips), and the same rows as a dataset, ``train.csv`` (columns ``video`` and ``text``)."""
    from training_utils.data.rendered_video import write_mp4

    from .video import CLIPS, moving_shape

    path = Path(path)
    (path / "videos").mkdir(parents=True, exist_ok=True)
    rows = []
    for index, (shape, color, background, frames) in enumerate(CLIPS):
        name = f"videos/{index:02d}.mp4"
        write_mp4(path / name, moving_shape(shape, color, background, frames, seed=index), fps=8)
        rows.append((name, f"a {color} {shape} on a {background} background"))
    (path / "videos.txt").write_text("\n\n".join(name for name, _ in rows) + "\n")
    (path / "prompts.txt").write_text("\n\n".join(prompt for _, prompt in rows) + "\n")
    with open(path / "train.csv", "w", newline="") as table:
        csv.writer(table).writerows([("video", "text"), *rows])


FIXTURES = {"cogvideox": build_cogvideox, "cogvideox_i2v": build_cogvideox_i2v,
            "moving_shapes_lists": build_moving_shapes_lists}
