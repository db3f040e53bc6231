"""Adding LoRA adapters (training_utils.lora); saving them is tested with training_utils.export."""

import torch
from diffusers import StableDiffusionPipeline
from diffusers.models.attention_processor import Attention

from training_utils.lora import ATTENTION_PROJECTIONS, CLIP_ATTENTION_PROJECTIONS, add_lora
from training_utils.pipeline import trainable_parameters


def fresh_pipe(tiny):
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_add_lora_trains_only_adapter_tensors(tiny):
    pipe = fresh_pipe(tiny)
    config = add_lora(pipe.unet, 4, ATTENTION_PROJECTIONS, alpha=8, dropout=0.1)
    add_lora(pipe.text_encoder, 2, CLIP_ATTENTION_PROJECTIONS)
    trained = trainable_parameters({"unet": pipe.unet, "text_encoder": pipe.text_encoder})
    assert trained and all("lora_A" in name or "lora_B" in name for name in trained)
    assert any(name.startswith("text_encoder.") for name in trained)
    assert config.r == 4 and config.lora_alpha == 8 and config.lora_dropout == 0.1
    assert not pipe.unet.conv_in.weight.requires_grad
    # Freshly added adapters leave the model's output unchanged (lora_B starts at zero).
    assert all(torch.count_nonzero(p) == 0 for name, p in trained.items() if "lora_B" in name)


def test_the_target_modules_are_the_attention_projections_of_the_unet_and_of_clip(tiny):
    pipe = fresh_pipe(tiny)
    attention = [module for module in pipe.unet.modules() if isinstance(module, Attention)]
    assert attention and all(isinstance(module.get_submodule(projection), torch.nn.Linear)
                             for module in attention for projection in ATTENTION_PROJECTIONS)
    clip_attention = [module for name, module in pipe.text_encoder.named_modules() if name.endswith("self_attn")]
    assert clip_attention and all(isinstance(module.get_submodule(projection), torch.nn.Linear)
                                  for module in clip_attention for projection in CLIP_ATTENTION_PROJECTIONS)
