"""The shared denoising-loss pieces of training_utils.diffusion, checked against hand computations."""

import pytest
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler

from training_utils.diffusion import diffusion_loss, prediction_target, sample_noise, sample_timesteps, snr


def scheduler(prediction_type="epsilon"):
    return DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                         beta_schedule="scaled_linear", prediction_type=prediction_type)


def tensors(seed=0, shape=(4, 4, 8, 8)):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(shape, generator=generator)
    noise = torch.randn(shape, generator=generator)
    prediction = torch.randn(shape, generator=generator)
    timesteps = torch.tensor([0, 10, 500, 999])[: shape[0]]
    return latents, noise, prediction, timesteps


def test_epsilon_target_is_the_noise():
    latents, noise, _, timesteps = tensors()
    target = prediction_target(scheduler("epsilon"), latents, noise, timesteps)
    assert torch.equal(target, noise)


def test_v_prediction_target():
    latents, noise, _, timesteps = tensors()
    noise_scheduler = scheduler("v_prediction")
    target = prediction_target(noise_scheduler, latents, noise, timesteps)
    assert torch.equal(target, DDPMScheduler.get_velocity(scheduler("v_prediction"), latents, noise, timesteps))
    # v = sqrt(alpha_bar) * noise - sqrt(1 - alpha_bar) * x0
    alpha_bar = noise_scheduler.alphas_cumprod[timesteps].view(-1, 1, 1, 1)
    expected = alpha_bar.sqrt() * noise - (1 - alpha_bar).sqrt() * latents
    assert torch.allclose(target, expected, atol=1e-6)
    assert not torch.allclose(target, noise)


def test_sample_target_is_the_clean_latents():
    latents, noise, _, timesteps = tensors()
    assert torch.equal(prediction_target(scheduler("sample"), latents, noise, timesteps), latents)


def test_unknown_prediction_type_raises():
    latents, noise, _, timesteps = tensors()
    noise_scheduler = scheduler()
    noise_scheduler.register_to_config(prediction_type="flow")
    with pytest.raises(ValueError, match="flow"):
        prediction_target(noise_scheduler, latents, noise, timesteps)


def test_snr_by_hand():
    noise_scheduler = scheduler()
    timesteps = torch.tensor([0, 1, 250, 500, 999])
    alphas_cumprod = torch.cumprod(1 - noise_scheduler.betas, dim=0)
    expected = torch.tensor([alphas_cumprod[t] / (1 - alphas_cumprod[t]) for t in timesteps.tolist()])
    result = snr(noise_scheduler, timesteps)
    assert result.dtype == torch.float32
    assert result.shape == (5,)
    assert torch.allclose(result, expected, rtol=1e-5)
    assert torch.all(result[:-1] > result[1:])  # noisier timesteps have less signal


def test_loss_without_gamma_is_mse():
    latents, noise, prediction, timesteps = tensors()
    for prediction_type in ("epsilon", "v_prediction"):
        loss = diffusion_loss(prediction, noise, scheduler(prediction_type), timesteps)
        assert torch.equal(loss, F.mse_loss(prediction, noise))


def test_loss_upcasts_half_precision_predictions():
    latents, noise, prediction, timesteps = tensors()
    loss = diffusion_loss(prediction.bfloat16(), noise, scheduler(), timesteps)
    assert loss.dtype == torch.float32
    assert torch.equal(loss, F.mse_loss(prediction.bfloat16().float(), noise))


def hand_weighted_loss(prediction, target, noise_scheduler, timesteps, gamma):
    alphas_cumprod = noise_scheduler.alphas_cumprod.double()
    total = 0.0
    for i, t in enumerate(timesteps.tolist()):
        ratio = (alphas_cumprod[t] / (1 - alphas_cumprod[t])).item()
        if noise_scheduler.config.prediction_type == "sample":
            weight = min(ratio, gamma)
        elif noise_scheduler.config.prediction_type == "v_prediction":
            weight = min(ratio, gamma) / (ratio + 1)
        else:
            weight = min(ratio, gamma) / ratio
        squared = (prediction[i].double() - target[i].double()) ** 2
        total += weight * squared.mean().item()
    return total / len(timesteps)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("gamma", [1.0, 5.0])
def test_min_snr_loss_by_hand(prediction_type, gamma):
    latents, noise, prediction, timesteps = tensors(seed=3)
    noise_scheduler = scheduler(prediction_type)
    target = prediction_target(noise_scheduler, latents, noise, timesteps)
    loss = diffusion_loss(prediction, target, noise_scheduler, timesteps, snr_gamma=gamma)
    expected = hand_weighted_loss(prediction, target, noise_scheduler, timesteps, gamma)
    assert loss.shape == ()
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert loss.item() != pytest.approx(F.mse_loss(prediction, target).item(), rel=1e-3)


def test_min_snr_weights_are_one_where_snr_is_below_gamma_for_epsilon():
    # at t = 999 the SNR is far below gamma: min(snr, gamma) / snr = 1, so the loss is the plain MSE
    latents, noise, prediction, _ = tensors()
    timesteps = torch.full((4,), 999)
    loss = diffusion_loss(prediction, noise, scheduler("epsilon"), timesteps, snr_gamma=5.0)
    assert loss.item() == pytest.approx(F.mse_loss(prediction, noise).item(), rel=1e-6)


def test_sample_noise_without_offset_is_randn_like():
    latents = torch.zeros(2, 4, 8, 8, dtype=torch.float64)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        noise = sample_noise(latents)
        torch.manual_seed(0)
        expected = torch.randn_like(latents)
    assert noise.dtype == torch.float64 and noise.shape == latents.shape
    assert torch.equal(noise, expected)


def test_sample_noise_offset_adds_a_per_channel_constant():
    latents = torch.zeros(3, 4, 16, 16)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        plain = sample_noise(latents)
        offsets = torch.randn(3, 4, 1, 1)
        torch.manual_seed(1)
        noise = sample_noise(latents, noise_offset=0.5)
    assert noise.shape == latents.shape and noise.dtype == latents.dtype
    difference = noise - plain
    assert torch.allclose(difference, (0.5 * offsets).expand_as(difference), atol=1e-6)
    # constant within each (sample, channel), different between them: the per-channel mean moves
    assert torch.allclose(difference, difference[:, :, :1, :1].expand_as(difference), atol=1e-6)
    mean_shift = noise.mean(dim=(2, 3)) - plain.mean(dim=(2, 3))
    assert torch.all(mean_shift.abs() > 1e-4)
    assert len(set(mean_shift.flatten().tolist())) == 12


def test_sample_timesteps_range_and_shape():
    noise_scheduler = scheduler()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        timesteps = sample_timesteps(noise_scheduler, 4096, "cpu")
    assert timesteps.shape == (4096,) and timesteps.dtype == torch.long
    assert timesteps.min() >= 0 and timesteps.max() <= 999
    assert timesteps.min() < 10 and timesteps.max() > 990
