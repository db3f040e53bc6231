"""`perturbed_noise`: input perturbation noises the UNet's input, never the loss target."""

import torch

from training_utils.diffusion import perturbed_noise


def test_zero_perturbation_returns_the_noise_and_draws_nothing():
    noise = torch.randn(2, 4, 8, 8)
    torch.manual_seed(0)
    assert perturbed_noise(noise, 0.0) is noise
    next_draw = torch.randn(3)
    torch.manual_seed(0)
    assert torch.equal(next_draw, torch.randn(3))


def test_perturbation_adds_scaled_fresh_noise_and_leaves_the_target_alone():
    noise = torch.randn(2, 4, 8, 8)
    original = noise.clone()
    torch.manual_seed(1)
    perturbed = perturbed_noise(noise, 0.1)
    torch.manual_seed(1)
    expected = noise + 0.1 * torch.randn_like(noise)
    assert torch.equal(perturbed, expected)
    assert torch.equal(noise, original)
    assert perturbed.shape == noise.shape and perturbed.dtype == noise.dtype
