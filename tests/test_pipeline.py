"""Components of training_utils.pipeline: freezing/casting, trained-parameter names, the training scheduler."""

import pytest
import torch
from diffusers import DDPMScheduler, PNDMScheduler, StableDiffusionPipeline

from training_utils.pipeline import (
    modules_of,
    prepare_components,
    trainable_parameters,
    training_noise_scheduler,
    weight_dtype_for,
)


@pytest.fixture
def fresh_pipe(tiny):
    """A pipeline of this test's own, free to mutate."""
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def train_only_conv_out(pipe):
    pipe.unet.requires_grad_(False)
    pipe.unet.conv_out.requires_grad_(True)
    return {"unet": pipe.unet}


@pytest.mark.parametrize(
    "mixed_precision, dtype",
    [("fp16", torch.float16), ("bf16", torch.bfloat16), ("no", torch.float32), (None, torch.float32)],
)
def test_weight_dtype_for(mixed_precision, dtype):
    assert weight_dtype_for(mixed_precision) is dtype


def test_modules_of(tiny_sd_pipe):
    assert set(modules_of(tiny_sd_pipe)) == {"unet", "vae", "text_encoder"}
    assert modules_of(tiny_sd_pipe)["unet"] is tiny_sd_pipe.unet


def test_prepare_components_bf16(fresh_pipe):
    pipe = fresh_pipe
    trained = train_only_conv_out(pipe)
    prepare_components(pipe, trained, "cpu", torch.bfloat16)

    for name in ("vae", "text_encoder"):
        module = getattr(pipe, name)
        assert all(p.dtype == torch.bfloat16 for p in module.parameters()), name
        assert not any(p.requires_grad for p in module.parameters()), name
        assert not module.training, name
    for name, parameter in pipe.unet.named_parameters():
        if name.startswith("conv_out."):
            assert parameter.requires_grad and parameter.dtype == torch.float32, name
        else:
            assert not parameter.requires_grad and parameter.dtype == torch.bfloat16, name
    assert all(p.device.type == "cpu" for p in pipe.unet.parameters())
    # the fp32 trained parameters are the ones the optimizer will see
    parameters = trainable_parameters(trained)
    assert set(parameters) == {"unet.conv_out.weight", "unet.conv_out.bias"}
    assert parameters["unet.conv_out.weight"] is pipe.unet.conv_out.weight
    assert parameters["unet.conv_out.weight"].dtype == torch.float32


def test_prepare_components_fp32_changes_no_dtype(fresh_pipe):
    pipe = fresh_pipe
    trained = train_only_conv_out(pipe)
    before = {name: p.detach().clone() for name, p in pipe.vae.named_parameters()}
    prepare_components(pipe, trained, "cpu", torch.float32)
    assert all(p.dtype == torch.float32 for module in modules_of(pipe).values() for p in module.parameters())
    assert all(torch.equal(p, before[name]) for name, p in pipe.vae.named_parameters())
    assert not any(p.requires_grad for p in pipe.text_encoder.parameters())
    assert pipe.unet.conv_out.weight.requires_grad


def test_prepare_components_trained_values_survive_bf16(fresh_pipe):
    pipe = fresh_pipe
    trained = train_only_conv_out(pipe)
    before = pipe.unet.conv_out.weight.detach().clone()
    assert not torch.equal(before, before.bfloat16().float())  # not exactly representable in bf16
    prepare_components(pipe, trained, "cpu", torch.bfloat16)
    assert torch.equal(pipe.unet.conv_out.weight.detach(), before)


def test_prepare_components_full_module_trained(fresh_pipe):
    pipe = fresh_pipe
    pipe.unet.requires_grad_(True)
    prepare_components(pipe, {"unet": pipe.unet}, "cpu", torch.bfloat16)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in pipe.unet.parameters())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in pipe.vae.parameters())


def test_trainable_parameters_names(fresh_pipe):
    unet, text_encoder = fresh_pipe.unet, fresh_pipe.text_encoder
    unet.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.conv_in.weight.requires_grad_(True)
    # the text encoder's last two parameters (its final layer norm), whatever transformers calls the path
    last_two = [name for name, _ in text_encoder.named_parameters()][-2:]
    for name in last_two:
        text_encoder.get_parameter(name).requires_grad_(True)
    parameters = trainable_parameters({"unet": unet, "text_encoder": text_encoder})
    assert list(parameters) == ["unet.conv_in.weight"] + [f"text_encoder.{name}" for name in last_two]
    assert last_two[0].endswith("final_layer_norm.weight")
    assert parameters["unet.conv_in.weight"] is unet.conv_in.weight
    assert parameters[f"text_encoder.{last_two[1]}"] is text_encoder.get_parameter(last_two[1])


def test_trainable_parameters_raises_when_nothing_requires_grad(fresh_pipe):
    fresh_pipe.unet.requires_grad_(False)
    with pytest.raises(ValueError, match="unet"):
        trainable_parameters({"unet": fresh_pipe.unet})


def test_trainable_parameters_of_every_parameter(fresh_pipe):
    fresh_pipe.vae.requires_grad_(True)
    parameters = trainable_parameters({"vae": fresh_pipe.vae})
    assert list(parameters) == [f"vae.{name}" for name, _ in fresh_pipe.vae.named_parameters()]


def test_training_noise_scheduler_keeps_the_schedule(tiny_sd_pipe):
    inference_scheduler = tiny_sd_pipe.scheduler
    config_before = dict(inference_scheduler.config)
    noise_scheduler = training_noise_scheduler(tiny_sd_pipe)
    assert type(noise_scheduler) is DDPMScheduler
    assert tiny_sd_pipe.scheduler is inference_scheduler
    assert dict(inference_scheduler.config) == config_before
    assert noise_scheduler.config.prediction_type == "epsilon"
    assert noise_scheduler.config.num_train_timesteps == 1000
    assert torch.equal(noise_scheduler.betas, inference_scheduler.betas)
    assert torch.equal(noise_scheduler.alphas_cumprod, inference_scheduler.alphas_cumprod)
    assert noise_scheduler is not training_noise_scheduler(tiny_sd_pipe)


def test_training_noise_scheduler_v_prediction(fresh_pipe):
    pipe = fresh_pipe
    betas = pipe.scheduler.betas.clone()
    noise_scheduler = training_noise_scheduler(pipe, prediction_type="v_prediction")
    assert type(noise_scheduler) is DDPMScheduler
    assert noise_scheduler.config.prediction_type == "v_prediction"
    assert type(pipe.scheduler) is PNDMScheduler
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    assert pipe.scheduler.config.steps_offset == 1 and pipe.scheduler.config.skip_prk_steps
    assert torch.equal(noise_scheduler.betas, betas)
    assert torch.equal(pipe.scheduler.betas, betas)


def test_training_noise_scheduler_other_class(tiny_sd_pipe):
    from diffusers import DDIMScheduler

    noise_scheduler = training_noise_scheduler(tiny_sd_pipe, scheduler_class=DDIMScheduler)
    assert type(noise_scheduler) is DDIMScheduler
    assert torch.equal(noise_scheduler.alphas_cumprod, tiny_sd_pipe.scheduler.alphas_cumprod)
