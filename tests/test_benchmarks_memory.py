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



# The released transformers' sizes, in billions of parameters, as their model cards name them, and their classes.
RELEASED = {"flux2_dev": (32, "Flux2Transformer2DModel"), "qwen_image": (20, "QwenImageTransformer2DModel"),
            "hidream": (17, "HiDreamImageTransformer2DModel"), "wan_14b": (14, "WanTransformer3DModel"),
            "z_image": (6, "ZImageTransformer2DModel"), "flux2_klein": (4, "Flux2Transformer2DModel")}


def test_the_memory_plans_real_configs_are_the_released_sizes():
    """`tests/benchmarks/real_configs.py`, whose models the table of the memory plan's estimates plans: each
    transformer built from its config (on the meta device) has the released size."""
    import diffusers
    from accelerate import init_empty_weights

    from tests.benchmarks.real_configs import FAMILIES, TRANSFORMER_ONLY

    configs = {name: (RELEASED[name][1], model.configs["transformer"], RELEASED[name][0])
               for name, model in FAMILIES.items()}
    configs.update({"ltx2": (TRANSFORMER_ONLY["ltx2"].class_name, TRANSFORMER_ONLY["ltx2"].config, 19),
                    "hunyuan_video_15": (TRANSFORMER_ONLY["hunyuan_video_15"].class_name,
                                         TRANSFORMER_ONLY["hunyuan_video_15"].config, 8)})
    sizes = {}
    for name, (class_name, config, _) in configs.items():
        with init_empty_weights():
            transformer = getattr(diffusers, class_name).from_config(config)
        sizes[name] = round(sum(parameter.numel() for parameter in transformer.parameters()) / 1e9)
    assert sizes == {name: billions for name, (_, _, billions) in configs.items()}
