"""Unit tests of `training_utils.custom_diffusion`: which projections train, the start token's detached keys and
values, and the files' round trip (written, read back for a resume, rebuilt from the description)."""

import pytest
import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import load_file

from helpers import import_script, usage_error
from training_utils.custom_diffusion import WEIGHTS_NAME, CustomDiffusionExport, train_cross_attention
from training_utils.pipeline import trainable_parameters
from training_utils.posthoc_ema.synthesis import export_from_description

TOKEN = "<new1>"
EMBEDDING = "text_encoder.text_model.embeddings.token_embedding.new_rows"


@pytest.fixture
def unet(tiny):
    return UNet2DConditionModel.from_pretrained(tiny["sd"], subfolder="unet")


@pytest.mark.parametrize("freeze_model, projections", [("crossattn_kv", {"to_k", "to_v"}),
                                                       ("crossattn", {"to_q", "to_k", "to_v", "to_out.0"})])
def test_only_the_cross_attention_projections_train(unet, freeze_model, projections):
    train_cross_attention(unet, freeze_model)
    names = {name for name, parameter in unet.named_parameters() if parameter.requires_grad}
    expected = {f"{attention}.{projection}.{kind}" for attention, module in unet.named_modules()
                if attention.endswith(".attn2") for projection in projections
                for kind, _ in module.get_submodule(projection).named_parameters()}
    assert names == expected and any(name.endswith("to_out.0.bias") for name in names) == (freeze_model == "crossattn")


def test_the_start_token_gets_no_gradient_through_the_keys_and_values(unet):
    train_cross_attention(unet, "crossattn_kv")
    attention = next(module for name, module in unet.named_modules() if name.endswith(".attn2"))
    text = torch.randn(1, 3, attention.to_k.in_features)
    before = torch.nn.functional.linear(text, attention.to_k.weight)
    key = attention.to_k(text)
    assert torch.equal(key, before)
    key[:, 0].sum().backward()
    assert torch.equal(attention.to_k.weight.grad, torch.zeros_like(attention.to_k.weight))
    key = attention.to_k(text)
    key[:, 1].sum().backward()
    assert attention.to_k.weight.grad.abs().sum() > 0


def test_the_files_round_trip_and_the_description_rebuilds_the_export(unet, tmp_path):
    train_cross_attention(unet, "crossattn")
    tensors = {name: torch.randn_like(parameter) for name, parameter in trainable_parameters({"unet": unet}).items()}
    tensors[EMBEDDING] = torch.randn(1, 32)
    export = CustomDiffusionExport(unet.attn_processors, TOKEN, EMBEDDING)
    rebuilt = export_from_description(export.description())
    assert isinstance(rebuilt, CustomDiffusionExport) and rebuilt.description() == export.description()
    rebuilt.write(tensors, tmp_path)
    read = export.read_checkpoint(tmp_path)
    assert read.keys() == tensors.keys() and all(torch.equal(read[name], tensors[name]) for name in tensors)
    weights = load_file(tmp_path / WEIGHTS_NAME)
    assert {name for name, tensor in weights.items() if tensor.numel() == 0} == {
        name for name in unet.attn_processors if ".attn1." in name}
    assert torch.equal(load_file(tmp_path / f"{TOKEN}.safetensors")[TOKEN], tensors[EMBEDDING])


def test_a_tensor_that_is_no_cross_attention_projection_is_refused(unet, tmp_path):
    export = CustomDiffusionExport(unet.attn_processors)
    with pytest.raises(ValueError, match="conv_in.weight is not a cross-attention projection"):
        export.write({"unet.conv_in.weight": unet.conv_in.weight}, tmp_path)


SCRIPT = "custom_diffusion/train_custom_diffusion.py"


@pytest.mark.parametrize("flags, line", [
    (["--real_prior"], "error: --real_prior is not supported here: it retrieves real class images from LAION"),
    (["--concepts_list", "concepts.json"], "error: --concepts_list is not supported here: one concept per run"),
    (["--no_safe_serialization"], "error: --no_safe_serialization is not supported here"),
    (["--modifier_token", "<new1>+<new2>"], "error: --modifier_token='<new1>+<new2>': expected one token"),
    (["--modifier_token", "<new1>", "--initializer_token", "ktn+pll"], "error: --initializer_token='ktn': "
                                                                       "expected one token of tokenizer, not 3"),
    (["--modifier_token", "a"], "error: --modifier_token='a': expected a token that tokenizer does not have"),
])
def test_upstream_flags_not_carried_and_bad_tokens_stop_in_one_line(tiny, tmp_path, flags, line):
    error = usage_error(SCRIPT, "--pretrained_model_name_or_path", tiny["sd"], "--instance_data_dir", tiny["instance"],
                        "--instance_prompt", "a photo of <new1> dog", "--output_dir", tmp_path, *flags)
    assert error.startswith(line), error


def test_hflip_flips_as_random_flip_does(tiny):
    args = import_script(SCRIPT).parse_args(["--pretrained_model_name_or_path", str(tiny["sd"]),
                                             "--instance_data_dir", str(tiny["instance"]), "--instance_prompt", "x",
                                             "--hflip", "--noaug"])
    assert args.random_flip and args.freeze_model == "crossattn_kv"
