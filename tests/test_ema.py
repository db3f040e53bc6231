import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from training_utils.ema import EMA


def make_parameters(seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return {
        "down.weight": torch.nn.Parameter(torch.randn(4, 3, generator=generator).to(dtype)),
        "up.weight": torch.nn.Parameter(torch.randn(3, 4, generator=generator).to(dtype)),
        "bias": torch.nn.Parameter(torch.randn(5, generator=generator).to(dtype)),
    }


def randomize(parameters, generator):
    with torch.no_grad():
        for param in parameters.values():
            param.copy_(torch.randn(param.shape, generator=generator))


def bits(tensor):
    """Bit pattern of a float32 tensor, so -0.0 and 0.0 (or different NaNs) compare unequal."""
    return tensor.detach().view(torch.int32)


class FixedDecayPerUpdateEMA(EMA):
    """The common bug: one step's decay per update, whatever the update interval."""

    def decay_between(self, last_step, step):
        return self.step_decay(step)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"decay": -0.1},
        {"decay": 1.0},
        {"decay": 1.5},
        {"update_every": 0},
        {"inv_gamma": 0.0},
        {"power": 0.0},
    ],
)
def test_constructor_rejects_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        EMA(make_parameters(), **kwargs)


def test_constructor_rejects_no_parameters():
    with pytest.raises(ValueError):
        EMA({})


def test_constructor_accepts_the_boundaries_of_its_ranges_and_starts_from_step_zero():
    ema = EMA(make_parameters(), decay=0.0, update_every=1, inv_gamma=1e-9, power=1e-9)
    assert (ema.decay, ema.update_every, ema.inv_gamma, ema.power, ema.step) == (0.0, 1, 1e-9, 1e-9, 0)
    assert ema.step_decay(1) == 0.0


def test_shadows_are_fp32_clones_keyed_by_name():
    parameters = make_parameters()
    ema = EMA(parameters)

    assert ema.step == 0
    assert set(ema.shadows) == set(parameters)
    for name, param in parameters.items():
        shadow = ema.shadows[name]
        assert shadow.dtype == torch.float32
        assert not shadow.requires_grad
        assert shadow.data_ptr() != param.data_ptr()
        assert torch.equal(shadow, param.detach())
    assert ema.num_bytes == 4 * sum(param.numel() for param in parameters.values())

    with torch.no_grad():
        parameters["bias"].add_(1.0)
    assert not torch.equal(ema.shadows["bias"], parameters["bias"].detach())


def test_first_update_copies_weights_exactly():
    parameters = make_parameters()
    ema = EMA(parameters, decay=0.9)
    randomize(parameters, torch.Generator().manual_seed(1))

    ema.update(3)

    assert ema.step == 3
    for name, param in parameters.items():
        assert torch.equal(ema.shadows[name], param.detach())


def test_update_matches_float64_reference_with_irregular_steps():
    decay = 0.9
    parameters = make_parameters()
    ema = EMA(parameters, decay=decay)
    generator = torch.Generator().manual_seed(1)
    reference = {}
    last_step = 0

    for step in [1, 2, 5, 6, 10, 11]:
        randomize(parameters, generator)
        ema.update(step)
        beta = 0.0 if last_step == 0 else decay ** (step - last_step)
        for name, param in parameters.items():
            weight = param.detach().double()
            reference[name] = weight if last_step == 0 else beta * reference[name] + (1 - beta) * weight
        last_step = step

    # fp32 rounding over six O(1) updates stays far below 1e-6
    for name in parameters:
        torch.testing.assert_close(ema.shadows[name].double(), reference[name], rtol=0, atol=1e-6)


def test_decay_zero_keeps_ema_exactly_equal_to_weights():
    parameters = make_parameters()
    ema = EMA(parameters, decay=0.0)
    generator = torch.Generator().manual_seed(1)

    for step in range(1, 31):
        randomize(parameters, generator)
        ema.update(step)
        for name, param in parameters.items():
            assert torch.equal(ema.shadows[name], param.detach())


def test_interval_correction_matches_updating_every_step():
    interval, final_step, decay = 4, 42, 0.9
    parameters = make_parameters()
    every_step = EMA(parameters, decay=decay)
    every_interval = EMA(parameters, decay=decay, update_every=interval)
    buggy = FixedDecayPerUpdateEMA(parameters, decay=decay, update_every=interval)

    for step in range(1, final_step + 1):
        # the weights drift, changing only at the first step of each interval
        if (step - 1) % interval == 0:
            with torch.no_grad():
                for param in parameters.values():
                    param.add_(1.0)
        every_step.update(step)
        # the final step is not due, and is updated anyway, as a training script would
        if every_interval.is_due(step, final_step):
            every_interval.update(step)
            buggy.update(step)

    assert every_interval.step == final_step
    for name in parameters:
        torch.testing.assert_close(every_interval.shadows[name], every_step.shadows[name], rtol=0, atol=1e-5)
        # the buggy EMA lags about `interval` times further behind the drifting weights
        assert (every_step.shadows[name] - buggy.shadows[name]).abs().min() > 1.0


def test_warmup_schedule_values():
    ema = EMA(make_parameters(), decay=0.999, warmup=True, inv_gamma=1.0, power=2 / 3)
    assert ema.step_decay(0) == 0.0
    assert ema.step_decay(1) == pytest.approx(0.3700394750525634, rel=1e-12)
    assert ema.step_decay(10**9) == 0.999  # capped at decay

    ema = EMA(make_parameters(), decay=0.999, warmup=True, inv_gamma=1.0, power=3 / 4)
    assert ema.step_decay(10) == pytest.approx(0.8344399739238298, rel=1e-12)

    ema = EMA(make_parameters(), decay=0.999, warmup=True, inv_gamma=10.0, power=1.0)
    assert ema.step_decay(10) == pytest.approx(0.5, rel=1e-12)

    no_warmup = EMA(make_parameters(), decay=0.999)
    assert no_warmup.step_decay(1) == 0.999
    assert no_warmup.step_decay(10**9) == 0.999


def test_decay_between_is_product_of_step_decays():
    ema = EMA(make_parameters(), decay=0.999, warmup=True)
    expected = ema.step_decay(3) * ema.step_decay(4) * ema.step_decay(5)
    assert ema.decay_between(2, 5) == pytest.approx(expected, rel=1e-12)
    assert ema.decay_between(5, 5) == 1.0


def test_is_due():
    ema = EMA(make_parameters(), update_every=3)
    assert [step for step in range(1, 10) if ema.is_due(step)] == [3, 6, 9]
    assert [step for step in range(1, 11) if ema.is_due(step, last_step=10)] == [3, 6, 9, 10]


def test_update_rejects_non_increasing_step():
    ema = EMA(make_parameters())
    with pytest.raises(ValueError):
        ema.update(0)
    ema.update(5)
    with pytest.raises(ValueError):
        ema.update(5)
    with pytest.raises(ValueError):
        ema.update(4)
    assert ema.step == 5


def make_trained_ema():
    """An EMA whose shadows differ from the live weights, with gradients present on the weights."""
    parameters = make_parameters()
    ema = EMA(parameters, decay=0.5)
    randomize(parameters, torch.Generator().manual_seed(1))
    ema.update(1)
    randomize(parameters, torch.Generator().manual_seed(2))
    ema.update(2)
    randomize(parameters, torch.Generator().manual_seed(3))
    with torch.no_grad():
        parameters["bias"][0] = -0.0  # restoring must keep the sign bit too
    parameters["up.weight"].requires_grad_(False)
    for param in parameters.values():
        if param.requires_grad:
            param.grad = torch.ones_like(param)
    return parameters, ema


def test_swapped_in_swaps_and_restores_bitwise():
    parameters, ema = make_trained_ema()
    before = {name: param.detach().clone() for name, param in parameters.items()}
    grads = {name: param.grad for name, param in parameters.items()}
    requires_grad = {name: param.requires_grad for name, param in parameters.items()}
    pointers = {name: param.data_ptr() for name, param in parameters.items()}
    module_like = list(parameters.values())

    with ema.swapped_in():
        assert torch.is_grad_enabled()  # the body keeps the caller's grad mode
        for name, param in parameters.items():
            assert torch.equal(param.detach(), ema.shadows[name])
            assert not torch.equal(param.detach(), before[name])

    for param, same in zip(parameters.values(), module_like):
        assert param is same
    for name, param in parameters.items():
        assert torch.equal(bits(param), bits(before[name]))
        assert param.data_ptr() == pointers[name]
        assert param.requires_grad == requires_grad[name]
        assert param.grad is grads[name]
        assert param.dtype == torch.float32 and param.device == before[name].device


def test_swapped_in_restores_when_body_raises():
    parameters, ema = make_trained_ema()
    before = {name: param.detach().clone() for name, param in parameters.items()}

    with pytest.raises(KeyError):
        with ema.swapped_in():
            raise KeyError("boom")

    for name, param in parameters.items():
        assert torch.equal(bits(param), bits(before[name]))
    with ema.swapped_in():  # usable again after the error
        pass


def test_swapped_in_cannot_be_nested():
    parameters, ema = make_trained_ema()
    before = {name: param.detach().clone() for name, param in parameters.items()}

    with ema.swapped_in():
        with pytest.raises(RuntimeError):
            with ema.swapped_in():
                pass
        for name, param in parameters.items():
            assert torch.equal(param.detach(), ema.shadows[name])

    for name, param in parameters.items():
        assert torch.equal(bits(param), bits(before[name]))


def test_state_dict_round_trip_keeps_shadow_tensors():
    parameters, ema = make_trained_ema()
    other = EMA(make_parameters(seed=5))
    shadow_pointers = {name: shadow.data_ptr() for name, shadow in other.shadows.items()}

    other.load_state_dict(ema.state_dict())

    assert other.step == ema.step == 2
    for name, shadow in other.shadows.items():
        assert torch.equal(shadow, ema.shadows[name])
        assert shadow.data_ptr() == shadow_pointers[name]


@pytest.mark.parametrize(
    "corrupt, offending_key",
    [
        (lambda shadows: shadows.pop("bias"), "bias"),
        (lambda shadows: shadows.update({"extra.weight": torch.zeros(2)}), "extra.weight"),
        (lambda shadows: shadows.update({"up.weight": torch.zeros(4, 3)}), "up.weight"),
    ],
    ids=["missing", "unexpected", "shape_mismatch"],
)
def test_load_state_dict_is_strict(corrupt, offending_key):
    _, ema = make_trained_ema()
    other = EMA(make_parameters(seed=5))
    before = {name: shadow.clone() for name, shadow in other.shadows.items()}
    state = ema.state_dict()
    corrupt(state["shadows"])

    with pytest.raises(ValueError, match=offending_key.replace(".", r"\.")):
        other.load_state_dict(state)

    assert other.step == 0
    for name, shadow in other.shadows.items():
        assert torch.equal(shadow, before[name])


def test_save_load_round_trip(tmp_path):
    _, ema = make_trained_ema()
    path = tmp_path / "ema.safetensors"

    ema.save(path)

    assert os.listdir(tmp_path) == ["ema.safetensors"]  # no temporary file left behind
    with safe_open(str(path), framework="pt") as file:
        assert file.metadata() == {"step": "2", "format": "training_utils.ema"}
    other = EMA(make_parameters(seed=5))
    other.load(path)
    assert other.step == 2
    for name, shadow in other.shadows.items():
        assert torch.equal(bits(shadow), bits(ema.shadows[name]))


def test_save_overwrites_existing_file(tmp_path):
    _, ema = make_trained_ema()
    path = tmp_path / "ema.safetensors"
    ema.save(path)
    ema.update(7)
    ema.save(path)

    other = EMA(make_parameters(seed=5))
    other.load(path)
    assert other.step == 7


def test_failed_save_keeps_previous_file(tmp_path, monkeypatch):
    _, ema = make_trained_ema()
    path = tmp_path / "ema.safetensors"
    ema.save(path)
    saved = path.read_bytes()
    ema.update(7)

    def failing_replace(source, destination):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        ema.save(path)

    assert os.listdir(tmp_path) == ["ema.safetensors"]
    assert path.read_bytes() == saved


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"format": "training_utils.ema"}])
def test_load_refuses_files_not_written_by_ema(tmp_path, metadata):
    ema = EMA(make_parameters())
    path = tmp_path / "other.safetensors"
    save_file({name: shadow.clone() for name, shadow in ema.shadows.items()}, str(path), metadata=metadata)

    with pytest.raises(ValueError):
        ema.load(path)


def test_shadows_live_on_the_requested_device_not_the_parameters():
    # The meta device stands in for a second device on a machine with the CPU alone.
    parameters = make_parameters()
    assert all(shadow.device.type == "cpu" for shadow in EMA(parameters).shadows.values())
    for device in ["meta", torch.device("meta")]:
        ema = EMA(parameters, decay=0.5, device=device)
        assert all(shadow.device.type == "meta" for shadow in ema.shadows.values())
        ema.update(1)
        ema.update(2)
        assert all(shadow.device.type == "meta" for shadow in ema.shadows.values())
        assert all(param.device.type == "cpu" for param in parameters.values())


def test_bf16_parameters_get_fp32_shadows():
    parameters = make_parameters(dtype=torch.bfloat16)
    parameters["fp32.weight"] = torch.nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(7)))
    ema = EMA(parameters, decay=0.75)
    ema.update(1)
    start = {name: shadow.clone() for name, shadow in ema.shadows.items()}
    randomize(parameters, torch.Generator().manual_seed(1))

    ema.update(2)

    assert all(shadow.dtype == torch.float32 for shadow in ema.shadows.values())
    assert ema.num_bytes == 4 * sum(param.numel() for param in parameters.values())
    for name, param in parameters.items():
        expected = torch.lerp(start[name], param.detach().float(), 0.25)
        assert torch.equal(ema.shadows[name], expected)

    with ema.swapped_in():
        assert parameters["bias"].dtype == torch.bfloat16
        assert torch.equal(parameters["bias"].detach(), ema.shadows["bias"].bfloat16())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_shadows_for_cuda_parameters_keep_accelerator_memory_flat():
    parameters = {name: torch.nn.Parameter(param.detach().cuda()) for name, param in make_parameters().items()}
    ema = EMA(parameters, decay=0.5, device="cpu")
    ema.update(1)
    with torch.no_grad():
        for param in parameters.values():
            param.add_(1.0)
    ema.update(2)
    before = {name: param.detach().clone() for name, param in parameters.items()}
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()

    with ema.swapped_in():
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == allocated
        for name, param in parameters.items():
            assert param.device.type == "cuda"
            assert torch.equal(param.detach().cpu(), ema.shadows[name])

    assert all(shadow.device == torch.device("cpu") for shadow in ema.shadows.values())
    for name, param in parameters.items():
        assert torch.equal(param.detach(), before[name])
