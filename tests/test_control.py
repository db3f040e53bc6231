"""training_utils.control: the widened input layer (FLUX.1's and CogView4's), the conditioning concatenated as the
Control pipelines concatenate it, the conditioning latents, the Control LoRA's file (the widened input and the norm
layers) as load_lora_weights loads it, the validator and the model card's loading code."""

import json
from types import SimpleNamespace

import pytest
import torch
from diffusers import CogView4Transformer2DModel, FluxControlPipeline, FluxTransformer2DModel
from peft import LoraConfig
from PIL import Image

from training_utils.args import add_lora_args, fill_dependent_defaults, training_parser
from training_utils.control import (ControlLoraExport, add_control_args, add_control_lora_args,
                                    check_control_lora_args, control_how_to_load, control_lora_config,
                                    control_lora_layers, make_control_validator, norm_layer_names, widen_input_layer,
                                    with_conditioning)
from training_utils.controlnet import conditioning_latents, dataset_columns, load_validation_pairs
from training_utils.errors import UsageError
from training_utils.testing.tiny.flux import flux_components
from training_utils.testing.tiny.parts import tiny_unet


@pytest.fixture
def flux_pipe():
    pipe = FluxControlPipeline(**flux_components())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_cogview4():
    torch.manual_seed(0)
    return CogView4Transformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8,
                                      num_attention_heads=2, text_embed_dim=8, time_embed_dim=8, condition_dim=4,
                                      pos_embed_max_size=8, sample_size=8, rope_axes_dim=(4, 4))


def flux_inputs(transformer, latents, seed=0):
    generator = torch.Generator().manual_seed(seed)
    batch, channels, height, width = latents.shape
    config = transformer.config
    return {"hidden_states": FluxControlPipeline._pack_latents(latents, batch, channels, height, width),
            "img_ids": FluxControlPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, "cpu",
                                                                      torch.float32),
            "encoder_hidden_states": torch.randn(batch, 3, config.joint_attention_dim, generator=generator),
            "pooled_projections": torch.randn(batch, config.pooled_projection_dim, generator=generator),
            "txt_ids": torch.zeros(3, 3), "timestep": torch.tensor([0.5] * batch),
            "guidance": torch.tensor([3.5] * batch)}


@pytest.mark.parametrize("name", ["flux", "cogview4"])
def test_widening_keeps_the_old_columns_adds_zero_ones_and_records_it_in_the_config(name):
    model = flux_components()["transformer"] if name == "flux" else tiny_cogview4()
    layer_name = "x_embedder" if name == "flux" else "patch_embed.proj"
    old = model.get_submodule(layer_name)
    in_channels, out_channels, weight, bias = model.config.in_channels, model.config.out_channels, old.weight, old.bias
    new = widen_input_layer(model, layer_name)
    assert model.get_submodule(layer_name) is new
    assert new.in_features == 2 * old.in_features and new.out_features == old.out_features
    assert torch.equal(new.weight[:, :old.in_features], weight)
    assert torch.equal(new.weight[:, old.in_features:], torch.zeros_like(weight))
    assert torch.equal(new.bias, bias) and new.weight.requires_grad
    assert model.config.in_channels == 2 * in_channels
    assert model.config.out_channels == (out_channels or in_channels)
    # The config rebuilds the widened model, its output as wide as before.
    rebuilt = type(model).from_config(model.config)
    assert rebuilt.get_submodule(layer_name).weight.shape == new.weight.shape
    assert rebuilt.proj_out.weight.shape == model.proj_out.weight.shape


def test_the_widened_model_starts_as_the_base_model_whatever_the_conditioning():
    base = flux_components()["transformer"]
    widened = flux_components()["transformer"]
    widen_input_layer(widened, "x_embedder")
    latents, conditioning = torch.randn(1, 4, 4, 4), torch.randn(1, 4, 4, 4)  # the tiny VAE: 4 channels
    with torch.no_grad():
        expected = base(**flux_inputs(base, latents), return_dict=False)[0]
        given = widened(**flux_inputs(widened, with_conditioning(latents, conditioning)), return_dict=False)[0]
    torch.testing.assert_close(given, expected, rtol=1e-5, atol=1e-6)


def test_a_unet_conv_in_widens_as_instruct_pix2pix_widens_it_and_starts_as_the_base_unet():
    base, widened = tiny_unet(), tiny_unet()
    old = widened.conv_in
    new = widen_input_layer(widened, "conv_in")
    assert isinstance(new, torch.nn.Conv2d) and widened.conv_in is new
    assert (new.in_channels, new.out_channels, new.kernel_size, new.padding) == (
        2 * old.in_channels, old.out_channels, old.kernel_size, old.padding)
    assert torch.equal(new.weight[:, :old.in_channels], old.weight)
    assert torch.equal(new.weight[:, old.in_channels:], torch.zeros_like(old.weight))
    assert torch.equal(new.bias, old.bias)
    assert (widened.config.in_channels, widened.config.out_channels) == (8, 4)
    assert type(widened).from_config(widened.config).conv_in.weight.shape == new.weight.shape
    latents, conditioning = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)
    text = torch.randn(1, 3, base.config.cross_attention_dim)
    with torch.no_grad():
        expected = base(latents, 10, text, return_dict=False)[0]
        given = widened(with_conditioning(latents, conditioning), 10, text, return_dict=False)[0]
    assert given.shape == expected.shape
    torch.testing.assert_close(given, expected, rtol=1e-5, atol=1e-6)


def test_the_conditioning_is_concatenated_as_flux_control_pipeline_concatenates_it():
    latents, conditioning = torch.randn(2, 16, 4, 6), torch.randn(2, 16, 4, 6, dtype=torch.float64)
    concatenated = with_conditioning(latents, conditioning)
    assert concatenated.dtype == latents.dtype
    assert torch.equal(concatenated, torch.cat([latents, conditioning.float()], dim=1))
    # The pipeline packs each, then concatenates the tokens' features (its __call__: torch.cat(..., dim=2)).
    packed = FluxControlPipeline._pack_latents(concatenated, 2, 32, 4, 6)
    pipeline = torch.cat([FluxControlPipeline._pack_latents(latents, 2, 16, 4, 6),
                          FluxControlPipeline._pack_latents(conditioning.float(), 2, 16, 4, 6)], dim=2)
    assert torch.equal(packed, pipeline)


def test_conditioning_latents_encode_the_images_from_minus_one_to_one(flux_pipe):
    from training_utils.data.frozen_encoders import FrozenEncoders

    pixels = torch.rand(2, 3, 8, 8)
    frozen = FrozenEncoders(flux_pipe.vae, [], None, "cpu", torch.float32)
    torch.manual_seed(1)
    latents = conditioning_latents(frozen, pixels)
    torch.manual_seed(1)
    expected = flux_pipe.vae.encode(pixels * 2 - 1).latent_dist.sample()
    assert torch.equal(latents, expected)


def parse(tmp_path, *flags):
    parser = training_parser("test")
    add_control_args(parser)
    return parser.parse_args(list(map(str, ["--pretrained_model_name_or_path", tmp_path, "--output_dir",
                                            tmp_path / "out", *flags])))


def test_flags_are_the_controlnet_scripts_and_the_validator_renders_each_prompt_with_its_control_image(
        tmp_path, flux_pipe):
    Image.new("RGB", (8, 8), "red").save(tmp_path / "pose.png")
    args = parse(tmp_path, "--conditioning_image_column", "hint", "--validation_prompt", "a", "b",
                 "--validation_image", tmp_path / "pose.png")
    assert dataset_columns(args)["--conditioning_image_column"] == "hint"
    pairs = load_validation_pairs(args)
    assert [prompt for prompt, _ in pairs] == ["a", "b"]
    validator = make_control_validator(args, flux_pipe, SimpleNamespace(is_main_process=True, num_processes=1,
                                                                        process_index=0, device=torch.device("cpu")),
                                       pairs)
    assert [list(kwargs) for kwargs in validator.prompt_kwargs] == [["control_image"], ["control_image"]]
    assert [kwargs["control_image"] for kwargs in validator.prompt_kwargs] == [pairs[0][1], pairs[1][1]]
    assert list(validator.conditioning_images) == [pairs[0][1], pairs[1][1]]


def test_the_card_loads_the_pipeline_folder_with_its_ema_or_the_lora_into_the_control_pipeline(tmp_path, flux_pipe):
    args = parse(tmp_path, "--validation_prompt", "a red circle", "--validation_image", "pose.png")
    output_dir = tmp_path / "out"
    full, with_ema = (control_how_to_load(args, flux_pipe, ema) for ema in (None, object()))
    for card in (full, with_ema):
        assert "from diffusers import FluxControlPipeline, FluxTransformer2DModel" in card
        assert f'pipe = FluxControlPipeline.from_pretrained("{output_dir}")' in card
        assert 'image = pipe("a red circle", control_image=load_image("pose.png")).images[0]' in card
    swap = f'pipe.transformer = FluxTransformer2DModel.from_pretrained("{output_dir}/ema/transformer")'
    assert swap not in full and swap in with_ema
    lora = control_how_to_load(args, flux_pipe, lora=True)
    assert f'pipe.load_lora_weights("{output_dir}")' in lora and "FluxTransformer2DModel" not in lora
    assert 'control_image=load_image("pose.png")' in lora


def control_lora(transformer, train_norm_layers):
    widen_input_layer(transformer, "x_embedder")
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian",
                                       target_modules=["x_embedder", "to_q", "to_k"]))
    names = norm_layer_names(transformer)
    with torch.no_grad():
        for name, parameter in transformer.named_parameters():
            if "lora_B" in name or name in names:
                parameter.add_(torch.randn_like(parameter) * 0.1)  # a trained adapter, trained norm scales
            if name in names:
                parameter.requires_grad_(train_norm_layers)
    return names


@pytest.mark.parametrize("train_norm_layers", [False, True])
def test_a_control_lora_with_its_norm_layers_loads_into_a_fresh_pipeline_widening_its_input(
        tmp_path, flux_pipe, train_norm_layers):
    transformer = flux_pipe.transformer
    names = control_lora(transformer, train_norm_layers)
    assert names and all(".norm_" in f".{name}" for name in names)
    assert any(name.endswith("attn.norm_added_q.weight") for name in names)
    export = ControlLoraExport.of(FluxControlPipeline, {"transformer": transformer})
    export.save(tmp_path)

    fresh = FluxControlPipeline(**flux_components())
    assert fresh.transformer.x_embedder.in_features == transformer.x_embedder.in_features // 2
    fresh.load_lora_weights(tmp_path)
    assert fresh.transformer.config.in_channels == transformer.config.in_channels
    assert fresh.transformer.x_embedder.base_layer.weight.shape == transformer.x_embedder.base_layer.weight.shape
    loaded, trained = fresh.transformer.state_dict(), transformer.state_dict()
    assert torch.equal(loaded["x_embedder.base_layer.weight"], trained["x_embedder.base_layer.weight"])
    assert torch.equal(loaded["x_embedder.lora_A.default_0.weight"], trained["x_embedder.lora_A.default.weight"])
    initial = flux_components()["transformer"].state_dict()
    for name in names:
        assert torch.equal(loaded[name], trained[name] if train_norm_layers else initial[name]), name


def test_a_control_lora_refuses_other_whole_layers(flux_pipe):
    transformer = flux_pipe.transformer
    control_lora(transformer, train_norm_layers=True)
    transformer.proj_out.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="only trained: proj_out.weight"):
        ControlLoraExport.of(FluxControlPipeline, {"transformer": transformer})


def test_the_lora_always_adapts_the_input_layer_and_takes_upstreams_bias_flag(tmp_path):
    transformer = flux_components()["transformer"]
    assert control_lora_layers(transformer, "to_q", "x_embedder") == [
        "x_embedder", "transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_q",
        "single_transformer_blocks.1.attn.to_q"]
    linear = [name for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)]
    assert control_lora_layers(transformer, "all-linear", "x_embedder") == linear and "proj_out" in linear
    parser = training_parser("test")
    add_lora_args(parser, FluxControlPipeline)
    add_control_lora_args(parser)

    def config(*flags):
        args = parser.parse_args(["--pretrained_model_name_or_path", str(tmp_path), *flags])
        check_control_lora_args(args)
        fill_dependent_defaults(args)
        return control_lora_config(args, ["x_embedder"])

    assert (config().lora_bias, config().init_lora_weights) == (False, "gaussian")
    assert (config("--use_lora_bias").lora_bias, config("--use_lora_bias").init_lora_weights) == (True, True)
    for flags in (["--use_lora_bias", "--gaussian_init_lora"], ["--adapter", "loha"], ["--use_dora"]):
        with pytest.raises(UsageError):
            config(*flags)


def test_a_json_lines_file_is_a_dataset_its_paths_relative_to_the_working_directory(tmp_path, monkeypatch):
    from training_utils.controlnet import dataset_columns
    from training_utils.data.datasets import load_train_dataset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "images").mkdir()
    for name, color in (("a", "red"), ("b", "blue")):
        Image.new("RGB", (8, 8), color).save(tmp_path / "images" / f"{name}.png")
    rows = [{"image": "images/a.png", "conditioning_image": str(tmp_path / "images" / "b.png"), "text": "a red square"},
            {"image": "images/b.png", "conditioning_image": "images/a.png", "text": "a blue square"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    def load(path, *flags):
        args = parse(tmp_path, "--jsonl_for_train", path, *flags)
        return load_train_dataset(args, dataset_columns(args))

    dataset = load("train.jsonl")
    assert dataset["text"] == ["a red square", "a blue square"]
    assert [image.getpixel((0, 0)) for image in dataset["conditioning_image"]] == [(0, 0, 255), (255, 0, 0)]
    rows[1]["conditioning_image"] = "images/missing.png"
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UsageError, match="row 1 has 'images/missing.png'"):
        load("bad.jsonl")
    (tmp_path / "not.jsonl").write_text("not json\n")
    for path, flags, expected in (("not.jsonl", [], "expected a JSON Lines file"),
                                  ("absent.jsonl", [], "expected an existing JSON Lines file"),
                                  ("train.jsonl", ["--train_data_dir", tmp_path], "expected no --dataset_name")):
        with pytest.raises(UsageError, match=expected):
            load(path, *flags)
