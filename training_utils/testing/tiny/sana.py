"""Tiny SANA: a SANA transformer, a DC-AE and a Gemma 2 text encoder."""

import inspect

import torch

from .parts import SEED, tiny_gemma2_text_encoder, tiny_gemma_tokenizer


def build_sana(path):
    """A SANA pipeline: a one-block SANA transformer, a DC-AE of six one-block stages (dividing the size by 32, as
    SANA's does), a Gemma 2 model and a real Gemma tokenizer that holds the words of the pipeline's complex human
    instruction, and SANA's sampler: a DPM-Solver on flow sigmas shifted by 3."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

    instruction = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default
    tokenizer = tiny_gemma_tokenizer(texts=instruction)
    text_encoder = tiny_gemma2_text_encoder(tokenizer)
    torch.manual_seed(SEED)
    transformer = SanaTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2, attention_head_dim=4,
        num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8,
        caption_channels=text_encoder.config.hidden_size, sample_size=16)
    torch.manual_seed(SEED)
    # SANA's DC-AE divides the size by 32 (as the pipeline's sizes, multiples of 32, need): six stages.
    stages = 6
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock",) * stages,
        decoder_block_types=("ResBlock",) * stages, encoder_block_out_channels=(8,) * stages,
        decoder_block_out_channels=(8,) * stages, encoder_qkv_multiscales=((),) * stages,
        decoder_qkv_multiscales=((),) * stages, encoder_layers_per_block=(1,) * stages,
        decoder_layers_per_block=(1,) * stages, downsample_block_type="conv", upsample_block_type="interpolate",
        decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407)
    scheduler = DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                 scheduler=scheduler).save_pretrained(path)


FIXTURES = {"sana": build_sana}
