"""training_utils.flow_matching: timesteps from the training schedule, the straight path, the loss; its flags."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.flow_matching import (add_flow_matching_args, add_noise, check_flow_matching_args,
                                          flow_matching_loss, sample_flow_matching_timesteps, velocity, weighted_mse)


def parse(*argv, **defaults):
    parser = training_parser("test")
    add_flow_matching_args(parser, **defaults)
    args = parser.parse_args(["--pretrained_model_name_or_path", "x", *map(str, argv)])
    check_flow_matching_args(args)
    return args


@pytest.fixture(scope="module")
def scheduler(tiny):
    return FlowMatchEulerDiscreteScheduler.from_pretrained(tiny["sd3"], subfolder="scheduler")


@pytest.mark.parametrize("scheme", ["logit_normal", "mode", "sigma_sqrt", "cosmap", "none"])
def test_timesteps_come_from_the_training_schedule_with_their_own_sigmas(scheduler, scheme):
    args = parse("--weighting_scheme", scheme)
    torch.manual_seed(0)
    timesteps, sigmas = sample_flow_matching_timesteps(scheduler, args, torch.zeros(64, 4, 2, 2))
    assert timesteps.shape == (64,) and sigmas.shape == (64, 1, 1, 1)
    assert torch.allclose(sigmas.flatten(), timesteps / scheduler.config.num_train_timesteps)
    assert set(timesteps.tolist()) <= set(scheduler.timesteps.tolist())
    assert len(set(timesteps.tolist())) > 10
    torch.manual_seed(0)
    again, _ = sample_flow_matching_timesteps(scheduler, args, torch.zeros(64, 4, 2, 2))
    assert torch.equal(timesteps, again)


def test_logit_normal_density_follows_logit_mean(scheduler):
    def mean_sigma(logit_mean):
        torch.manual_seed(0)
        _, sigmas = sample_flow_matching_timesteps(scheduler, parse("--logit_mean", logit_mean), torch.zeros(256, 1))
        return sigmas.mean().item()

    # The schedule runs from high noise to low: a larger density value picks a later, less noisy index.
    assert mean_sigma(3.0) < mean_sigma(0.0) < mean_sigma(-3.0)


def test_mode_density_of_exactly_one_stays_inside_the_schedule(scheduler, monkeypatch):
    monkeypatch.setattr("training_utils.flow_matching.compute_density_for_timestep_sampling",
                        lambda *args, **kwargs: torch.tensor([1.0, 0.0]))
    timesteps, _ = sample_flow_matching_timesteps(scheduler, parse(), torch.zeros(2, 1))
    assert timesteps.tolist() == [scheduler.timesteps[-1].item(), scheduler.timesteps[0].item()]


def test_the_path_is_the_straight_line_and_the_velocity_its_direction():
    latents, noise = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    sigmas = torch.tensor([0.0, 1.0]).reshape(2, 1, 1, 1)
    noisy = add_noise(latents, noise, sigmas)
    assert torch.equal(noisy[0], latents[0]) and torch.equal(noisy[1], noise[1])
    halfway = add_noise(latents, noise, torch.full((2, 1, 1, 1), 0.5))
    torch.testing.assert_close(halfway + 0.5 * velocity(latents, noise), noise)


def test_the_sigmas_take_the_latents_dtype_and_broadcast_over_them(scheduler):
    latents = torch.zeros(3, 4, 1, 2, 2, dtype=torch.bfloat16)  # a one-frame video's latents
    _, sigmas = sample_flow_matching_timesteps(scheduler, parse(), latents)
    assert sigmas.shape == (3, 1, 1, 1, 1) and sigmas.dtype == torch.bfloat16


def test_the_prior_loss_is_the_class_halfs_weighted_and_added():
    latents, noise, prediction = torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2)
    target = velocity(latents, noise)
    sigmas = torch.rand(4, 1, 1, 1)
    weighting = 1 / sigmas**2  # sigma_sqrt's weights
    instance, prior = weighted_mse(prediction[:2], target[:2], weighting[:2]), weighted_mse(
        prediction[2:], target[2:], weighting[2:])
    args = parse("--weighting_scheme", "sigma_sqrt", "--precondition_outputs", 0)
    args.with_prior_preservation, args.prior_loss_weight = True, 0.25
    torch.testing.assert_close(flow_matching_loss(prediction, latents, noise, sigmas, args), instance + 0.25 * prior)
    args = parse("--weighting_scheme", "none", "--precondition_outputs", 0)
    torch.testing.assert_close(flow_matching_loss(prediction, latents, noise, sigmas, args),
                               ((prediction - target) ** 2).mean())


def test_preconditioning_regresses_the_clean_latents_the_velocity_implies():
    latents, noise, prediction = torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2)
    sigmas = torch.rand(4, 1, 1, 1)
    args = parse("--weighting_scheme", "none", "--precondition_outputs", 1)
    estimate = add_noise(latents, noise, sigmas) - sigmas * prediction
    torch.testing.assert_close(flow_matching_loss(prediction, latents, noise, sigmas, args),
                               ((estimate - latents) ** 2).mean())
    # The estimate's error is sigma times the velocity's: a perfect velocity is a perfect estimate.
    assert flow_matching_loss(velocity(latents, noise), latents, noise, sigmas, args) < 1e-12


@pytest.mark.parametrize("flags, message", [
    (["--logit_std", 0], "--logit_std=0.0: expected a positive number"),
])
def test_bad_flags_raise_one_line(flags, message):
    with pytest.raises(UsageError) as error:
        parse(*flags)
    assert str(error.value) == message


def test_defaults_follow_the_diffusers_scripts():
    args = parse()
    assert (args.weighting_scheme, args.logit_mean, args.logit_std, args.mode_scale, args.precondition_outputs) == (
        "logit_normal", 0.0, 1.0, 1.29, 0)
    assert parse(weighting_scheme="none").weighting_scheme == "none"
    assert parse(precondition_outputs=1).precondition_outputs == 1
