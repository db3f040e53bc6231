"""The pieces of the denoising loss that every epsilon/v-prediction UNet script shares."""

import torch
import torch.nn.functional as F


def sample_noise(latents, noise_offset=0.0):
    """Gaussian noise like ``latents``; ``noise_offset`` adds a per-channel constant so the model
    learns to change the image's mean brightness."""
    noise = torch.randn_like(latents)
    if noise_offset:
        noise += noise_offset * torch.randn(latents.shape[:2] + (1,) * (latents.ndim - 2), device=latents.device,
                                            dtype=latents.dtype)
    return noise


def perturbed_noise(noise, input_perturbation=0.0):
    """The noise to add to the latents under input perturbation (Ning et al., 2023): ``noise`` plus
    ``input_perturbation`` times fresh Gaussian noise. The loss target stays ``noise``, so the model
    learns to undo a slightly wrong input, as it must at inference. ``0`` returns ``noise`` itself and
    draws nothing from the RNG."""
    if not input_perturbation:
        return noise
    return noise + input_perturbation * torch.randn_like(noise)


def sample_timesteps(noise_scheduler, batch_size, device):
    return torch.randint(0, noise_scheduler.config.num_train_timesteps, (batch_size,), device=device).long()


def prediction_target(noise_scheduler, latents, noise, timesteps):
    """What the model predicts: the noise (epsilon), the velocity (v-prediction) or the clean sample (sample: the
    Kandinsky prior's image embedding)."""
    prediction_type = noise_scheduler.config.prediction_type
    if prediction_type == "sample":
        return latents
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return noise_scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"unsupported prediction type {prediction_type!r}")


def snr(noise_scheduler, timesteps):
    """Signal-to-noise ratio alpha_bar / (1 - alpha_bar) at ``timesteps``."""
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
    return alphas_cumprod / (1 - alphas_cumprod)


def diffusion_loss(model_pred, target, noise_scheduler, timesteps, snr_gamma=None):
    """Mean squared error, optionally with min-SNR-gamma weighting (Hang et al., 2023).

    Per sample the weight is min(SNR, gamma) / SNR for epsilon and min(SNR, gamma) / (SNR + 1)
    for v-prediction, which caps the weight of the easy, low-noise timesteps; a model that predicts the clean sample
    weighs it min(SNR, gamma) (the formulation itself).
    """
    if snr_gamma is None:
        return F.mse_loss(model_pred.float(), target.float(), reduction="mean")
    ratio = snr(noise_scheduler, timesteps)
    weights = torch.clamp(ratio, max=snr_gamma)
    prediction_type = noise_scheduler.config.prediction_type
    if prediction_type != "sample":
        weights = weights / (ratio + 1 if prediction_type == "v_prediction" else ratio)
    per_sample = F.mse_loss(model_pred.float(), target.float(), reduction="none").mean(dim=list(range(1, target.ndim)))
    return (per_sample * weights).mean()
