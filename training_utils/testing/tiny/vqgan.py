"""A tiny VQ-GAN: the VQModel and discriminator configs of upstream's ``examples/vqgan/test_vqgan.py`` as json files
(what its ``--model_config_name_or_path`` and ``--discriminator_config_name_or_path`` name), a VQModel of that config
to train on, and a tiny random VGG in timm's layout, the perceptual loss's stand-in for ``timm/vgg19.tv_in1k``."""

import json
from pathlib import Path


def write_json(path, config):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(config))

# Upstream's test configs, as its test writes them.
TINY_VQMODEL = {"_class_name": "VQModel", "_diffusers_version": "0.17.0.dev0", "act_fn": "silu",
                "block_out_channels": [32], "down_block_types": ["DownEncoderBlock2D"], "in_channels": 3,
                "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32, "norm_type": "spatial",
                "num_vq_embeddings": 32, "out_channels": 3, "sample_size": 32, "scaling_factor": 0.18215,
                "up_block_types": ["UpDecoderBlock2D"], "vq_embed_dim": 4}
TINY_DISCRIMINATOR = {"_class_name": "Discriminator", "_diffusers_version": "0.27.0.dev0", "in_channels": 3,
                      "cond_channels": 0, "hidden_channels": 8, "depth": 4}
# timm's VGG layout (output channels per convolution, "M" per max pool) with VGG's five max pools, a few channels.
TINY_VGG_LAYOUT = [4, "M", 8, "M", 8, 8, "M", 8, "M", 8, "M"]


def build_vqmodel_config(path):
    """Upstream's tiny VQModel config, a json file."""
    write_json(path, TINY_VQMODEL)


def build_discriminator_config(path):
    """Upstream's tiny discriminator config, a json file."""
    write_json(path, TINY_DISCRIMINATOR)


def build_vqmodel(path):
    """A ``VQModel`` of the tiny config (random weights, seed 0), saved to train on."""
    import torch
    from diffusers import VQModel

    torch.manual_seed(0)
    VQModel.from_config(TINY_VQMODEL).save_pretrained(path)


def build_vgg(path):
    """A safetensors file of a random VGG in timm's layout (``features.<i>``, a classifier ``head.fc`` the loss
    ignores), seed 0: what ``timm/vgg19.tv_in1k``'s ``model.safetensors`` is to the perceptual loss."""
    import torch
    from safetensors.torch import save_file

    from ...vqgan import VGGFeatures

    torch.manual_seed(0)
    tensors = {f"features.{name}": tensor.contiguous()
               for name, tensor in VGGFeatures(TINY_VGG_LAYOUT, [5]).features.state_dict().items()}
    tensors.update({"head.fc.weight": torch.randn(10, 8), "head.fc.bias": torch.zeros(10)})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path)


FIXTURES = {"vqmodel_config": build_vqmodel_config, "vqgan_discriminator_config": build_discriminator_config,
            "vqmodel": build_vqmodel, "vgg_tiny": build_vgg}
