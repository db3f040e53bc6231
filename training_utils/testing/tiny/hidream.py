"""Tiny HiDream-I1: a sparse (mixture-of-experts) HiDream transformer, two long CLIP encoders, T5 and Llama."""

import torch

from .parts import (SEED, tiny_clip_text_encoder, tiny_clip_tokenizer, tiny_llama3_tokenizer, tiny_llama_text_encoder,
                    tiny_t5_encoder, tiny_t5_tokenizer, tiny_vae)

# HiDream's CLIP encoders are Long-CLIP's, of 248 positions (HiDreamImagePipeline tokenizes up to 218 tokens).
LONG_CLIP_POSITIONS = 248


def build_hidream(path):
    """A HiDream-I1 pipeline: a HiDream transformer (one double- and one single-stream block, each with a mixture of
    four routed experts, two active, beside a shared one), reading both hidden layers of a two-layer Llama and T5's
    output, two CLIP encoders with projection (their pooled outputs joined) and 248 positions, real offline CLIP, T5
    and Llama 3 tokenizers, a VAE with FLUX.1's latent shift and scale, and the flow-prediction UniPC scheduler with
    HiDream-I1 [full]'s shift of 3. The Llama and its tokenizer are saved as components (``text_encoder_4``,
    ``tokenizer_4``), which the scripts load through their own flags, as upstream's do."""
    from diffusers import HiDreamImagePipeline, HiDreamImageTransformer2DModel, UniPCMultistepScheduler

    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(model_max_length=LONG_CLIP_POSITIONS), tiny_t5_tokenizer()
    llama_tokenizer = tiny_llama3_tokenizer()
    clip = [tiny_clip_text_encoder(len(clip_tokenizer), with_projection=True, seed=SEED + index,
                                   max_position_embeddings=LONG_CLIP_POSITIONS) for index in range(2)]
    t5, llama = tiny_t5_encoder(len(t5_tokenizer)), tiny_llama_text_encoder(llama_tokenizer)
    torch.manual_seed(SEED)
    transformer = HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_channels=[t5.config.d_model, llama.config.hidden_size],
        text_emb_dim=sum(encoder.config.projection_dim for encoder in clip), num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(32, 32), llama_layers=(0, 1))
    scheduler = UniPCMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    HiDreamImagePipeline(
        scheduler=scheduler, vae=tiny_vae(scaling_factor=0.3611, shift_factor=0.1159), text_encoder=clip[0],
        tokenizer=clip_tokenizer, text_encoder_2=clip[1], tokenizer_2=clip_tokenizer, text_encoder_3=t5,
        tokenizer_3=t5_tokenizer, text_encoder_4=llama, tokenizer_4=llama_tokenizer, transformer=transformer,
    ).save_pretrained(path)


FIXTURES = {"hidream": build_hidream}
