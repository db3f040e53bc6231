import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from training_utils.adapters.export import LoraExport, remove_adapter_name
from training_utils.ema import PowerEMA
from training_utils.names import LORA_WEIGHTS_NAME, SNAPSHOT_DIR
from training_utils.outputs.export import TENSORS_NAME, ModelExport
from training_utils.posthoc_ema import FORMAT_FILE, PostHocEMA, read_snapshots
from training_utils.posthoc_ema.__main__ import main
from training_utils.posthoc_ema.profiles import (MAX_SIGMA_REL, gamma_to_sigma_rel, profile_dot, sigma_rel_to_gamma,
                                                 solve_posthoc_coefficients)
from training_utils.posthoc_ema.synthesis import SYNTHESIS_FILE, output_folder, synthesize

TRACKED = [0.05, 0.10]


def scalar_parameters():
    return {"w": torch.nn.Parameter(torch.zeros(1))}


def set_weights(parameters, values):
    with torch.no_grad():
        for name, param in parameters.items():
            param.copy_(torch.as_tensor(values[name]).reshape(param.shape))


def power_average(weights_by_step, gamma, final_step):
    """Closed form of the power EMA of per-step weights (float64): step t weighs
    (t^(g+1) - (t-1)^(g+1)) / T^(g+1)."""
    t = np.arange(1, final_step + 1, dtype=np.float64)
    coefficients = (t ** (gamma + 1) - (t - 1) ** (gamma + 1)) / final_step ** (gamma + 1)
    return coefficients @ np.asarray(weights_by_step[:final_step], dtype=np.float64)


def held_weights(weights_by_step, update_steps):
    """Per-step weights as the updates sample them: each update's weights over the steps since the previous one."""
    held, previous = [], 0
    for step in update_steps:
        held += [weights_by_step[step - 1]] * (step - previous)
        previous = step
    return np.asarray(held)


def toy_trajectory(final_step=1000, dims=64, seed=0):
    """A random walk on top of a slow oscillation: float64, shape (final_step, dims)."""
    generator = torch.Generator().manual_seed(seed)
    t = torch.arange(1, final_step + 1, dtype=torch.float64)[:, None]
    walk = torch.randn(final_step, dims, generator=generator, dtype=torch.float64).cumsum(0) * 0.1
    return walk + 3 * torch.sin(t / 150 + torch.arange(dims, dtype=torch.float64))


def run_toy(output_dir, update_every, final_step=1000, snapshot_every=50, reference_sigma_rels=(0.08, 0.15),
            keep_reference_at=None):
    """Trains nothing: plays the toy trajectory into a PostHocEMA (snapshots on) and a reference one
    of other lengths updated on the same steps. Returns (trajectory, posthoc, reference, kept reference shadows)."""
    trajectory = toy_trajectory(final_step)
    parameters = {"w": torch.nn.Parameter(torch.zeros(trajectory.shape[1]))}
    posthoc = PostHocEMA(parameters, TRACKED, update_every=update_every)
    reference = PostHocEMA(parameters, reference_sigma_rels, update_every=update_every)
    posthoc.start(output_dir, 0)
    kept = None
    for step in range(1, final_step + 1):
        set_weights(parameters, {"w": trajectory[step - 1]})
        posthoc.on_step(step, final_step, output_dir, snapshot_every)
        reference.on_step(step, final_step, output_dir, snapshot_every, write=False)
        if step == keep_reference_at:
            kept = [profile.shadows["w"].double().clone() for profile in reference.profiles]
    return trajectory, posthoc, reference, kept


# --- sigma_rel <-> gamma ------------------------------------------------------------------------

def test_sigma_rel_to_gamma_reference_values():
    assert sigma_rel_to_gamma(0.05) == pytest.approx(16.97, abs=5e-3)
    assert sigma_rel_to_gamma(0.10) == pytest.approx(6.94, abs=5e-3)


@pytest.mark.parametrize("sigma_rel", [0.001, 0.01, 0.05, 0.08, 0.10, 0.2, 0.28, 0.288])
def test_sigma_rel_round_trip(sigma_rel):
    gamma = sigma_rel_to_gamma(sigma_rel)
    assert gamma > 0
    assert gamma_to_sigma_rel(gamma) == pytest.approx(sigma_rel, rel=1e-12)


@pytest.mark.parametrize("gamma", [0.01, 0.5, 3.0, 6.94, 16.97, 100.0, 1e4])
def test_gamma_round_trip(gamma):
    assert sigma_rel_to_gamma(gamma_to_sigma_rel(gamma)) == pytest.approx(gamma, rel=1e-9)


@pytest.mark.parametrize("sigma_rel", [0.0, -0.1, MAX_SIGMA_REL, 0.29, 1.0, float("nan")])
def test_sigma_rel_out_of_range_is_an_error(sigma_rel):
    with pytest.raises(ValueError):
        sigma_rel_to_gamma(sigma_rel)


@pytest.mark.parametrize("gamma", [0.0, -0.5])
def test_gamma_out_of_range_is_an_error(gamma):
    with pytest.raises(ValueError):
        gamma_to_sigma_rel(gamma)


# --- the power-function EMA ------------------------------------------------------------------------

def test_power_ema_matches_closed_form_every_step():
    gamma = sigma_rel_to_gamma(0.05)
    rng = np.random.default_rng(0)
    weights = np.cumsum(rng.normal(size=300)) * 0.1 + 1.0
    parameters = scalar_parameters()
    ema = PowerEMA(parameters, gamma)
    assert ema.step_decay(1) == 0.0
    for step in range(1, 301):
        set_weights(parameters, {"w": weights[step - 1]})
        ema.update(step)
        if step in (1, 2, 17, 300):
            assert ema.shadows["w"].item() == pytest.approx(power_average(weights, gamma, step), abs=2e-6)


@pytest.mark.parametrize("update_every", [3, 10])
def test_power_ema_with_interval_is_exact_for_piecewise_constant_weights(update_every):
    gamma = sigma_rel_to_gamma(0.10)
    final_step = 203  # not a multiple of K: the final, off-interval update is corrected too
    rng = np.random.default_rng(1)
    # the weights change only at the first step of each interval, so they are constant between updates
    weights = np.repeat(rng.normal(size=final_step // update_every + 1), update_every)[:final_step] + 2.0
    every_step, every_interval = PowerEMA(scalar_parameters(), gamma), PowerEMA(scalar_parameters(), gamma,
                                                                                 update_every=update_every)
    for step in range(1, final_step + 1):
        set_weights(every_step.parameters, {"w": weights[step - 1]})
        set_weights(every_interval.parameters, {"w": weights[step - 1]})
        every_step.update(step)
        if every_interval.is_due(step, final_step):
            every_interval.update(step)
    expected = power_average(weights, gamma, final_step)
    assert every_interval.step == final_step
    assert every_interval.shadows["w"].item() == pytest.approx(expected, abs=2e-6)
    assert every_step.shadows["w"].item() == pytest.approx(expected, abs=2e-6)


def test_power_ema_is_the_power_function_of_the_sampled_weights():
    """The docstring's statement: for any update steps (a late first one, irregular gaps) the shadow is the
    power-function average of the weights held at each update's value since the previous update."""
    gamma = 4.0
    rng = np.random.default_rng(2)
    weights = rng.normal(size=120) + np.linspace(0, 5, 120)
    update_steps = [9, 10, 25, 40, 41, 77, 120]
    ema = PowerEMA(scalar_parameters(), gamma, update_every=5)
    for step in update_steps:
        set_weights(ema.parameters, {"w": weights[step - 1]})
        ema.update(step)
    assert ema.shadows["w"].item() == pytest.approx(power_average(held_weights(weights, update_steps), gamma, 120),
                                                    abs=2e-6)
    # ...and not the power average of the actual per-step weights, which this trajectory tells apart
    assert abs(ema.shadows["w"].item() - power_average(weights, gamma, 120)) > 1e-3


# --- the least-squares fit --------------------------------------------------------------------------

@pytest.mark.parametrize("t_a, gamma_a, t_b, gamma_b", [(300, 6.9, 1000, 17.0), (1000, 6.9, 300, 17.0),
                                                         (500, 2.0, 500, 0.5)])
def test_profile_dot_matches_numerical_integration(t_a, gamma_a, t_b, gamma_b):
    tau = np.linspace(0, max(t_a, t_b), 2_000_001)

    def profile(t, gamma):
        return np.where(tau <= t, (gamma + 1) * tau ** gamma / float(t) ** (gamma + 1), 0.0)

    numeric = np.trapezoid(profile(t_a, gamma_a) * profile(t_b, gamma_b), tau)
    assert profile_dot(t_a, gamma_a, t_b, gamma_b) == pytest.approx(numeric, rel=1e-4)


def test_coefficients_sum_to_one_and_error_is_zero_for_a_tracked_profile():
    steps = np.repeat(np.arange(50, 1001, 50), 2)
    gammas = np.tile([sigma_rel_to_gamma(s) for s in TRACKED], 20)
    coefficients, errors = solve_posthoc_coefficients(steps, gammas, 1000, [gammas[-1], sigma_rel_to_gamma(0.08)])
    np.testing.assert_allclose(coefficients.sum(axis=0), 1.0, rtol=1e-12)
    np.testing.assert_allclose(coefficients[:, 0], np.eye(len(steps))[-1], atol=1e-9)
    assert errors[0] < 1e-6
    assert 1e-4 < errors[1] < 3e-3  # measured 1.93e-3


# --- snapshots, synthesis, state ----------------------------------------------------------------------

def test_constructor_rejects_fewer_than_two_distinct_sigma_rels():
    for sigma_rels in ([0.05], [0.05, 0.05], [0.05, 0.3]):
        with pytest.raises(ValueError):
            PostHocEMA(scalar_parameters(), sigma_rels)


def test_snapshot_files_metadata_and_format(tmp_path):
    parameters = {"a.weight": torch.nn.Parameter(torch.randn(3, 2)), "b": torch.nn.Parameter(torch.randn(4))}
    posthoc = PostHocEMA(parameters, TRACKED, update_every=2)
    with pytest.raises(ValueError):  # not updated at step 2 yet
        posthoc.snapshot(2, tmp_path)
    posthoc.update(2)
    paths = posthoc.snapshot(2, tmp_path)
    assert [p.name for p in paths] == ["snapshot-00000002-gamma-16.9722.safetensors",
                                       "snapshot-00000002-gamma-6.9372.safetensors"]
    for path, sigma_rel, gamma in zip(paths, TRACKED, posthoc.gammas):
        with safe_open(path, framework="pt") as file:
            metadata = file.metadata()
        assert metadata == {"format": "training_utils.posthoc_ema", "step": "2", "gamma": repr(gamma),
                            "sigma_rel": repr(sigma_rel), "update_every": "2"}
        saved = load_file(path)
        assert saved.keys() == parameters.keys()
        assert all(torch.equal(saved[name], parameters[name].detach()) for name in parameters)  # first update copies
    assert json.loads((tmp_path / SNAPSHOT_DIR / FORMAT_FILE).read_text())["kind"] == "tensors"
    written = sorted(path.name for path in (tmp_path / SNAPSHOT_DIR).iterdir())
    assert written == sorted([FORMAT_FILE] + [path.name for path in paths])
    assert [(s.step, s.sigma_rel) for s in read_snapshots(tmp_path)] == [(2, 0.10), (2, 0.05)]  # by step, then gamma


def test_snapshot_schedule():
    assert [s for s in range(1, 26) if PostHocEMA.is_snapshot_due(s, 10, 25)] == [10, 20, 25]
    assert [s for s in range(1, 26) if PostHocEMA.is_snapshot_due(s, None, 25)] == [25]


@pytest.mark.parametrize("update_every", [1, 7])
def test_synthesis_at_a_tracked_sigma_rel_reproduces_it(tmp_path, update_every):
    _, posthoc, _, _ = run_toy(tmp_path, update_every, final_step=200, snapshot_every=50)
    for sigma_rel, profile in zip(TRACKED, posthoc.profiles):
        result, = synthesize(tmp_path, [sigma_rel])
        assert result.step == 200 and len(result.snapshots) == 8
        final = [i for i, s in enumerate(result.snapshots) if s.step == 200 and s.sigma_rel == sigma_rel]
        np.testing.assert_allclose(result.coefficients, np.eye(8)[final[0]], atol=1e-9)
        assert result.relative_error < 1e-6
        torch.testing.assert_close(result.tensors["w"], profile.shadows["w"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("update_every", [1, 7])
def test_synthesized_sigma_rel_matches_a_directly_run_power_ema(tmp_path, update_every):
    """1,000 steps, snapshots every 50 steps of sigma_rel 0.05 and 0.10; synthesize 0.08 and 0.15.

    Measured: relative profile error 1.93e-3 (0.08) for any K; max |synthesized - direct| ~4e-4 for weights of
    std ~3, i.e. ~7e-4 of the gap between the 0.08 and the tracked 0.10 EMA. Tolerance: 2e-3 of that gap."""
    final_step = 1000
    trajectory, posthoc, reference, _ = run_toy(tmp_path, update_every, final_step)
    results = synthesize(tmp_path, [0.08, 0.15])
    assert len(results[0].snapshots) == 40
    assert results[0].relative_error < 3e-3
    assert results[1].relative_error < 5e-2  # extrapolating beyond the tracked lengths is worse (but bounded)

    # the update steps the profiles sampled: every K steps, every snapshot step, the final step
    update_steps = [s for s in range(1, final_step + 1)
                    if s % update_every == 0 or s % 50 == 0 or s == final_step]
    held = held_weights(trajectory.numpy(), update_steps)
    for result, direct in zip(results, reference.profiles):
        synthesized, direct_shadow = result.tensors["w"].double(), direct.shadows["w"].double()
        # the direct EMA is the power average of the held weights (the PowerEMA statement) ...
        np.testing.assert_allclose(direct_shadow.numpy(), power_average(held, direct.gamma, final_step), atol=2e-5)
        # ... and Cauchy-Schwarz bounds the synthesis error by the profile error (up to fp32 rounding)
        p_norm = math.sqrt(profile_dot(final_step, direct.gamma, final_step, direct.gamma))
        centred = held - held.mean(axis=0)  # a constant is reproduced exactly: coefficients sum to 1
        bound = result.relative_error * p_norm * np.sqrt((centred ** 2).sum(axis=0)) + 1e-5
        assert np.all(np.abs((synthesized - direct_shadow).numpy()) <= bound)

    gap = (posthoc.profiles[1].shadows["w"].double() - reference.profiles[0].shadows["w"].double()).abs().max()
    error = (results[0].tensors["w"].double() - reference.profiles[0].shadows["w"].double()).abs().max()
    assert gap > 0.3
    assert error < 2e-3 * gap


def test_snapshots_after_the_target_step_are_ignored(tmp_path):
    _, _, reference, kept = run_toy(tmp_path, 1, final_step=400, snapshot_every=10, keep_reference_at=200)
    result, = synthesize(tmp_path, [0.08], step=200)
    assert result.step == 200 and max(s.step for s in result.snapshots) == 200 and len(result.snapshots) == 40
    assert result.relative_error < 3e-3  # the fit depends on snapshot times relative to the target: 1.93e-3 again
    assert (result.tensors["w"].double() - kept[0]).abs().max() < 2e-3
    # later snapshots play no part: garbage in them changes nothing
    for snapshot in read_snapshots(tmp_path):
        if snapshot.step > 200:
            with safe_open(snapshot.path, framework="pt") as file:
                metadata = file.metadata()
            save_file({"w": torch.full((64,), 1e6)}, snapshot.path, metadata=metadata)
    again, = synthesize(tmp_path, [0.08], step=200)
    assert torch.equal(again.tensors["w"], result.tensors["w"])
    # a target step between snapshots uses the ones before it
    assert max(s.step for s in synthesize(tmp_path, [0.08], step=205)[0].snapshots) == 200


def test_state_round_trip_is_exact(tmp_path):
    generator = torch.Generator().manual_seed(3)
    parameters = {"a": torch.nn.Parameter(torch.randn(5, 3)), "b": torch.nn.Parameter(torch.randn(7))}

    def play(posthoc, steps):
        for step in steps:
            set_weights(parameters, {name: torch.randn(p.shape, generator=generator) for name, p in parameters.items()})
            posthoc.on_step(step, 40, tmp_path / "unused", None, write=False)

    first = PostHocEMA(parameters, TRACKED, update_every=3)
    play(first, range(1, 21))
    first.save(tmp_path / "posthoc_ema.safetensors")
    resumed = PostHocEMA(parameters, TRACKED, update_every=3)
    resumed.load(tmp_path / "posthoc_ema.safetensors")
    assert resumed.step == first.step == 18
    state = generator.get_state()
    play(first, range(21, 41))
    generator.set_state(state)
    play(resumed, range(21, 41))
    for a, b in zip(first.profiles, resumed.profiles):
        assert a.step == b.step == 40
        for name in parameters:
            assert torch.equal(a.shadows[name].view(torch.int32), b.shadows[name].view(torch.int32))

    other = PostHocEMA(parameters, TRACKED, update_every=3)
    other.load_state_dict(first.state_dict())
    assert all(torch.equal(x.shadows["a"], y.shadows["a"]) for x, y in zip(other.profiles, first.profiles))


def test_state_load_is_strict(tmp_path):
    parameters = {"a": torch.nn.Parameter(torch.randn(5, 3)), "b": torch.nn.Parameter(torch.randn(7))}
    posthoc = PostHocEMA(parameters, TRACKED)
    posthoc.update(1)
    posthoc.save(tmp_path / "state.safetensors")
    with pytest.raises(ValueError, match="sigma_rels"):
        PostHocEMA(parameters, [0.05, 0.12]).load(tmp_path / "state.safetensors")
    with pytest.raises(ValueError, match="missing"):
        with_another = {**parameters, "c": torch.nn.Parameter(torch.zeros(2))}
        PostHocEMA(with_another, TRACKED).load(tmp_path / "state.safetensors")
    with pytest.raises(ValueError, match="shape"):
        PostHocEMA({"a": parameters["a"], "b": torch.nn.Parameter(torch.zeros(8))}, TRACKED).load(
            tmp_path / "state.safetensors")
    save_file({"a": torch.zeros(5, 3)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError):
        posthoc.load(tmp_path / "other.safetensors")


def test_start_discards_snapshots_of_a_replaced_run(tmp_path):
    parameters = scalar_parameters()
    posthoc = PostHocEMA(parameters, TRACKED)
    posthoc.start(tmp_path, 0)
    for step in range(1, 31):
        posthoc.on_step(step, 30, tmp_path, 10)
    assert sorted({s.step for s in read_snapshots(tmp_path)}) == [10, 20, 30]
    PostHocEMA(parameters, TRACKED).start(tmp_path, 20)  # resumed at step 20
    assert sorted({s.step for s in read_snapshots(tmp_path)}) == [10, 20]
    with pytest.raises(ValueError, match="other tensors"):  # kept snapshots must match what this run trains
        PostHocEMA({"w": torch.nn.Parameter(torch.zeros(2))}, TRACKED).start(tmp_path, 20)


def test_cli_without_format_writes_plain_tensors_and_rejects_bad_values(tmp_path, capsys):
    run_toy(tmp_path, 1, final_step=100, snapshot_every=25)
    (tmp_path / SNAPSHOT_DIR / FORMAT_FILE).unlink()
    main(["--output_dir", str(tmp_path), "--sigma_rel", "0.08", "--step", "75"])
    folder = output_folder(tmp_path, 0.08, 75)
    assert folder.name == "sigma_rel-0.08-step-75"
    assert load_file(folder / TENSORS_NAME).keys() == {"w"}
    assert json.loads((folder / SYNTHESIS_FILE).read_text())["step"] == 75
    for bad in (["--sigma_rel", "0.3"], ["--sigma_rel", "0.08", "--step", "10"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["--output_dir", str(tmp_path), *bad])
        assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("error:") == 2


# --- export in the script's own format --------------------------------------------------------------

def test_cli_writes_a_lora_that_load_lora_weights_accepts(tiny, tmp_path, capsys):
    from diffusers import StableDiffusionPipeline
    from peft.utils import get_peft_model_state_dict

    from training_utils.adapters.injection import ATTENTION_PROJECTIONS, add_lora
    from training_utils.pipeline import trainable_parameters

    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    add_lora(pipe.unet, 4, ATTENTION_PROJECTIONS)
    trained = {"unet": pipe.unet}
    parameters = trainable_parameters(trained)
    posthoc = PostHocEMA(parameters, TRACKED, update_every=2,
                         export=LoraExport.of(StableDiffusionPipeline, trained))
    posthoc.start(tmp_path, 0)
    generator = torch.Generator().manual_seed(0)
    for step in range(1, 21):
        set_weights(parameters, {name: p.detach() + 0.1 * torch.randn(p.shape, generator=generator)
                                 for name, p in parameters.items()})
        posthoc.on_step(step, 20, tmp_path, 5)
    description = json.loads((tmp_path / SNAPSHOT_DIR / FORMAT_FILE).read_text())
    assert description["kind"] == "lora" and description["pipeline_class"] == "StableDiffusionPipeline"
    assert description["components"]["unet"]["lora_adapter_metadata"]["r"] == 4

    main(["--output_dir", str(tmp_path), "--sigma_rel", "0.08", "0.05"])
    printed = capsys.readouterr().out
    assert "sigma_rel 0.08" in printed and "relative profile error" in printed and printed.count("snapshot-") == 16

    # the tracked 0.05 at the final step: exactly the profile's shadows, in the keys peft saves
    folder = output_folder(tmp_path, 0.05)
    assert folder == tmp_path / SNAPSHOT_DIR / "sigma_rel-0.05"
    saved = load_file(folder / LORA_WEIGHTS_NAME)
    with posthoc.profiles[0].swapped_in():
        expected = {f"unet.{key}": value.clone() for key, value in get_peft_model_state_dict(pipe.unet).items()}
    assert saved.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(saved[key], expected[key], rtol=0, atol=1e-6)

    # load_lora_weights accepts the synthesized 0.08 adapter and gets the synthesized tensors
    result, = synthesize(tmp_path, [0.08])
    fresh = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    fresh.load_lora_weights(output_folder(tmp_path, 0.08), adapter_name="posthoc")
    loaded = get_peft_model_state_dict(fresh.unet, adapter_name="posthoc")
    by_key = {remove_adapter_name(name.removeprefix("unet."), "default"): tensor
              for name, tensor in result.tensors.items()}
    assert loaded.keys() == by_key.keys()
    for key, tensor in by_key.items():
        assert torch.equal(loaded[key], tensor)


def test_module_format_writes_a_save_pretrained_folder(tiny, tmp_path):
    from diffusers import ControlNetModel

    from training_utils.pipeline import trainable_parameters

    controlnet = ControlNetModel.from_pretrained(tiny["controlnet"])
    trained = {"controlnet": controlnet}
    parameters = trainable_parameters(trained)
    posthoc = PostHocEMA(parameters, TRACKED, export=ModelExport.of(trained))
    posthoc.start(tmp_path, 0)
    generator = torch.Generator().manual_seed(0)
    for step in range(1, 5):
        set_weights(parameters, {name: p.detach() + 0.01 * torch.randn(p.shape, generator=generator)
                                 for name, p in parameters.items()})
        posthoc.on_step(step, 4, tmp_path, 2)
    main(["--output_dir", str(tmp_path), "--sigma_rel", "0.08"])
    result, = synthesize(tmp_path, [0.08])
    loaded = ControlNetModel.from_pretrained(output_folder(tmp_path, 0.08)).state_dict()
    assert loaded.keys() == {name.removeprefix("controlnet.") for name in result.tensors}
    for name, tensor in result.tensors.items():
        assert torch.equal(loaded[name.removeprefix("controlnet.")], tensor)
