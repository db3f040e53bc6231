"""Tiny LTX-2: `LTX2Pipeline` with the released video VAE's geometry (4×4 patches and three halvings: 32× in space,
8× in time), an audio VAE and a vocoder (the pipeline renders audio beside every video), a Gemma 3 text encoder with
an offline Gemma tokenizer and LTX-2.0's text connectors; and clips long enough for its 8-frame VAE steps
(``ltx2_clips``: 17, 12 and 9 frames and a still, at 64×64, two latents a side)."""

import json
import random
from pathlib import Path

import torch

from .data import SEED, draw_shape
from .parts import tiny_gemma_tokenizer
from .video import moving_shape

# Registers replace the padding of every prompt in LTX-2.0's connectors: a prompt's length is a multiple of them.
CONNECTOR_REGISTERS = 8
# (shape, colour, background, frames): the 17-frame bucket, the 9-frame one twice (12 frames train as 9), a still.
CLIPS = [("circle", "red", "white", 17), ("square", "blue", "black", 12), ("triangle", "green", "gray", 9)]
CLIP_SIZE = 64


def tiny_gemma3_text_encoder(tokenizer, hidden_size=16, num_hidden_layers=2, seed=SEED):
    """Gemma 3 (its conditional-generation class, as LTX-2 loads it) with a tiny vision tower the text never
    reaches."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    text_config = {"vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": 32, "head_dim": 8,
                   "num_hidden_layers": num_hidden_layers, "num_attention_heads": 2, "num_key_value_heads": 1,
                   "max_position_embeddings": 256, "sliding_window": 64, "pad_token_id": tokenizer.pad_token_id,
                   "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    vision_config = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "image_size": 16, "patch_size": 8}
    config = Gemma3Config(text_config=text_config, vision_config=vision_config, mm_tokens_per_image=1,
                          attn_implementation="eager")
    return Gemma3ForConditionalGeneration(config).eval()


def tiny_ltx2_video_vae(seed=SEED):
    """The released LTX-2 video VAE's layout (``convert_ltx2_to_diffusers``: 4×4 patches, a spatial, a temporal and
    two spatio-temporal halvings, causal encoder, reflect-padded decoder) with 8 channels throughout."""
    from diffusers import AutoencoderKLLTX2Video

    torch.manual_seed(seed)
    return AutoencoderKLLTX2Video(latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 16, 32),
                                  layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
                                  decoder_causal=False, spatial_compression_ratio=32, temporal_compression_ratio=8)


def tiny_ltx2_audio(seed=SEED):
    """The audio VAE and vocoder of diffusers' LTX-2 pipeline tests."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(seed)
    audio_vae = AutoencoderKLLTX2Audio(base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1,
                                       attn_resolutions=None, in_channels=2, resolution=32, latent_channels=2,
                                       norm_type="pixel", causality_axis="height", dropout=0.0,
                                       mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160,
                                       is_causal=True, mel_bins=8)
    vocoder = LTX2Vocoder(in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins, hidden_channels=32,
                          out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
                          resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
                          output_sampling_rate=16000)
    return audio_vae, vocoder


def ltx2_pipeline():
    """An LTX-2.0-style `LTX2Pipeline` in memory: its transformer reads 8 latent channels and 2×4 audio ones (the
    audio VAE's channels times its 8 mel bins over 4), its connectors' registers take prompts of multiples of 8."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    tokenizer = tiny_gemma_tokenizer()
    text_encoder = tiny_gemma3_text_encoder(tokenizer)
    text_config = text_encoder.config.text_config
    audio_vae, vocoder = tiny_ltx2_audio()
    torch.manual_seed(SEED)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=2, caption_channels=text_config.hidden_size,
        rope_double_precision=False, rope_type="split")
    torch.manual_seed(SEED)
    connectors = LTX2TextConnectors(
        caption_channels=text_config.hidden_size, text_proj_in_factor=text_config.num_hidden_layers + 1,
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=CONNECTOR_REGISTERS, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=CONNECTOR_REGISTERS, connector_rope_base_seq_len=32,
        rope_double_precision=False, rope_type="split")
    # The released scheduler: shifted by the video's length in tokens, ending at 0.1.
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
    return LTX2Pipeline(scheduler=scheduler, vae=tiny_ltx2_video_vae(), audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
                        transformer=transformer, vocoder=vocoder)


def build_ltx2(path):
    ltx2_pipeline().save_pretrained(path)


def build_ltx2_clips(path):
    """Three mp4 clips at 24 frames a second (captions in ``metadata.jsonl``) and a still image, 64×64."""
    from training_utils.data.rendered_video import write_mp4

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metadata.jsonl", "w") as metadata:
        for index, (shape, color, background, frames) in enumerate(CLIPS):
            name = f"{index:02d}.mp4"
            write_mp4(path / name, moving_shape(shape, color, background, frames, size=CLIP_SIZE, seed=index), fps=24)
            metadata.write(json.dumps({"file_name": name, "text": f"a {color} {shape} on a {background} background"})
                           + "\n")
        image, _ = draw_shape("square", "purple", "white", CLIP_SIZE, rng=random.Random(SEED))
        image.save(path / "still.png")
        metadata.write(json.dumps({"file_name": "still.png", "text": "a purple square on a white background"}) + "\n")


FIXTURES = {"ltx2": build_ltx2, "ltx2_clips": build_ltx2_clips}
