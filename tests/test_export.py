"""Writing trained weights (training_utils.export): LoRA files, model folders and pipelines, raw and EMA, checked
once written; and the descriptions the post-hoc EMA synthesis writes with."""

import json
from enum import Enum

import numpy as np
import pytest
import torch
from diffusers import ControlNetModel, StableDiffusionPipeline, UNet2DConditionModel
from safetensors.torch import load_file

from training_utils.ema import EMA
from training_utils.export import (LORA_WEIGHTS_NAME, TENSORS_NAME, LoraExport, ModelExport, PipelineExport,
                                   TensorsExport, as_json, export_from_description, remove_adapter_name,
                                   save_with_ema)
from training_utils.lora import ATTENTION_PROJECTIONS, CLIP_ATTENTION_PROJECTIONS, add_lora
from training_utils.pipeline import trainable_parameters


def fresh_pipe(tiny):
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def render(pipe):
    return pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


def perturb(parameters, scale=0.1, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in parameters.values():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


@pytest.fixture()
def trained_pipe(tiny):
    """A pipeline with LoRA on the UNet and the text encoder, perturbed as if trained."""
    pipe = fresh_pipe(tiny)
    add_lora(pipe.unet, 4, ATTENTION_PROJECTIONS)
    add_lora(pipe.text_encoder, 2, CLIP_ATTENTION_PROJECTIONS, alpha=4)
    trained = {"unet": pipe.unet, "text_encoder": pipe.text_encoder}
    perturb(trainable_parameters(trained))
    return pipe, trained


def test_saved_lora_loads_into_a_fresh_pipeline_and_changes_its_output(tiny, trained_pipe, tmp_path):
    pipe, trained = trained_pipe
    path = LoraExport.of(StableDiffusionPipeline, trained).save(tmp_path)
    assert path == tmp_path / LORA_WEIGHTS_NAME
    saved = load_file(path)
    assert {key.split(".")[0] for key in saved} == {"unet", "text_encoder"}
    assert all("lora" in key for key in saved)
    assert not list(tmp_path.glob(".incomplete-*")), "staging folder left behind"

    expected = render(pipe)
    fresh = fresh_pipe(tiny)
    before = render(fresh)
    fresh.load_lora_weights(tmp_path)
    after = render(fresh)
    assert not np.allclose(before, after, atol=1e-3), "the LoRA did not change the output"
    np.testing.assert_allclose(after, expected, atol=1e-5)


def test_lora_metadata_is_each_components_adapter_config_with_sorted_target_modules(trained_pipe, tmp_path):
    from safetensors import safe_open

    _, trained = trained_pipe
    LoraExport.of(StableDiffusionPipeline, trained).save(tmp_path)
    with safe_open(tmp_path / LORA_WEIGHTS_NAME, "pt") as file:
        metadata = json.loads(file.metadata()["lora_adapter_metadata"])
    assert metadata["unet.r"] == 4 and metadata["text_encoder.r"] == 2 and metadata["text_encoder.lora_alpha"] == 4
    assert metadata["unet.target_modules"] == sorted(ATTENTION_PROJECTIONS)


def test_save_with_ema_writes_the_ema_lora_and_restores_the_live_weights(trained_pipe, tmp_path):
    pipe, trained = trained_pipe
    parameters = trainable_parameters(trained)
    ema = EMA(parameters, decay=0.5)
    ema.update(1)
    with torch.no_grad():
        for parameter in parameters.values():
            parameter.mul_(3)
    live = {name: parameter.detach().clone() for name, parameter in parameters.items()}

    paths = save_with_ema(LoraExport.of(StableDiffusionPipeline, trained), tmp_path, ema)

    raw, averaged = load_file(paths["raw"]), load_file(paths["ema"])
    assert paths == {"raw": tmp_path / LORA_WEIGHTS_NAME, "ema": tmp_path / "ema" / LORA_WEIGHTS_NAME}
    assert raw.keys() == averaged.keys()
    assert all(torch.equal(parameters[name], live[name]) for name in live)
    # Keys differ between the parameter names and the LoRA file only by the adapter name.
    for name, shadow in ema.shadows.items():
        key = name.replace(".default", "")
        assert torch.equal(averaged[key], shadow) and torch.equal(raw[key], live[name])


def test_lora_export_refuses_a_component_the_pipeline_cannot_save(trained_pipe):
    pipe, _ = trained_pipe
    with pytest.raises(ValueError, match="'vae'"):
        LoraExport.of(StableDiffusionPipeline, {"vae": pipe.unet})


def test_lora_export_refuses_trained_parameters_that_peft_would_not_save(trained_pipe):
    pipe, trained = trained_pipe
    pipe.unet.conv_in.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="conv_in.weight"):
        LoraExport.of(StableDiffusionPipeline, trained)


def test_lora_written_from_tensors_by_its_description_equals_the_saved_one(trained_pipe, tmp_path):
    _, trained = trained_pipe
    export = LoraExport.of(StableDiffusionPipeline, trained)
    export.save(tmp_path / "saved")
    described = export_from_description(json.loads(json.dumps(export.description())))
    assert isinstance(described, LoraExport) and described.description() == export.description()
    tensors = {name: parameter.detach().clone() for name, parameter in trainable_parameters(trained).items()}
    described.write(tensors, tmp_path / "written")
    saved, written = (load_file(tmp_path / name / LORA_WEIGHTS_NAME) for name in ("saved", "written"))
    assert saved.keys() == written.keys() and all(torch.equal(saved[key], written[key]) for key in saved)
    with pytest.raises(ValueError, match="no exported component"):
        described.write({"vae.weight": torch.zeros(1)}, tmp_path / "stray")


def test_model_export_saves_raw_and_ema_controlnet_folders_and_restores_the_live_weights(tiny, tmp_path):
    model = ControlNetModel.from_pretrained(tiny["controlnet"])
    trained = {"controlnet": model}
    parameters = trainable_parameters(trained)
    ema = EMA(parameters, decay=0.5)
    ema.update(1)
    perturb(parameters, scale=1.0)
    live = {name: parameter.detach().clone() for name, parameter in parameters.items()}

    paths = save_with_ema(ModelExport.of(trained), tmp_path, ema)

    assert paths == {"raw": tmp_path, "ema": tmp_path / "ema"}
    raw, averaged = ControlNetModel.from_pretrained(tmp_path), ControlNetModel.from_pretrained(tmp_path / "ema")
    for name, parameter in raw.named_parameters():
        assert torch.equal(parameter, live[f"controlnet.{name}"])
    for name, parameter in averaged.named_parameters():
        assert torch.equal(parameter, ema.shadows[f"controlnet.{name}"])
    assert all(torch.equal(parameters[name], live[name]) for name in live)


def test_model_export_writes_tensors_into_a_folder_per_component_when_there_are_several(tiny, tmp_path):
    trained = {"controlnet": ControlNetModel.from_pretrained(tiny["controlnet"]),
               "unet": UNet2DConditionModel.from_pretrained(tiny["sd"], subfolder="unet")}
    tensors = {name: parameter.detach() + 1 for name, parameter in trainable_parameters(trained).items()}
    export = export_from_description(json.loads(json.dumps(ModelExport.of(trained).description())))
    export.write(tensors, tmp_path)
    unet = UNet2DConditionModel.from_pretrained(tmp_path / "unet")
    assert torch.equal(unet.conv_in.weight, tensors["unet.conv_in.weight"])
    assert (tmp_path / "controlnet" / "config.json").is_file()
    del tensors["unet.conv_in.weight"]
    with pytest.raises(ValueError, match="missing conv_in.weight"):
        export.write(tensors, tmp_path / "incomplete")


def test_pipeline_export_saves_the_whole_pipeline_raw_and_the_trained_unet_alone_as_ema(tiny, tmp_path):
    pipe = fresh_pipe(tiny)
    trained = {"unet": pipe.unet}
    parameters = trainable_parameters({"unet": pipe.unet.requires_grad_(True)})
    ema = EMA(parameters, decay=0.5)
    ema.update(1)
    perturb(parameters)

    paths = save_with_ema(PipelineExport(pipe, trained), tmp_path, ema)

    assert paths == {"raw": tmp_path / "unet", "ema": tmp_path / "ema" / "unet"}
    reloaded = StableDiffusionPipeline.from_pretrained(tmp_path)
    assert torch.equal(reloaded.unet.conv_in.weight, pipe.unet.conv_in.weight)
    assert sorted(path.name for path in (tmp_path / "ema").iterdir()) == ["unet"]
    ema_unet = UNet2DConditionModel.from_pretrained(tmp_path / "ema" / "unet")
    assert torch.equal(ema_unet.conv_in.weight, ema.shadows["unet.conv_in.weight"])


def test_a_lora_checkpoint_is_the_loadable_file_and_reads_back_by_parameter_name(tiny, trained_pipe, tmp_path):
    pipe, trained = trained_pipe
    export = LoraExport.of(StableDiffusionPipeline, trained)
    assert export.save_checkpoint(tmp_path) == tmp_path / LORA_WEIGHTS_NAME
    assert sorted(path.name for path in tmp_path.iterdir()) == [LORA_WEIGHTS_NAME]
    parameters = trainable_parameters(trained)
    read = export.read_checkpoint(tmp_path)
    assert read.keys() == parameters.keys()
    assert all(torch.equal(read[name], parameter) for name, parameter in parameters.items())
    fresh = fresh_pipe(tiny)
    fresh.load_lora_weights(tmp_path)
    assert np.array_equal(render(fresh), render(pipe))


def test_a_model_checkpoint_is_a_folder_per_component_and_reads_back_only_what_trains(tiny, tmp_path):
    pipe = fresh_pipe(tiny)
    trained = {"unet": pipe.unet.requires_grad_(True)}
    pipe.unet.conv_in.requires_grad_(False)
    export = PipelineExport(pipe, trained)
    export.save_checkpoint(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["unet"]
    assert torch.equal(UNet2DConditionModel.from_pretrained(tmp_path / "unet").conv_out.weight,
                       pipe.unet.conv_out.weight)
    read = export.read_checkpoint(tmp_path)
    assert read.keys() == trainable_parameters(trained).keys() and "unet.conv_in.weight" not in read


def test_tensors_export_writes_the_tensors_as_they_are(tmp_path):
    export = export_from_description(None)
    assert isinstance(export, TensorsExport) and export_from_description(export.description()).kind == "tensors"
    path = export.write({"a.w": torch.ones(2)}, tmp_path)
    assert path == tmp_path / TENSORS_NAME and torch.equal(load_file(path)["a.w"], torch.ones(2))
    with pytest.raises(ValueError, match="kind"):
        export_from_description({"kind": "pickle"})


def test_remove_adapter_name():
    assert remove_adapter_name("down.attn.to_q.lora_A.default.weight") == "down.attn.to_q.lora_A.weight"
    assert remove_adapter_name("default.to_q.lora_B.default.weight") == "default.to_q.lora_B.weight"
    assert remove_adapter_name("x.lora_magnitude_vector.default") == "x.lora_magnitude_vector"


def test_as_json_makes_configs_plain_and_deterministic():
    class Kind(Enum):
        LORA = "LORA"

    value = {"targets": {"to_v", "to_k"}, "kind": Kind.LORA, 1: (2, None), "path": torch.device("cpu")}
    assert as_json(value) == {"targets": ["to_k", "to_v"], "kind": "LORA", "1": [2, None], "path": "cpu"}
