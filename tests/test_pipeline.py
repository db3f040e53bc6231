"""Components of training_utils.pipeline: freezing/casting, trained-parameter names, the training scheduler."""

from types import SimpleNamespace

import pytest
import torch
from diffusers import DDPMScheduler, PNDMScheduler, StableDiffusionPipeline
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from training_utils.adapters.injection import ATTENTION_PROJECTIONS, add_lora
from training_utils.pipeline import (load_pipeline, modules_of, prepare_components, trainable_parameters,
                                     training_noise_scheduler, weight_dtype_for)


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


def load_args(tiny):
    return SimpleNamespace(pretrained_model_name_or_path=tiny["sd"], revision=None, variant=None)


@pytest.mark.parametrize("trained_in_fp32", [(), ("unet",)])
def test_load_pipeline_loads_in_the_weight_dtype_all_but_what_trains_in_fp32(tiny, trained_in_fp32):
    pipe = load_pipeline(StableDiffusionPipeline, load_args(tiny), torch.bfloat16, trained_in_fp32)
    for name, module in modules_of(pipe).items():
        expected = torch.float32 if name in trained_in_fp32 else torch.bfloat16
        assert {parameter.dtype for parameter in module.parameters()} == {expected}, name
    assert pipe._progress_bar_config == {"disable": True}


class DeviceArrivals(TorchDispatchMode):
    """Records the dtype of every tensor that an operation makes on ``device`` out of tensors elsewhere: a move."""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if inputs and all(tensor.device != self.device for tensor in inputs):
            self.dtypes += [leaf.dtype for leaf in tree_leaves(result)
                            if isinstance(leaf, torch.Tensor) and leaf.device == self.device]
        return result


def test_a_folder_naming_a_processor_as_its_tokenizer_loads_that_tokenizer_alone(tiny):
    """FLUX.2 [dev]'s folder names Mistral's PixtralProcessor as its tokenizer, which transformers 5 imports only
    beside torchvision: the pipeline loads with the processor's tokenizer, which is all its encode_prompt uses."""
    from diffusers import Flux2Pipeline

    assert Flux2Pipeline.load_config(tiny["flux2_dev"])["tokenizer"] == ["transformers", "PixtralProcessor"]
    args = SimpleNamespace(pretrained_model_name_or_path=tiny["flux2_dev"], revision=None, variant=None)
    pipe = load_pipeline(Flux2Pipeline, args)
    with torch.no_grad():
        embeddings, _ = pipe.encode_prompt(["a photo of sks triangle"], max_sequence_length=48)
    assert embeddings.shape == (1, 48, pipe.transformer.config.joint_attention_dim)


def test_a_bf16_lora_run_moves_nothing_to_the_device_in_fp32_but_the_adapter(tiny):
    """The meta device stands in for the accelerator: every float tensor reaches it in the dtype it keeps, the
    frozen weights (the LoRA's base included) in bf16 as they were loaded, the adapter in fp32."""
    pipe = load_pipeline(StableDiffusionPipeline, load_args(tiny), torch.bfloat16)
    add_lora(pipe.unet, 4, ATTENTION_PROJECTIONS)
    trained = {"unet": pipe.unet}
    adapter = len(trainable_parameters(trained))
    frozen_floats = sum(tensor.is_floating_point() for module in modules_of(pipe).values()
                        for tensor in [*module.parameters(), *module.buffers()]) - adapter
    with DeviceArrivals("meta") as arrivals:
        prepare_components(pipe, trained, "meta", torch.bfloat16)
    floats = [dtype for dtype in arrivals.dtypes if dtype.is_floating_point]
    assert floats.count(torch.float32) == adapter and floats.count(torch.bfloat16) == frozen_floats
    assert len(floats) == adapter + frozen_floats


class QuantizedStandIn(torch.nn.Module):
    """Says it loaded quantised, as diffusers and transformers models do: an int8 weight, a bf16 norm, a bias that
    trains."""

    is_quantized = True

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.int8), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))


def test_prepare_components_leaves_a_quantised_modules_frozen_tensors_as_they_loaded():
    trained, frozen = QuantizedStandIn(), QuantizedStandIn()
    frozen.bias.requires_grad_(False)
    pipe = SimpleNamespace(components={"transformer": trained, "text_encoder": frozen})
    prepare_components(pipe, {"transformer": trained}, "cpu", torch.float16)
    for module in (trained, frozen):
        assert module.weight.dtype == torch.int8 and module.norm.dtype == torch.bfloat16
    assert trained.bias.dtype == torch.float32 and trained.bias.requires_grad
    assert frozen.bias.dtype == torch.bfloat16 and not frozen.training


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


def test_prepare_components_leaves_the_frozen_encoders_on_the_cpu_but_a_trained_one_goes_to_the_device(fresh_pipe):
    pipe = fresh_pipe
    trained = {**train_only_conv_out(pipe), "text_encoder": pipe.text_encoder}
    pipe.text_encoder.requires_grad_(True)
    prepare_components(pipe, trained, "meta", torch.bfloat16, encoders=[pipe.vae, pipe.text_encoder])
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in pipe.vae.parameters())
    assert all(p.device.type == "meta" for module in (pipe.unet, pipe.text_encoder) for p in module.parameters())


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
