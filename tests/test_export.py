"""Writing trained weights (training_utils.outputs.export): model folders and pipelines, raw and EMA, checked once written;
and the descriptions the post-hoc EMA synthesis writes with. Adapters: test_adapter_export.py."""

import json
from enum import Enum

import pytest
import torch
from diffusers import ControlNetModel, SD3Transformer2DModel, StableDiffusionPipeline, UNet2DConditionModel
from safetensors.torch import load_file
from transformers import CLIPTextModel

from training_utils.ema import EMA
from training_utils.outputs.export import (TENSORS_NAME, ModelExport, PipelineExport, TensorsExport, as_json,
                                           save_with_ema)
from training_utils.pipeline import trainable_parameters
from training_utils.posthoc_ema.synthesis import export_from_description


def fresh_pipe(tiny):
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def perturb(parameters, scale=0.1, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in parameters.values():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


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


def test_model_export_writes_a_transformers_text_encoder_beside_the_unet_from_its_description(tiny, tmp_path):
    pipe = fresh_pipe(tiny)
    trained = {"unet": pipe.unet, "text_encoder": pipe.text_encoder.requires_grad_(True)}
    tensors = {name: parameter.detach() + 1 for name, parameter in trainable_parameters(trained).items()}
    export = export_from_description(json.loads(json.dumps(ModelExport.of(trained).description())))
    export.write(tensors, tmp_path)
    text_encoder = CLIPTextModel.from_pretrained(tmp_path / "text_encoder")
    for name, parameter in text_encoder.named_parameters():
        assert torch.equal(parameter, tensors[f"text_encoder.{name}"])
    assert (tmp_path / "unet" / "config.json").is_file()


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


def test_a_model_checkpoint_from_tensors_is_the_same_folder_and_draws_no_random_numbers(tiny, tmp_path):
    pipe = fresh_pipe(tiny)
    trained = {"unet": pipe.unet.requires_grad_(True)}
    export = PipelineExport(pipe, trained)
    tensors = {name: tensor + 1 for name, tensor in trainable_parameters(trained).items()}
    state = torch.get_rng_state()
    export.write_checkpoint(tensors, tmp_path)  # as a sharded run writes it mid-run, from tensors gathered whole
    assert torch.equal(torch.get_rng_state(), state)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["unet"]
    read = export.read_checkpoint(tmp_path)
    assert read.keys() == tensors.keys() and all(torch.equal(read[name], tensors[name]) for name in tensors)


def test_a_model_written_from_its_description_gets_the_buffers_saved_beside_its_weights(tiny, tmp_path):
    # SD3's positional embedding is saved with the weights but never trains: a post-hoc synthesis (or a sharded
    # checkpoint) has the trained tensors only, and the model writes it as its config makes it, drawing no random
    # numbers.
    transformer = SD3Transformer2DModel.from_pretrained(tiny["sd3"] / "transformer")
    export = export_from_description(ModelExport.of({"transformer": transformer}).description())
    tensors = {name: tensor + 1 for name, tensor in trainable_parameters({"transformer": transformer}).items()}
    assert "transformer.pos_embed.pos_embed" not in tensors
    state = torch.get_rng_state()
    export.write(tensors, tmp_path)
    assert torch.equal(torch.get_rng_state(), state)
    written = SD3Transformer2DModel.from_pretrained(tmp_path).state_dict()
    assert torch.equal(written["pos_embed.pos_embed"], transformer.state_dict()["pos_embed.pos_embed"])
    assert all(torch.equal(written[name.partition(".")[2]], tensor) for name, tensor in tensors.items())


def test_tensors_export_writes_the_tensors_as_they_are(tmp_path):
    export = export_from_description(None)
    assert isinstance(export, TensorsExport) and export_from_description(export.description()).kind == "tensors"
    path = export.write({"a.w": torch.ones(2)}, tmp_path)
    assert path == tmp_path / TENSORS_NAME and torch.equal(load_file(path)["a.w"], torch.ones(2))
    with pytest.raises(ValueError, match="kind"):
        export_from_description({"kind": "pickle"})


def test_as_json_makes_configs_plain_and_deterministic():
    class Kind(Enum):
        LORA = "LORA"

    value = {"targets": {"to_v", "to_k"}, "kind": Kind.LORA, 1: (2, None), "path": torch.device("cpu")}
    assert as_json(value) == {"targets": ["to_k", "to_v"], "kind": "LORA", "1": [2, None], "path": "cpu"}


def test_a_controlnet_written_from_its_parameters_gets_its_persistent_buffers_with_or_without_the_live_model(
        tiny, tmp_path):
    # SD3's ControlNet holds its fixed positional table as a buffer, which the trained tensors (a sharded run's
    # parameters gathered whole) leave out: the model makes it as its config makes it.
    from diffusers import SD3ControlNetModel

    controlnet = SD3ControlNetModel.from_pretrained(tiny["sd3_controlnet"])
    trained = {"controlnet": controlnet}
    tensors = {name: tensor + 1 for name, tensor in trainable_parameters(trained).items()}
    assert "controlnet.pos_embed.pos_embed" not in tensors
    ModelExport.of(trained).write_checkpoint(tensors, tmp_path)
    written = SD3ControlNetModel.from_pretrained(tmp_path / "controlnet")
    assert torch.equal(written.pos_embed.pos_embed, controlnet.pos_embed.pos_embed)
    assert torch.equal(written.controlnet_blocks[0].weight, controlnet.controlnet_blocks[0].weight + 1)
    ModelExport(ModelExport.of(trained).configs).write_checkpoint(tensors, tmp_path / "again")
    again = SD3ControlNetModel.from_pretrained(tmp_path / "again" / "controlnet")
    assert torch.equal(again.pos_embed.pos_embed, controlnet.pos_embed.pos_embed)
