"""`tests/benchmarks/memory.py`'s real-size configs (the benchmark itself needs real-size memory, so it is not part
of the suite): the Wan 2.2 TI2V-5B VAE is the released one, whose latents' standardisation the training uses."""

import torch
from diffusers import AutoencoderKLWan

from tests.benchmarks.memory import WAN22_VAE


def test_the_wan22_vae_standardises_its_48_channels_with_the_released_statistics():
    with torch.device("meta"):
        vae = AutoencoderKLWan(**WAN22_VAE)
    assert vae.config.z_dim == len(vae.config.latents_mean) == len(vae.config.latents_std) == 48
    # The first and last channels' as diffusers' scripts/convert_wan_to_diffusers.py (vae22_diffusers_config) has them.
    assert (vae.config.latents_mean[0], vae.config.latents_mean[-1]) == (-0.2289, -0.0667)
    assert (vae.config.latents_std[0], vae.config.latents_std[-1]) == (0.4765, 0.7744)
    assert (vae.config.patch_size, vae.config.scale_factor_spatial, vae.config.scale_factor_temporal) == (2, 16, 4)
