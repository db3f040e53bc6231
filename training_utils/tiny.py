"""Tiny offline fixtures: pipelines and datasets small enough to train on a CPU in seconds.

Nothing here touches the network. Every fixture is built from random weights with a fixed seed
and saved with ``save_pretrained``, so the scripts load it exactly as they load a hub model::

    python -m training_utils.tiny --output_dir tiny          # builds every fixture
    python -m training_utils.tiny --output_dir tiny sd shapes

Each fixture is a function ``build_<name>(path)`` registered in ``FIXTURES``; new model families
add theirs beside the SD 1.x ones from the shared building blocks (tokenizer, text encoder, VAE).
"""

import argparse
import json
import random
from pathlib import Path

import torch
from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 170),
    "orange": (240, 130, 20),
}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128)}
SHAPES = ("circle", "square", "triangle")
# Every word a caption or a demo prompt uses gets a whole-word token, so distinct prompts
# tokenize to distinct ids instead of collapsing into unknown tokens.
EXTRA_WORDS = ("a", "an", "on", "of", "the", "background", "photo", "small", "big", "shape", "sks", "dog", "in")

IMAGE_SIZE = 64
# (width, height) of the pictures of mixed shapes: landscape 2:1 and 4:3, portrait 1:2, square, a square smaller
# than the tests' 32-pixel resolution, and 4:1.
MIXED_SIZES = [(64, 32), (32, 64), (48, 48), (64, 48), (24, 24), (96, 24)]
SEED = 0


def _bytes_to_unicode():
    """The byte-to-printable-character table of GPT-2/CLIP byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


def tiny_clip_tokenizer(words=None, model_max_length=77):
    """A real byte-level BPE CLIP tokenizer whose vocabulary holds ``words`` as whole tokens.

    Every byte has a token, so any text tokenizes; the listed words merge into single tokens.
    """
    from transformers import CLIPTokenizer

    words = sorted(set(words if words is not None else _vocabulary()))
    byte_chars = _bytes_to_unicode()
    tokens = list(byte_chars) + [c + "</w>" for c in byte_chars]
    merges = []
    for word in words:
        # Merge left to right: "red" -> "r e", "re d</w>" so each prefix is a vocabulary entry.
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        merged = pieces[0]
        for piece in pieces[1:]:
            rule = (merged, piece)
            if rule not in merges:
                merges.append(rule)
            merged += piece
            if merged not in tokens:
                tokens.append(merged)
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: index for index, token in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def tiny_clip_text_encoder(vocab_size, with_projection=False, hidden_size=32, seed=SEED):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=hidden_size,
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
    )
    model_class = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return model_class(config).eval()


def tiny_t5_tokenizer(words=None):
    """A real T5 (Unigram) tokenizer: whole-word pieces for ``words``, single letters for the rest."""
    from transformers import T5Tokenizer

    words = sorted(set(words if words is not None else _vocabulary()))
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + word, -1.0) for word in words]
    pieces += [(chr(c), -5.0) for c in range(ord("a"), ord("z") + 1)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=256)


def tiny_t5_encoder(vocab_size, d_model=64, seed=SEED):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, decoder_start_token_id=0)
    return T5EncoderModel(config).eval()


# Qwen3's chat format for one user turn, with the empty thinking block its template writes when thinking is off
# (Flux2KleinPipeline wraps each prompt so before encoding it).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def tiny_qwen_tokenizer(words=None):
    """A real byte-level BPE Qwen2 tokenizer (Qwen3's) with Qwen3's special tokens and chat format, whose
    vocabulary holds ``words`` as whole tokens, with and without a leading space.

    Every byte has a token, so any text tokenizes. BPE trained on the words alone learns exactly the merges
    that join each of them into one token (hand-written merges would split words that contain other words).
    """
    from tokenizers import pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    words = sorted(set(words if words is not None else _vocabulary()))
    special_tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    backend = Qwen2Tokenizer().backend_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=4096, show_progress=False, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([form for word in words for form in (word, " " + word)], trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    return Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(merge) for merge in model["merges"]],
                          additional_special_tokens=special_tokens[1:], chat_template=QWEN3_CHAT_TEMPLATE)


def tiny_qwen3_text_encoder(tokenizer, num_hidden_layers=28, hidden_size=16, seed=SEED):
    """A Qwen3 causal LM, FLUX.2 [klein]'s text encoder class. Deep enough for the hidden layers that
    Flux2KleinPipeline reads by default (9, 18 and 27), narrow enough to cost nothing."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=32,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return Qwen3ForCausalLM(config).eval()


def tiny_vae(seed=SEED, **overrides):
    """A VAE that halves the resolution (real SD VAEs divide by 8), with SD's 4 latent channels."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    config = dict(
        block_out_channels=(16, 32),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
    )
    config.update(overrides)
    return AutoencoderKL(**config)


def tiny_unet(cross_attention_dim=32, seed=SEED, **overrides):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    config = dict(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=(2, 4),
        norm_num_groups=8,
    )
    config.update(overrides)
    return UNet2DConditionModel(**config)


def sd_inference_scheduler():
    """The scheduler SD 1.x checkpoints ship (PNDM); it keeps state between steps, like many do."""
    from diffusers import PNDMScheduler

    return PNDMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        skip_prk_steps=True,
        set_alpha_to_one=False,
        steps_offset=1,
    )


def _vocabulary():
    return list(COLORS) + list(BACKGROUNDS) + list(SHAPES) + list(EXTRA_WORDS)


def sd_components():
    """What SD 1.x and SDXL pipelines share: the VAE, a CLIP text encoder and its tokenizer."""
    tokenizer = tiny_clip_tokenizer()
    return {"vae": tiny_vae(), "text_encoder": tiny_clip_text_encoder(len(tokenizer)), "tokenizer": tokenizer}


def build_sd(path):
    """A Stable Diffusion 1.x pipeline: UNet, VAE, CLIP text encoder and tokenizer, PNDM scheduler."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(unet=tiny_unet(), scheduler=sd_inference_scheduler(), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False, **sd_components())
    pipe.save_pretrained(path)


def tiny_sdxl_unet(seed=SEED):
    """An SDXL-style UNet: cross-attention over both encoders' hidden states (32 + 32) and the
    "text_time" addition embedding (pooled text embeds 32 + six size/crop ids of 8 each)."""
    return tiny_unet(
        cross_attention_dim=64, seed=seed, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8, use_linear_projection=True,
        transformer_layers_per_block=(1, 2),
    )


def build_sdxl(path):
    """A Stable Diffusion XL pipeline: two CLIP encoders (the second with projection), Euler scheduler."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    components = sd_components()
    tokenizer = components["tokenizer"]
    pipe = StableDiffusionXLPipeline(
        unet=tiny_sdxl_unet(),
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


def build_sd3(path):
    """A Stable Diffusion 3 pipeline: an MMDiT transformer, two CLIP encoders with projection,
    a T5 encoder with a real T5 tokenizer, and the flow-matching Euler scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    torch.manual_seed(SEED)
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        vae=tiny_vae(use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035),
        text_encoder=tiny_clip_text_encoder(len(clip_tokenizer), with_projection=True),
        text_encoder_2=tiny_clip_text_encoder(len(clip_tokenizer), with_projection=True, seed=SEED + 1),
        text_encoder_3=tiny_t5_encoder(len(t5_tokenizer)),
        tokenizer=clip_tokenizer,
        tokenizer_2=clip_tokenizer,
        tokenizer_3=t5_tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    pipe.save_pretrained(path)


def tiny_flux2_vae(seed=SEED):
    """FLUX.2's VAE, halving the resolution, with 4 latent channels (16 once 2×2-patchified). Its batch-norm
    statistics, which standardise the patchified latents, are set away from the identity, so that a missing or
    misplaced standardisation shows."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
                             layers_per_block=1, sample_size=32)
    with torch.no_grad():
        vae.bn.running_mean.uniform_(-0.5, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def build_flux2_klein(path):
    """A FLUX.2 [klein] pipeline: a FLUX.2 transformer (one double-stream and two single-stream blocks, no
    guidance embedding, as klein's), FLUX.2's VAE, a Qwen3 text encoder whose three default hidden layers make
    the transformer's text features, a real Qwen tokenizer, and FLUX.2's resolution-shifted flow-matching
    scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel

    tokenizer = tiny_qwen_tokenizer()
    text_encoder = tiny_qwen3_text_encoder(tokenizer)
    vae = tiny_flux2_vae()
    torch.manual_seed(SEED)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=1, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=3 * text_encoder.config.hidden_size,
        timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096, time_shift_type="exponential",
    )
    Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                       transformer=transformer, is_distilled=False).save_pretrained(path)


def build_z_image(path):
    """A Z-Image pipeline: a Z-Image transformer (one noise- and one caption-refiner block, two main blocks), a VAE
    with Z-Image's 16 latent channels and its latent shift and scale (FLUX.1's VAE), a Qwen3 model whose
    second-to-last hidden states are the caption features, a real Qwen tokenizer, and Z-Image's flow-matching
    scheduler: a static shift of 3, no resolution-dependent shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    tokenizer = tiny_qwen_tokenizer()
    # ZImagePipeline's text encoder is the bare Qwen3 model, without the language-model head.
    text_encoder = tiny_qwen3_text_encoder(tokenizer, num_hidden_layers=2).model
    vae = tiny_vae(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159)
    torch.manual_seed(SEED)
    transformer = ZImageTransformer2DModel(
        in_channels=vae.config.latent_channels, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
        cap_feat_dim=text_encoder.config.hidden_size, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32],
    )
    with torch.no_grad():  # the padding tokens are created uninitialised (torch.empty)
        transformer.x_pad_token.normal_()
        transformer.cap_pad_token.normal_()
    ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=text_encoder,
                   tokenizer=tokenizer, transformer=transformer).save_pretrained(path)


# The words of QwenImagePipeline's prompt template, whole tokens as in Qwen's own vocabulary: the template's system
# turn then tokenizes to the 34 tokens that the pipeline drops from every prompt's hidden states, as Qwen's does.
QWEN_IMAGE_TEMPLATE_WORDS = ("system", "Describe", "image", "by", "detailing", "color", "shape", "size", "texture",
                             "quantity", "text", "spatial", "relationships", "objects", "and", "user", "assistant")


def tiny_qwen2_5_vl_text_encoder(tokenizer, hidden_size=32, seed=SEED):
    """A Qwen2.5-VL model, Qwen-Image's text encoder class, with a two-layer language model and a one-block vision
    tower (which text prompts never run). Its multimodal rotary sections (time, height, width) share the 8
    frequencies of its 16-wide attention heads."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    text_config = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=37, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                       eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    vision_config = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden_size,
                         patch_size=2, spatial_merge_size=1, temporal_patch_size=1, window_size=4,
                         fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_qwen_image_vae(seed=SEED):
    """Qwen-Image's (video) VAE, halving the resolution, with 4 latent channels. Its per-channel latent mean and
    standard deviation, which standardise the latents, are set away from the identity, so that a missing or
    misplaced standardisation shows."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    z_dim = 4
    return AutoencoderKLQwenImage(base_dim=16, z_dim=z_dim, dim_mult=[1, 2], num_res_blocks=1,
                                  temperal_downsample=[False],
                                  latents_mean=torch.empty(z_dim).uniform_(-0.5, 0.5).tolist(),
                                  latents_std=torch.empty(z_dim).uniform_(0.5, 2.0).tolist())


def build_qwen_image(path):
    """A Qwen-Image pipeline: a Qwen-Image transformer (two blocks, no guidance embedding), Qwen-Image's VAE, a
    Qwen2.5-VL text encoder whose last hidden states are the text features, a real Qwen tokenizer, and Qwen-Image's
    flow-matching scheduler (its configuration: a resolution-dependent shift, stretched to end at 0.02)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    tokenizer = tiny_qwen_tokenizer(_vocabulary() + list(QWEN_IMAGE_TEMPLATE_WORDS))
    text_encoder = tiny_qwen2_5_vl_text_encoder(tokenizer)
    vae = tiny_qwen_image_vae()
    torch.manual_seed(SEED)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * vae.config.z_dim, out_channels=vae.config.z_dim, num_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=text_encoder.config.text_config.hidden_size,
        axes_dims_rope=(4, 6, 6), guidance_embeds=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                      transformer=transformer).save_pretrained(path)


def build_controlnet(path):
    """A ControlNet initialised from the tiny UNet; its conditioning embedding halves the
    resolution, as the tiny VAE does (real ones divide by 8 with four embedding blocks)."""
    from diffusers import ControlNetModel

    ControlNetModel.from_unet(tiny_unet(), conditioning_embedding_out_channels=(16, 32)).save_pretrained(path)


def draw_shape(shape, color, background, size=IMAGE_SIZE, rng=None):
    """One synthetic picture and its mask: a coloured shape at a jittered position on a plain background, a
    ``size`` square or ``size`` (width, height).

    Returns ``(image, mask)``; the mask is white where the shape is, black elsewhere.
    """
    rng = rng or random.Random(SEED)
    width, height = (size, size) if isinstance(size, int) else size
    image = Image.new("RGB", (width, height), BACKGROUNDS[background])
    mask = Image.new("RGB", (width, height), (0, 0, 0))
    extent = rng.randint(min(width, height) // 3, min(width, height) // 2)
    left = rng.randint(2, width - extent - 2)
    top = rng.randint(2, height - extent - 2)
    box = (left, top, left + extent, top + extent)
    for canvas, fill in ((image, COLORS[color]), (mask, (255, 255, 255))):
        draw = ImageDraw.Draw(canvas)
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(left + extent // 2, top), (left, top + extent), (left + extent, top + extent)], fill=fill)
    return image, mask


def build_shapes(path, num_images=36, with_conditioning=False, sizes=(IMAGE_SIZE,)):
    """An imagefolder dataset: ``metadata.jsonl`` with ``file_name`` and ``text`` captions that describe the image.

    ``with_conditioning`` adds a ``conditioning_image`` column (ControlNet layout): the shape's mask. The images
    take the ``sizes`` (see `draw_shape`) in turn.
    """
    path = Path(path)
    (path / "conditioning").mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    combos = [(s, c, b) for s in SHAPES for c in COLORS for b in BACKGROUNDS]
    rng.shuffle(combos)
    with open(path / "metadata.jsonl", "w") as metadata:
        for index in range(num_images):
            shape, color, background = combos[index % len(combos)]
            row = {"file_name": f"{index:04d}.png"}
            image, mask = draw_shape(shape, color, background, sizes[index % len(sizes)], rng=rng)
            image.save(path / row["file_name"])
            if with_conditioning:
                row["conditioning_image_file_name"] = f"conditioning/{index:04d}.png"
                mask.save(path / row["conditioning_image_file_name"])
            row["text"] = f"a {color} {shape} on a {background} background"
            metadata.write(json.dumps(row) + "\n")
    if not with_conditioning:
        (path / "conditioning").rmdir()


def build_shapes_controlnet(path):
    """The shapes dataset with ``image``, ``conditioning_image`` (the shape's mask) and ``text``."""
    build_shapes(path, with_conditioning=True)


def build_shapes_mixed(path):
    """The shapes dataset, with conditioning images, in landscape, portrait, square, small and 4:1 pictures
    (`MIXED_SIZES`), for aspect-ratio buckets."""
    build_shapes(path, num_images=12, with_conditioning=True, sizes=MIXED_SIZES)


def build_instance(path, num_images=6, sizes=(IMAGE_SIZE,)):
    """A DreamBooth instance folder: a few pictures of one subject (a purple triangle), no captions; the images
    take the ``sizes`` (see `draw_shape`) in turn."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED + 1)
    for index in range(num_images):
        image, _ = draw_shape("triangle", "purple", rng.choice(list(BACKGROUNDS)), sizes[index % len(sizes)],
                              rng=rng)
        image.save(path / f"{index:04d}.png")


def build_instance_mixed(path):
    """The DreamBooth instance folder in the `MIXED_SIZES`, for aspect-ratio buckets."""
    build_instance(path, sizes=MIXED_SIZES)


FIXTURES = {
    "sd": build_sd,
    "controlnet": build_controlnet,
    "sdxl": build_sdxl,
    "sdxl_controlnet": build_sdxl_controlnet,
    "sd3": build_sd3,
    "flux2_klein": build_flux2_klein,
    "z_image": build_z_image,
    "qwen_image": build_qwen_image,
    "shapes": build_shapes,
    "shapes_controlnet": build_shapes_controlnet,
    "instance": build_instance,
    "shapes_mixed": build_shapes_mixed,
    "instance_mixed": build_instance_mixed,
}


def build(output_dir, names=None):
    """Build the named fixtures (all by default) under ``output_dir``; returns ``{name: path}``."""
    paths = {}
    for name in names or FIXTURES:
        paths[name] = Path(output_dir) / name
        FIXTURES[name](paths[name])
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="tiny", help="where the fixtures go (default: ./tiny)")
    parser.add_argument("names", nargs="*", help=f"fixtures to build, of {', '.join(FIXTURES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(FIXTURES))
    if unknown:
        parser.error(f"unknown fixture {unknown[0]!r}; expected one of {', '.join(FIXTURES)}")
    for name, path in build(args.output_dir, args.names).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
