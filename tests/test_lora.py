"""Adding LoRA adapters (training_utils.adapters.injection); saving them is tested with training_utils.outputs.export."""

import pytest
import torch
from diffusers import StableDiffusionPipeline
from diffusers.models.attention_processor import Attention

from training_utils.adapters.injection import (ATTENTION_PROJECTIONS, CLIP_ATTENTION_PROJECTIONS, add_lora,
                                               linear_layers_named)
from training_utils.errors import UsageError
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


def test_layers_are_named_by_their_name_endings_and_only_linear_ones_are_taken():
    # FLUX.2's layout: "to_out" is a list (a linear layer and a dropout) in one block, a linear layer in another.
    attention = torch.nn.ModuleDict({"to_q": torch.nn.Linear(2, 2), "to_out": torch.nn.ModuleList(
        [torch.nn.Linear(2, 2), torch.nn.Dropout()])})
    single = torch.nn.ModuleDict({"to_qkv_mlp_proj": torch.nn.Linear(2, 2), "to_out": torch.nn.Linear(2, 2)})
    model = torch.nn.ModuleDict({"joint_block": torch.nn.ModuleDict({"attn": attention}),
                                 "single_block": torch.nn.ModuleDict({"attn": single})})
    assert linear_layers_named(model, ["attn.to_out", "to_out.0", "to_q"]) == [
        "single_block.attn.to_out", "joint_block.attn.to_out.0", "joint_block.attn.to_q"]
    assert linear_layers_named(model, ["single_block.attn.to_qkv_mlp_proj", "to_qkv_mlp_proj"]) == [
        "single_block.attn.to_qkv_mlp_proj"]
    with pytest.raises(UsageError) as error:
        linear_layers_named(model, ["to_q", "to_nowhere"])
    assert str(error.value) == ("--lora_layers='to_nowhere': expected the name, or the end of the name, of one of the "
                                "model's linear layers")
