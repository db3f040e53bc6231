"""Tiny Qwen-Image-Edit: tiny Qwen-Image (`qwen_image`) with the edit pipelines' processor, whose text encoder sees
the reference images through its vision tower."""

import json
import re
from pathlib import Path

import torch

from .parts import SEED, tiny_qwen_tokenizer, vocabulary
from .qwen_image import tiny_qwen2_5_vl_text_encoder, tiny_qwen_image_vae

# The edit template's system turn in whole tokens as in Qwen's vocabulary (" (", "),", "'s" among them): it then
# tokenizes to the 64 tokens that the pipelines drop from every prompt's hidden states, as Qwen's does.
EDIT_TEMPLATE_WORDS = ("system", "user", "assistant", "Describe", "the", "key", "features", "of", "input", "image",
                       "(", "color", "shape", "size", "texture", "objects", "background", "),", "then", "explain",
                       "how", "'s", "text", "instruction", "should", "alter", "or", "modify", "Generate", "a", "new",
                       "that", "meets", "requirements", "while", "maintaining", "consistency", "with", "original",
                       "where", "appropriate", "Picture")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# The text encoder's vision tower reads patches of 2×2 pixels, one token each; the processor shrinks each reference
# to at most 8×8 pixels for it (Qwen's allows about 3500×3500), so that a reference costs 16 tokens.
PATCH_SIZE, MAX_PIXELS = 2, 8 * 8


def tiny_edit_processor():
    """The edit pipelines' processor: a real Qwen tokenizer with Qwen's vision tokens, and Qwen2-VL's image
    processor (the PIL one: no torchvision) in the text encoder's patches."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from training_utils.families.qwen_image_edit import QwenVLImageProcessor

    tokenizer = tiny_qwen_tokenizer(vocabulary() + list(EDIT_TEMPLATE_WORDS))
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    image_processor = Qwen2VLImageProcessorPil(patch_size=PATCH_SIZE, merge_size=1, temporal_patch_size=1,
                                               min_pixels=PATCH_SIZE ** 2, max_pixels=MAX_PIXELS)
    return QwenVLImageProcessor(image_processor=image_processor, tokenizer=tokenizer)


def build_qwen_image_edit_pipeline(path, pipeline_class_name):
    """A Qwen-Image-Edit pipeline of the named class: a Qwen-Image transformer (two blocks, no guidance embedding),
    Qwen-Image's VAE, a Qwen2.5-VL text encoder with its vision tower, its processor and tokenizer, and Qwen-Image's
    flow-matching scheduler. Saved as the released pipelines are: its processor named ``Qwen2VLProcessor``."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    processor = tiny_edit_processor()
    tokenizer = processor.tokenizer
    token_ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(f"<|{name}|>")
                 for name in ("vision_start", "vision_end", "image_pad", "video_pad")}
    text_encoder = tiny_qwen2_5_vl_text_encoder(
        tokenizer, image_token_id=token_ids.pop("image_pad_token_id"),
        video_token_id=token_ids.pop("video_pad_token_id"), **token_ids)
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
    getattr(diffusers, pipeline_class_name)(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                                            tokenizer=tokenizer, processor=processor,
                                            transformer=transformer).save_pretrained(path)
    _name_the_processor_as_released(Path(path))


def _name_the_processor_as_released(path):
    index = json.loads((path / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    config_file = path / "processor" / "processor_config.json"
    config_file.write_text(re.sub(r'"processor_class": "\w+"', '"processor_class": "Qwen2VLProcessor"',
                                  config_file.read_text()))


def build_qwen_image_edit_plus(path):
    """Qwen-Image-Edit-2509/2511's pipeline, `QwenImageEditPlusPipeline` (one to three references)."""
    build_qwen_image_edit_pipeline(path, "QwenImageEditPlusPipeline")


def build_qwen_image_edit(path):
    """The first Qwen-Image-Edit's pipeline, `QwenImageEditPipeline` (one reference)."""
    build_qwen_image_edit_pipeline(path, "QwenImageEditPipeline")


FIXTURES = {"qwen_image_edit_plus": build_qwen_image_edit_plus, "qwen_image_edit": build_qwen_image_edit}
