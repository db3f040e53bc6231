"""What aMUSEd trains on, as upstream's ``train_amused.py`` does it: images as VQ-GAN codebook ids, a cosine schedule
of how many of them are masked (`masking_rate`, `mask_tokens`), the cross-entropy on the masked ids (`token_loss`),
the CLIP text encoder's penultimate hidden states and projected embedding (`encode_prompt`), and the micro-conditioning
of each picture's original size and crop (`process_image`)."""

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers.loaders import AmusedLoraLoaderMixin

from .data.images import IMAGE_EXTENSIONS

IGNORED = -100  # the label of an unmasked token: no loss on it
AESTHETIC_SCORE = 6.0  # the micro-conditioning's aesthetic score, in training as the pipeline's default
# The transformer's parameters that train without weight decay, by a part of their names, as upstream's.
NO_WEIGHT_DECAY = ("bias", "layer_norm.weight", "mlm_ln.weight", "embeddings.weight")


def mask_token_id(transformer):
    """The id of the masked token: the transformer's last (``AmusedScheduler``'s ``mask_token_id``)."""
    return transformer.config.vocab_size - 1


def masking_rate(timesteps, min_masking_rate=0.0):
    """The fraction of tokens masked at ``timesteps`` in [0, 1): ``cos(t pi / 2)``, at least ``min_masking_rate``."""
    return torch.cos(timesteps * math.pi * 0.5).clip(min_masking_rate)


def mask_tokens(tokens, mask_id, min_masking_rate=0.0):
    """Mask a random `masking_rate` of each row of ``tokens`` (B, L) (at least one token, from the global generator):
    ``(input_ids, labels, rate)``, the inputs with ``mask_id`` where masked, the labels the original ids there and
    `IGNORED` elsewhere."""
    batch, length = tokens.shape
    rate = masking_rate(torch.rand(batch, device=tokens.device), min_masking_rate)
    count = (length * rate).round().clamp(min=1)
    masked = torch.rand(batch, length, device=tokens.device).argsort(dim=-1) < count.unsqueeze(-1)
    return torch.where(masked, mask_id, tokens), torch.where(masked, tokens, IGNORED), rate


def token_loss(logits, labels):
    """The mean cross-entropy of ``logits`` (B, codebook, H, W) against ``labels`` (B, H * W), masked tokens only."""
    codebook = logits.shape[1]
    return F.cross_entropy(logits.reshape(logits.shape[0], codebook, -1).permute(0, 2, 1).reshape(-1, codebook),
                           labels.reshape(-1), ignore_index=IGNORED)


@torch.no_grad()
def image_tokens(vqvae, pixels, split=None):
    """The VQ-GAN's codebook ids of ``pixels`` (B, 3, H, W) in [0, 1], one row of ids per image; encoded ``split``
    images at a time (upstream's ``--split_vae_encode``)."""
    chunks = pixels.split(split or pixels.shape[0])
    return torch.cat([vqvae.quantize(vqvae.encode(chunk).latents)[2][2].reshape(chunk.shape[0], -1)
                      for chunk in chunks])


def encode_prompt(text_encoder, tokenizer, prompts, device):
    """``(encoder_hidden_states, pooled)``: the CLIP text encoder's penultimate hidden states and its projected
    embedding of ``prompts``, padded to the tokenizer's length, as ``AmusedPipeline`` encodes them."""
    input_ids = tokenizer(prompts, padding="max_length", truncation=True, max_length=tokenizer.model_max_length,
                          return_tensors="pt").input_ids.to(device)
    outputs = text_encoder(input_ids, return_dict=True, output_hidden_states=True)
    return outputs.hidden_states[-2], outputs.text_embeds


def process_image(image, size, generator):
    """``(pixels, micro_conds)``: ``image`` upright and RGB, its shorter side resized to ``size`` (bilinear), a random
    ``size`` square cropped from it (``generator``), in [0, 1]; and the micro-conditioning ``[original width, original
    height, crop top, crop left, aesthetic score]``."""
    import numpy as np
    from PIL import Image
    from PIL.ImageOps import exif_transpose

    image = exif_transpose(image).convert("RGB")
    width, height = image.size
    scale = size / min(width, height)  # the shorter side to size, the longer one truncated (torchvision's Resize)
    image = image.resize((size if width <= height else int(width * scale),
                          size if height <= width else int(height * scale)), Image.BILINEAR)
    top = int(torch.randint(image.height - size + 1, (1,), generator=generator))
    left = int(torch.randint(image.width - size + 1, (1,), generator=generator))
    crop = np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.float32) / 255
    pixels = torch.from_numpy(crop).permute(2, 0, 1).contiguous()
    return pixels, torch.tensor([width, height, top, left, AESTHETIC_SCORE])


def instance_examples(args):
    """Upstream's ``--instance_data_dir`` (each image file captioned with its file name's stem) or ``--instance_data_image``
    (one image, ``--train_batch_size`` times, captioned likewise) as ``[{"image": path, "prompt": str}]``."""
    if args.instance_data_image is not None:
        path = Path(args.instance_data_image)
        return [{"image": str(path), "prompt": path.stem}] * args.train_batch_size
    return [{"image": str(path), "prompt": path.stem} for path in sorted(Path(args.instance_data_dir).iterdir())
            if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS]



class AmusedLoraWriter(AmusedLoraLoaderMixin):
    """``AmusedLoraLoaderMixin.save_lora_weights`` that also writes each component's adapter config into the file's
    metadata (upstream's drops it, and with it ``--lora_alpha``): ``transformer.load_lora_adapter`` then loads the
    adapter at the scale it trained at."""

    @classmethod
    def save_lora_weights(cls, save_directory, transformer_lora_layers=None, text_encoder_lora_layers=None,
                          transformer_lora_adapter_metadata=None, text_encoder_lora_adapter_metadata=None, **kwargs):
        layers = {name: tensors for name, tensors in (("transformer", transformer_lora_layers),
                                                      ("text_encoder", text_encoder_lora_layers)) if tensors}
        metadata = {"transformer": transformer_lora_adapter_metadata,
                    "text_encoder": text_encoder_lora_adapter_metadata}
        cls._save_lora_weights(save_directory, layers, {name: metadata[name] for name in layers}, **kwargs)
