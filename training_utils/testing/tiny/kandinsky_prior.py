"""Tiny Kandinsky 2.2: the prior pipeline (text to CLIP image embedding) and a decoder that renders its embeddings."""

import torch

from .parts import SEED, tiny_clip_text_encoder, tiny_clip_tokenizer

# The CLIP width that the prior's embeddings, the text and image encoders' projections and the decoder's
# image projection share.
EMBEDDING_DIM = 32
# The image encoder's input size (its processor resizes and crops to it) and patch size.
CLIP_IMAGE_SIZE, CLIP_PATCH_SIZE = 32, 8


def build_kandinsky_prior(path):
    """A ``KandinskyV22PriorPipeline``: PriorTransformer, CLIP text and image encoders with projection, CLIP
    tokenizer and image processor, UnCLIP scheduler, as the real prior's folder lays them out."""
    from diffusers import KandinskyV22PriorPipeline, PriorTransformer, UnCLIPScheduler
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    tokenizer = tiny_clip_tokenizer()
    text_encoder = tiny_clip_text_encoder(len(tokenizer), with_projection=True, hidden_size=EMBEDDING_DIM)
    torch.manual_seed(SEED)
    prior = PriorTransformer(num_attention_heads=2, attention_head_dim=12, embedding_dim=EMBEDDING_DIM, num_layers=1)
    # The released prior's statistics are not the identity: the normalisation is exercised.
    with torch.no_grad():
        prior.clip_mean.copy_(torch.randn(prior.clip_mean.shape) * 0.1)
        prior.clip_std.copy_(torch.rand(prior.clip_std.shape) + 0.5)
    torch.manual_seed(SEED)
    image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=EMBEDDING_DIM, image_size=CLIP_IMAGE_SIZE, projection_dim=EMBEDDING_DIM, intermediate_size=37,
        num_attention_heads=4, num_channels=3, num_hidden_layers=2, patch_size=CLIP_PATCH_SIZE)).eval()
    image_processor = CLIPImageProcessor(
        crop_size=CLIP_IMAGE_SIZE, size=CLIP_IMAGE_SIZE, do_center_crop=True, do_normalize=True, do_resize=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711], resample=3)
    scheduler = UnCLIPScheduler(variance_type="fixed_small_log", prediction_type="sample", num_train_timesteps=1000,
                                clip_sample=True, clip_sample_range=10.0)
    KandinskyV22PriorPipeline(prior=prior, image_encoder=image_encoder, text_encoder=text_encoder,
                              tokenizer=tokenizer, scheduler=scheduler,
                              image_processor=image_processor).save_pretrained(path)


def build_kandinsky_decoder(path):
    """A ``KandinskyV22Pipeline``: a UNet conditioned on the CLIP image embedding, a MoVQ whose latents are an
    eighth of the image's side as the real one's, DDPM scheduler."""
    from diffusers import DDPMScheduler, KandinskyV22Pipeline, UNet2DConditionModel, VQModel

    torch.manual_seed(SEED)
    unet = UNet2DConditionModel(
        in_channels=4, out_channels=8, addition_embed_type="image", down_block_types=(
            "ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn", block_out_channels=(32, 64), layers_per_block=1,
        encoder_hid_dim=EMBEDDING_DIM, encoder_hid_dim_type="image_proj", cross_attention_dim=32,
        attention_head_dim=4, resnet_time_scale_shift="scale_shift", class_embed_type=None, norm_num_groups=8)
    torch.manual_seed(SEED)
    movq = VQModel(block_out_channels=[32, 32, 32, 32], in_channels=3, out_channels=3, latent_channels=4,
                   down_block_types=["DownEncoderBlock2D"] * 3 + ["AttnDownEncoderBlock2D"],
                   up_block_types=["AttnUpDecoderBlock2D"] + ["UpDecoderBlock2D"] * 3, layers_per_block=1,
                   norm_num_groups=8, norm_type="spatial", num_vq_embeddings=12, vq_embed_dim=4)
    scheduler = DDPMScheduler(beta_schedule="linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                              prediction_type="epsilon", variance_type="learned_range", thresholding=False)
    KandinskyV22Pipeline(unet=unet, scheduler=scheduler, movq=movq).save_pretrained(path)


FIXTURES = {"kandinsky_prior": build_kandinsky_prior, "kandinsky_decoder": build_kandinsky_decoder}
