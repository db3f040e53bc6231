"""A tiny aMUSEd: upstream's dummy test components (a 1-layer ``UVit2DModel`` over an 8-entry codebook, its mask token
the last of 32 ids, a ``CLIPTextModelWithProjection``) in the real pipeline's folder layout, with a ``VQModel`` of five
resolutions, aMUSEd's 16x compression (its 256 px model: 16 x 16 tokens)."""

from .parts import tiny_clip_text_encoder, tiny_clip_tokenizer

TINY_UVIT = {"hidden_size": 8, "use_bias": False, "cond_embed_dim": 8, "micro_cond_encode_dim": 2,
             "micro_cond_embed_dim": 10, "encoder_hidden_size": 8, "vocab_size": 32, "codebook_size": 8,
             "in_channels": 8, "block_out_channels": 8, "num_res_blocks": 1, "downsample": True, "upsample": True,
             "block_num_heads": 1, "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 8}
TINY_VQ = {"act_fn": "silu", "block_out_channels": [8] * 5, "down_block_types": ["DownEncoderBlock2D"] * 5,
           "up_block_types": ["UpDecoderBlock2D"] * 5, "in_channels": 3, "out_channels": 3, "latent_channels": 8,
           "layers_per_block": 1, "norm_num_groups": 8, "num_vq_embeddings": 8, "sample_size": 64,
           "mid_block_add_attention": False, "lookup_from_codebook": True}


def build_amused(path):
    """An ``AmusedPipeline`` of the tiny components (random weights, seed 0); 64 px renders 4 x 4 tokens."""
    import torch
    from diffusers import AmusedPipeline, AmusedScheduler, UVit2DModel, VQModel

    tokenizer = tiny_clip_tokenizer()
    torch.manual_seed(0)
    transformer = UVit2DModel(**TINY_UVIT, sample_size=4)
    torch.manual_seed(0)
    vqvae = VQModel(**TINY_VQ)
    text_encoder = tiny_clip_text_encoder(len(tokenizer), with_projection=True, hidden_size=8)
    pipe = AmusedPipeline(vqvae=vqvae, tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer,
                          scheduler=AmusedScheduler(mask_token_id=TINY_UVIT["vocab_size"] - 1))
    pipe.save_pretrained(path)


FIXTURES = {"amused": build_amused}
