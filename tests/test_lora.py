import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from safetensors.torch import load_file

from training_utils.ema import EMA
from training_utils.lora import (LORA_WEIGHTS_NAME, TEXT_ENCODER_TARGET_MODULES, UNET_TARGET_MODULES, add_lora,
                                 save_lora, save_lora_with_ema)
from training_utils.pipeline import trainable_parameters


def fresh_pipe(tiny):
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def render(pipe):
    return pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


@pytest.fixture()
def trained_pipe(tiny):
    """A pipeline with LoRA on the UNet and the text encoder, perturbed as if trained."""
    pipe = fresh_pipe(tiny)
    add_lora(pipe.unet, 4, UNET_TARGET_MODULES)
    add_lora(pipe.text_encoder, 2, TEXT_ENCODER_TARGET_MODULES, alpha=4)
    trained = {"unet": pipe.unet, "text_encoder": pipe.text_encoder}
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in trainable_parameters(trained).values():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return pipe, trained


def test_add_lora_trains_only_adapter_tensors(tiny):
    pipe = fresh_pipe(tiny)
    config = add_lora(pipe.unet, 4, UNET_TARGET_MODULES, alpha=8, dropout=0.1)
    add_lora(pipe.text_encoder, 2, TEXT_ENCODER_TARGET_MODULES)
    trained = trainable_parameters({"unet": pipe.unet, "text_encoder": pipe.text_encoder})
    assert trained and all("lora_A" in name or "lora_B" in name for name in trained)
    assert any(name.startswith("text_encoder.") for name in trained)
    assert config.r == 4 and config.lora_alpha == 8 and config.lora_dropout == 0.1
    assert not pipe.unet.conv_in.weight.requires_grad
    # Freshly added adapters leave the model's output unchanged (lora_B starts at zero).
    assert all(torch.count_nonzero(p) == 0 for name, p in trained.items() if "lora_B" in name)


def test_saved_lora_loads_into_a_fresh_pipeline_and_changes_its_output(tiny, trained_pipe, tmp_path):
    pipe, trained = trained_pipe
    path = save_lora(StableDiffusionPipeline, tmp_path, trained)
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


def test_save_lora_with_ema_writes_the_ema_weights_and_restores_the_live_ones(trained_pipe, tmp_path):
    pipe, trained = trained_pipe
    parameters = trainable_parameters(trained)
    ema = EMA(parameters, decay=0.5)
    ema.update(1)
    with torch.no_grad():
        for parameter in parameters.values():
            parameter.mul_(3)
    live = {name: parameter.detach().clone() for name, parameter in parameters.items()}

    paths = save_lora_with_ema(StableDiffusionPipeline, tmp_path, trained, ema)

    raw, averaged = load_file(paths["raw"]), load_file(paths["ema"])
    assert paths["ema"] == tmp_path / "ema" / LORA_WEIGHTS_NAME
    assert raw.keys() == averaged.keys()
    assert all(raw[key].shape == averaged[key].shape for key in raw)
    assert all(torch.equal(parameters[name], live[name]) for name in live)
    # Keys differ between the parameter names and the LoRA file only by the adapter name.
    for name, shadow in ema.shadows.items():
        key = name.replace(".default", "")
        assert torch.equal(averaged[key], shadow) and torch.equal(raw[key], live[name])


def test_save_lora_refuses_a_component_the_pipeline_cannot_save(trained_pipe, tmp_path):
    pipe, _ = trained_pipe
    with pytest.raises(ValueError, match="'vae'"):
        save_lora(StableDiffusionPipeline, tmp_path, {"vae": pipe.unet})

