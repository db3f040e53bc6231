"""Tiny Kandinsky 2.2: the decoder pipeline (``KandinskyV22Pipeline``: an image-conditioned UNet, a MoVQ and a DDPM
scheduler, as ``kandinsky-community/kandinsky-2-2-decoder``) and the prior pipeline (``KandinskyV22PriorPipeline``: a
``PriorTransformer``, the CLIP text and image encoders with projection, the tokenizer, the ``UnCLIPScheduler`` and a
``CLIPImageProcessor``, as ``kandinsky-community/kandinsky-2-2-prior``), from the dummy components of diffusers'
``tests/pipelines/kandinsky2_2``. The MoVQ divides the resolution by 8, as the real one does (``2 ** (4 - 1)``); the
CLIP image embedding (32 wide) is the decoder's conditioning. The image processor is the plain (PIL/numpy) class, so
it loads without torchvision.
"""

import torch

from .data import SEED
from .parts import tiny_clip_text_encoder, tiny_clip_tokenizer

EMBEDDING_DIM = 32  # the CLIP image embedding: the prior's output, the decoder's conditioning


def tiny_movq(seed=SEED):
    """A MoVQ (``VQModel`` with spatial norms) of four blocks: the real one's 8x downsampling, 4 latent channels
    (32 channels: its spatial norms take 32 groups)."""
    from diffusers import VQModel

    torch.manual_seed(seed)
    return VQModel(block_out_channels=[32] * 4, down_block_types=["DownEncoderBlock2D"] * 3
                   + ["AttnDownEncoderBlock2D"], up_block_types=["AttnUpDecoderBlock2D"] + ["UpDecoderBlock2D"] * 3,
                   in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=8,
                   norm_type="spatial", num_vq_embeddings=12, vq_embed_dim=4)


def tiny_decoder_unet(seed=SEED):
    """The decoder UNet: image embeddings projected to cross-attention tokens and added to the time embedding, the
    learned variance as the output's second half (8 channels out of 4 in), as the real one."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        in_channels=4, out_channels=8, addition_embed_type="image", encoder_hid_dim=EMBEDDING_DIM,
        encoder_hid_dim_type="image_proj", cross_attention_dim=32, attention_head_dim=4,
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn", block_out_channels=(16, 32), layers_per_block=1,
        norm_num_groups=8, resnet_time_scale_shift="scale_shift", class_embed_type=None)


def build_kandinsky22_decoder(path):
    """``KandinskyV22Pipeline``: the tiny UNet and MoVQ, and the real checkpoint's DDPM scheduler settings."""
    from diffusers import DDPMScheduler, KandinskyV22Pipeline

    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=0.00085, beta_end=0.012,
                              clip_sample=False, variance_type="learned_range", prediction_type="epsilon",
                              thresholding=False, steps_offset=1)
    KandinskyV22Pipeline(unet=tiny_decoder_unet(), scheduler=scheduler, movq=tiny_movq()).save_pretrained(path)


def build_kandinsky22_prior(path):
    """``KandinskyV22PriorPipeline``: the tiny prior, CLIP text and image encoders (with projection, 32 wide),
    tokenizer, ``UnCLIPScheduler`` and ``CLIPImageProcessor`` (224 px, CLIP's normalisation)."""
    from diffusers import KandinskyV22PriorPipeline, PriorTransformer, UnCLIPScheduler
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    tokenizer = tiny_clip_tokenizer()
    text_encoder = tiny_clip_text_encoder(len(tokenizer), with_projection=True, hidden_size=EMBEDDING_DIM)
    torch.manual_seed(SEED)
    prior = PriorTransformer(num_attention_heads=2, attention_head_dim=12, embedding_dim=EMBEDDING_DIM, num_layers=1)
    prior.clip_std = torch.nn.Parameter(torch.ones(prior.clip_std.shape))
    torch.manual_seed(SEED)
    image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=EMBEDDING_DIM, projection_dim=EMBEDDING_DIM, image_size=224, patch_size=14, intermediate_size=37,
        num_attention_heads=4, num_hidden_layers=2, num_channels=3)).eval()
    image_processor = CLIPImageProcessor(crop_size=224, size=224, do_center_crop=True, do_normalize=True,
                                         do_resize=True, resample=3, image_mean=[0.48145466, 0.4578275, 0.40821073],
                                         image_std=[0.26862954, 0.26130258, 0.27577711])
    scheduler = UnCLIPScheduler(variance_type="fixed_small_log", prediction_type="sample", num_train_timesteps=1000,
                                clip_sample=True, clip_sample_range=10.0)
    KandinskyV22PriorPipeline(prior=prior, image_encoder=image_encoder, text_encoder=text_encoder,
                              tokenizer=tokenizer, scheduler=scheduler,
                              image_processor=image_processor).save_pretrained(path)


FIXTURES = {"kandinsky22_decoder": build_kandinsky22_decoder, "kandinsky22_prior": build_kandinsky22_prior}
