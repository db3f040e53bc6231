"""Writing trained adapters (training_utils.adapters.export): LoRA and DoRA files that ``load_lora_weights`` loads, LoKr,
LoHa and OFT folders in peft's own format that ``PeftModel.from_pretrained`` loads, each rendering as the adapter in
memory; raw and EMA, checked once written, read back from checkpoints, rewritten from their descriptions."""

import json
import types

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, StableDiffusionPipeline
from peft import PeftModel, get_peft_model
from peft.utils import set_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file

from training_utils.adapters.config import (SETTINGS, adapter_config, check_adapter_args,
                                            fill_adapter_settings)
from training_utils.adapters.export import LoraExport, PeftExport, adapter_export, converted_name, remove_adapter_name
from training_utils.adapters.injection import ATTENTION_PROJECTIONS, CLIP_ATTENTION_PROJECTIONS, add_adapter, add_lora
from training_utils.ema import EMA
from training_utils.errors import UsageError
from training_utils.outputs.export import save_with_ema
from training_utils.outputs.hub import how_to_load
from training_utils.pipeline import trainable_parameters
from training_utils.posthoc_ema.synthesis import export_from_description
from test_export import fresh_pipe, perturb
from training_utils.names import LORA_WEIGHTS_NAME

ADAPTERS = ["lora", "dora", "lokr", "loha", "oft"]


def render(pipe):
    return pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


def adapter_flags(adapter, **settings):
    """The checked flags of ``adapter`` with its defaults, but ``settings``."""
    args = types.SimpleNamespace(adapter=adapter, use_dora=False, **{**dict.fromkeys(SETTINGS), **settings})
    check_adapter_args(args)
    fill_adapter_settings(args)
    return args


def with_adapter(pipe, adapter):
    """``pipe``'s UNet and text encoder with ``adapter`` (blocks of 8 for OFT), perturbed as if trained."""
    args = adapter_flags(adapter, **({"oft_block_size": 8} if adapter == "oft" else {"lora_alpha": 6.0}))
    add_adapter(pipe.unet, adapter_config(args, ATTENTION_PROJECTIONS))
    add_adapter(pipe.text_encoder, adapter_config(args, CLIP_ATTENTION_PROJECTIONS))
    trained = {"unet": pipe.unet, "text_encoder": pipe.text_encoder}
    perturb(trainable_parameters(trained), scale=0.3)
    return trained


def load_saved(pipe, export, directory):
    """Load what ``export`` saved into ``directory`` as its model card says: ``load_lora_weights`` or peft."""
    if isinstance(export, LoraExport):
        pipe.load_lora_weights(directory)
    else:
        for component in export.adapter_configs:
            PeftModel.from_pretrained(getattr(pipe, component), directory / component)
    return pipe


@pytest.fixture()
def trained_pipe(tiny):
    """A pipeline with LoRA on the UNet and the text encoder, perturbed as if trained."""
    pipe = fresh_pipe(tiny)
    add_lora(pipe.unet, 4, ATTENTION_PROJECTIONS)
    add_lora(pipe.text_encoder, 2, CLIP_ATTENTION_PROJECTIONS, alpha=4)
    trained = {"unet": pipe.unet, "text_encoder": pipe.text_encoder}
    perturb(trainable_parameters(trained))
    return pipe, trained


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_each_adapter_loads_where_users_load_it_and_renders_as_in_memory(tiny, adapter, tmp_path):
    pipe = fresh_pipe(tiny)
    trained = with_adapter(pipe, adapter)
    export = adapter_export(StableDiffusionPipeline, trained, ["diffusers", "kohya", "comfyui"])
    assert type(export) is (LoraExport if adapter in ("lora", "dora") else PeftExport)
    assert export.title == {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr", "loha": "LoHa", "oft": "OFT"}[adapter]
    path = export.save(tmp_path / "saved")
    expected = render(pipe)
    loaded = render(load_saved(fresh_pipe(tiny), export, tmp_path / "saved"))
    assert not np.allclose(render(fresh_pipe(tiny)), expected, atol=1e-3), "the adapter changes nothing"
    np.testing.assert_allclose(loaded, expected, atol=1e-6)
    # A checkpoint is the same files, read back by parameter name, bitwise.
    read = export.read_checkpoint(tmp_path / "saved")
    parameters = trainable_parameters(trained)
    assert read.keys() == parameters.keys() and all(torch.equal(read[name], parameters[name]) for name in read)
    # Written again from tensors by the run's description (the post-hoc EMA synthesis), every file is the same.
    described = export_from_description(json.loads(json.dumps(export.description())))
    assert described.description() == export.description()
    written = described.write({name: parameter.detach().clone() for name, parameter in parameters.items()},
                              tmp_path / "written")
    files = sorted(file.relative_to(tmp_path / "saved") for file in (tmp_path / "saved").rglob("*.safetensors"))
    assert written.relative_to(tmp_path / "written") == path.relative_to(tmp_path / "saved")
    assert {converted_name("kohya"), converted_name("comfyui")} <= {file.name for file in files}
    for file in files:
        saved, rewritten = load_file(tmp_path / "saved" / file), load_file(tmp_path / "written" / file)
        assert saved.keys() == rewritten.keys() and all(torch.equal(saved[key], rewritten[key]) for key in saved)


@pytest.mark.parametrize("adapter", ["lokr", "loha", "oft"])
def test_peft_format_is_what_peft_saves(tiny, adapter, tmp_path):
    pipe = fresh_pipe(tiny)
    trained = with_adapter(pipe, adapter)
    export = adapter_export(StableDiffusionPipeline, trained)
    export.save(tmp_path / "ours")
    model = get_peft_model(fresh_pipe(tiny).unet, pipe.unet.peft_config["default"])
    ours = load_file(tmp_path / "ours" / "unet" / "adapter_model.safetensors")
    set_peft_model_state_dict(model, ours)
    model.save_pretrained(tmp_path / "peft")
    theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)
    config, peft_config = (json.loads((folder / "adapter_config.json").read_text())
                           for folder in (tmp_path / "ours" / "unet", tmp_path / "peft"))
    assert config["base_model_name_or_path"] == str(tiny["sd"] / "unet")
    differ = ("base_model_name_or_path", "target_modules")
    assert {key: value for key, value in config.items() if key not in differ} == {
        key: value for key, value in peft_config.items() if key not in differ}
    assert config["target_modules"] == sorted(peft_config["target_modules"])


def test_the_model_card_says_how_to_load_each_component_with_peft(tiny):
    pipe = fresh_pipe(tiny)
    export = adapter_export(StableDiffusionPipeline, with_adapter(pipe, "loha"))
    args = types.SimpleNamespace(pretrained_model_name_or_path="base", output_dir="out", validation_prompt=None)
    code = how_to_load(export.loading_code, args, pipe)
    compile(code, "model card", "exec")
    assert "for component in ['unet', 'text_encoder']:" in code
    assert 'PeftModel.from_pretrained(getattr(pipe, component), "out/" + component)' in code


def test_a_layout_that_cannot_hold_the_adapter_stops_the_run_before_training(tiny):
    # ComfyUI's FLUX.2 fuses q, k and v: a DoRA on q alone would need the base weight's norms for k's and v's rows.
    pipe = Flux2KleinPipeline.from_pretrained(tiny["flux2_klein"])
    add_adapter(pipe.transformer, adapter_config(adapter_flags("dora"), ["transformer_blocks.0.attn.to_q"]))
    trained = {"transformer": pipe.transformer}
    assert adapter_export(Flux2KleinPipeline, trained).formats == ["diffusers"]
    with pytest.raises(UsageError, match="DoRA on every part that diffusion_model.double_blocks.0.img_attn.qkv fuses"):
        adapter_export(Flux2KleinPipeline, trained, ["diffusers", "comfyui"])


def test_saved_lora_loads_into_a_fresh_pipeline_and_changes_its_output(tiny, trained_pipe, tmp_path):
    pipe, trained = trained_pipe
    path = LoraExport.of(StableDiffusionPipeline, trained).save(tmp_path)
    assert path == tmp_path / LORA_WEIGHTS_NAME
    saved = load_file(path)
    assert {key.split(".")[0] for key in saved} == {"unet", "text_encoder"}
    assert all("lora" in key for key in saved)
    assert not list(tmp_path.glob(".incomplete-*")), "staging folder left behind"


def test_lora_metadata_is_each_components_adapter_config_with_sorted_target_modules(trained_pipe, tmp_path):
    _, trained = trained_pipe
    LoraExport.of(StableDiffusionPipeline, trained).save(tmp_path)
    with safe_open(tmp_path / LORA_WEIGHTS_NAME, "pt") as file:
        metadata = json.loads(file.metadata()["lora_adapter_metadata"])
    assert metadata["unet.r"] == 4 and metadata["text_encoder.r"] == 2 and metadata["text_encoder.lora_alpha"] == 4
    assert metadata["unet.target_modules"] == sorted(ATTENTION_PROJECTIONS)


@pytest.mark.parametrize("adapter", ["lora", "oft"])
def test_save_with_ema_writes_the_ema_adapter_and_restores_the_live_weights(tiny, adapter, tmp_path):
    trained = with_adapter(fresh_pipe(tiny), adapter)
    parameters = trainable_parameters(trained)
    ema = EMA(parameters, decay=0.5)
    ema.update(1)
    with torch.no_grad():
        for parameter in parameters.values():
            parameter.mul_(3)
    live = {name: parameter.detach().clone() for name, parameter in parameters.items()}

    export = adapter_export(StableDiffusionPipeline, trained)
    paths = save_with_ema(export, tmp_path, ema)

    assert paths == {"raw": export.path(tmp_path), "ema": export.path(tmp_path / "ema")}
    assert all(torch.equal(parameters[name], live[name]) for name in live)
    raw, averaged = export.read_checkpoint(tmp_path), export.read_checkpoint(tmp_path / "ema")
    assert raw.keys() == averaged.keys() == live.keys()
    assert all(torch.equal(averaged[name], ema.shadows[name]) and torch.equal(raw[name], live[name]) for name in live)


def test_lora_export_refuses_a_component_the_pipeline_cannot_save(trained_pipe):
    pipe, _ = trained_pipe
    with pytest.raises(ValueError, match="'vae'"):
        LoraExport.of(StableDiffusionPipeline, {"vae": pipe.unet})


def test_lora_export_refuses_trained_parameters_that_peft_would_not_save(trained_pipe):
    pipe, trained = trained_pipe
    pipe.unet.conv_in.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="conv_in.weight"):
        LoraExport.of(StableDiffusionPipeline, trained)


def test_an_export_from_a_description_refuses_tensors_of_another_component(trained_pipe, tmp_path):
    _, trained = trained_pipe
    described = export_from_description(json.loads(json.dumps(LoraExport.of(StableDiffusionPipeline,
                                                                              trained).description())))
    with pytest.raises(ValueError, match="no exported component"):
        described.write({"vae.weight": torch.zeros(1)}, tmp_path / "stray")


def test_remove_adapter_name():
    assert remove_adapter_name("down.attn.to_q.lora_A.default.weight") == "down.attn.to_q.lora_A.weight"
    assert remove_adapter_name("default.to_q.lora_B.default.weight") == "default.to_q.lora_B.weight"
    assert remove_adapter_name("x.lora_magnitude_vector.default") == "x.lora_magnitude_vector"
    assert remove_adapter_name("x.lokr_w1.default") == "x.lokr_w1"
    assert remove_adapter_name("x.oft_R.default.weight") == "x.oft_R.weight"


def test_model_lora_is_what_the_model_saves_and_loads_itself(tiny, tmp_path):
    """`ModelLoraExport` (a LoRA on a model whose pipeline has no LoRA loader: Kandinsky 2.2's prior) writes what the
    model's own ``save_lora_adapter`` writes, ``load_lora_adapter`` loads it bitwise, and a run's description
    rebuilds the export."""
    from diffusers import KandinskyV22PriorPipeline, PriorTransformer

    from training_utils.adapters.export import ModelLoraExport

    prior = PriorTransformer.from_pretrained(tiny["kandinsky22_prior"] / "prior")
    add_lora(prior, rank=4, target_modules=ATTENTION_PROJECTIONS, alpha=8)
    with torch.no_grad():
        for name, parameter in prior.named_parameters():
            if "lora_B" in name:
                parameter.normal_(generator=torch.Generator().manual_seed(0))
    export = adapter_export(KandinskyV22PriorPipeline, {"prior": prior}, lora_export=ModelLoraExport)
    assert type(export) is ModelLoraExport and export.title == "LoRA"
    written = export.write(trainable_parameters({"prior": prior}), tmp_path / "ours")
    assert written == tmp_path / "ours" / LORA_WEIGHTS_NAME
    prior.save_lora_adapter(tmp_path / "theirs")
    ours, theirs = (safe_open(tmp_path / name / LORA_WEIGHTS_NAME, "pt") for name in ("ours", "theirs"))
    assert set(ours.keys()) == set(theirs.keys())
    for key in ours.keys():
        assert torch.equal(ours.get_tensor(key), theirs.get_tensor(key)), key
    ours_config, theirs_config = (json.loads(file.metadata()["lora_adapter_metadata"]) for file in (ours, theirs))
    assert (ours_config["r"], ours_config["lora_alpha"]) == (theirs_config["r"], theirs_config["lora_alpha"]) == (4, 8)
    assert sorted(ours_config["target_modules"]) == sorted(theirs_config["target_modules"])
    fresh = PriorTransformer.from_pretrained(tiny["kandinsky22_prior"] / "prior")
    fresh.load_lora_adapter(tmp_path / "ours", prefix=None, use_safetensors=True)
    inputs = {"hidden_states": torch.randn(1, 32), "timestep": torch.tensor([5]),
              "proj_embedding": torch.randn(1, 32), "encoder_hidden_states": torch.randn(1, 77, 32)}
    with torch.no_grad():
        assert torch.equal(fresh(**inputs)[0], prior(**inputs)[0])
    rebuilt = export_from_description(export.description())
    assert type(rebuilt) is ModelLoraExport
    assert rebuilt.read_files(tmp_path / "ours").keys() == {f"prior.{key}" for key in ours.keys()}
    assert 'pipe.prior.load_lora_adapter("out", prefix=None' in how_to_load(
        export.loading_code, types.SimpleNamespace(pretrained_model_name_or_path="base", output_dir="out",
                                                   validation_prompt=None), fresh)
