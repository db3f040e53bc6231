"""What training a VQ-GAN (diffusers' ``VQModel``) takes besides the model: its discriminator, the VGG features of
its perceptual loss, the losses, and a pipeline that reconstructs images for validation.

The losses are those of upstream's ``examples/vqgan/train_vqgan.py`` (after Taming Transformers): the generator
learns the pixels (L2 or L1), the VGG features of the image (`perceptual_loss`), the quantizer's commitment, and to
fool the discriminator, that last term weighted adaptively (`adaptive_weight`); the discriminator learns a hinge
loss with a gradient penalty on the real images (`discriminator_loss`).

The VGG is timm's (``timm/vgg19.tv_in1k`` by default) read from its safetensors file, without timm: timm needs
torchvision, which training does not. `VGGFeatures` lays its layers out as timm's VGG does, so the file's
``features.<i>.weight`` names fit, and reads the layer sizes off the file (a tiny test VGG loads as the real one).
"""

import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import DiffusionPipeline, ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput
from PIL import Image
from safetensors.torch import load_file
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

from .args import safetensors_problem
from .errors import UsageError, require
from .pipeline import is_hub_id

# timm's VGG names (without batch norm) and the hub repository of each one's ImageNet weights.
TIMM_VGGS = {name: f"timm/{name}.tv_in1k" for name in ("vgg11", "vgg13", "vgg16", "vgg19")}
VGG_WEIGHTS_NAME = "model.safetensors"
# What timm's VGG weights were trained on: 224 px crops, normalized by ImageNet's mean and deviation.
VGG_RESOLUTION = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# The children of timm's VGG, which upstream's --timm_model_layers names (its index of each, less
# --timm_model_offset, is the feature tap taken: "head" is the third, the ReLU before the third max pool).
TIMM_VGG_CHILDREN = ("features", "pre_logits", "head")


class Discriminator(ModelMixin, ConfigMixin):
    """A patch discriminator (Paella's, as upstream's): strided spectral-norm convolutions halving the picture
    ``depth`` times, instance norm and leaky ReLU between, then a 1x1 convolution to one sigmoid score per patch.
    ``cond_channels`` > 0 takes a vector per image, broadcast over the patches. Its config names are upstream's, so
    upstream's ``--discriminator_config_name_or_path`` files build it."""

    @register_to_config
    def __init__(self, in_channels=3, cond_channels=0, hidden_channels=512, depth=6):
        super().__init__()
        # The widths double from hidden_channels / 2**first_halvings up to hidden_channels.
        first_halvings = max(depth - 3, 3)
        widths = [hidden_channels // 2 ** max(first_halvings - index, 0) for index in range(depth)]
        layers = [spectral_norm(nn.Conv2d(in_channels, widths[0], kernel_size=3, stride=2, padding=1)),
                  nn.LeakyReLU(0.2)]
        for width_in, width_out in zip(widths, widths[1:]):
            layers += [spectral_norm(nn.Conv2d(width_in, width_out, kernel_size=3, stride=2, padding=1)),
                       nn.InstanceNorm2d(width_out), nn.LeakyReLU(0.2)]
        self.encoder = nn.Sequential(*layers)
        self.shuffle = nn.Conv2d(widths[-1] + cond_channels, 1, kernel_size=1)

    def forward(self, images, cond=None):
        features = self.encoder(images)
        if cond is not None:
            cond = cond[:, :, None, None].expand(-1, -1, *features.shape[-2:])
            features = torch.cat([features, cond], dim=1)
        return torch.sigmoid(self.shuffle(features))


def vgg_layout(state_dict):
    """timm's VGG ``cfg`` (output channels per convolution, ``"M"`` per max pool) of a VGG's weights
    (``features.<i>.weight``: a convolution at index i, its ReLU at i + 1, a max pool where an index is skipped, and
    one at the end). Raises ValueError for weights of anything else (a VGG with batch norm included)."""
    convolutions = sorted(int(name.split(".")[1]) for name in state_dict
                          if name.startswith("features.") and name.endswith(".weight"))
    if not convolutions:
        raise ValueError("no features.<i>.weight tensors")
    layout, index, channels = [], 0, None
    for position in convolutions:
        if position == index + 1:
            layout.append("M")
        elif position != index:
            raise ValueError(f"features.{position} is not where a VGG without batch norm has a convolution")
        weight = state_dict[f"features.{position}.weight"]
        if weight.ndim != 4 or (channels is not None and weight.shape[1] != channels):
            raise ValueError(f"features.{position}.weight of shape {tuple(weight.shape)} does not follow the layer "
                             f"before")
        channels = weight.shape[0]
        layout.append(channels)
        index = position + 2
    return [*layout, "M"]


class VGGFeatures(nn.Module):
    """timm's VGG feature layers (``features``, laid out as ``layout`` says, `vgg_layout`), returning the feature
    maps at ``taps``: tap i < the number of max pools is the ReLU output before the i-th max pool, the last one the
    final max pool's output, as timm's ``features_only`` VGG numbers them."""

    def __init__(self, layout, taps):
        super().__init__()
        layers, ends, channels = [], [], 3
        for item in layout:
            if item == "M":
                ends.append(len(layers) - 1)
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(channels, item, kernel_size=3, padding=1), nn.ReLU()]
                channels = item
        ends.append(len(layers) - 1)
        if not all(0 <= tap < len(ends) for tap in taps):
            raise ValueError(f"feature taps {list(taps)} of a VGG with {len(ends)}")
        self.tap_ends = [ends[tap] for tap in taps]
        self.features = nn.Sequential(*layers[: max(self.tap_ends) + 1])  # nothing after the last tap runs

    def forward(self, images):
        taken = {}
        for index, layer in enumerate(self.features):
            images = layer(images)
            if index in self.tap_ends:
                taken[index] = images
        return [taken[end] for end in self.tap_ends]


def vgg_taps(layers, offset=0):
    """The feature taps that upstream's ``--timm_model_layers`` (``"|"``-separated children of timm's VGG) and
    ``--timm_model_offset`` pick."""
    names = layers.split("|")
    unknown = [name for name in names if name not in TIMM_VGG_CHILDREN]
    require(not unknown, "--timm_model_layers", layers,
            f"children of timm's VGG separated by |: {', '.join(TIMM_VGG_CHILDREN)}")
    return [TIMM_VGG_CHILDREN.index(name) - offset for name in names]


def check_vgg_source(value):
    """``--timm_model_backend``: one of timm's VGG names, a hub id, or a local safetensors file or a folder holding
    ``model.safetensors``, whole. Reads nothing but the file's header."""
    path = Path(value).expanduser()
    expected = (f"a VGG without batch norm: {', '.join(TIMM_VGGS)} (timm's ImageNet weights), a hub id, or a local "
                f"safetensors file of such a VGG (or a folder holding {VGG_WEIGHTS_NAME})")
    if path.is_dir():
        path = path / VGG_WEIGHTS_NAME
    if path.exists():
        require(path.is_file(), "--timm_model_backend", value, expected)
        problem = safetensors_problem(path)
        require(problem is None, "--timm_model_backend", value, f"a whole safetensors file ({path} {problem})")
    else:
        name = value.removesuffix(".tv_in1k")
        require(name in TIMM_VGGS or (value not in TIMM_VGG_CHILDREN and is_hub_id(value) and "/" in value),
                "--timm_model_backend", value, expected)


def vgg_weights_file(value, cache_dir=None):
    """The local safetensors file of ``--timm_model_backend`` (`check_vgg_source`), downloaded if need be."""
    path = Path(value).expanduser()
    if path.exists():
        return path / VGG_WEIGHTS_NAME if path.is_dir() else path
    from huggingface_hub import hf_hub_download

    repository = TIMM_VGGS.get(value.removesuffix(".tv_in1k"), value)
    return Path(hf_hub_download(repository, VGG_WEIGHTS_NAME, cache_dir=cache_dir))


def load_vgg(value, taps, cache_dir=None):
    """The frozen `VGGFeatures` of ``--timm_model_backend`` at ``taps``, in eval mode. Weights that are no VGG's
    without batch norm, or taps it has not, stop the run in one line."""
    state_dict = load_file(vgg_weights_file(value, cache_dir))
    try:
        vgg = VGGFeatures(vgg_layout(state_dict), taps)
    except ValueError as error:
        raise UsageError("--timm_model_backend", value, f"the weights of timm's VGG without batch norm ({error})",
                         ) from None
    vgg.load_state_dict({name: tensor for name, tensor in state_dict.items()
                         if name.startswith("features.") and int(name.split(".")[1]) < len(vgg.features)})
    return vgg.requires_grad_(False).eval()


def perceptual_loss(vgg, images, reconstructions):
    """The mean over ``vgg``'s taps of the squared error between the features of ``images`` and of
    ``reconstructions`` (both in [-1, 1]): each resized (nearest, as upstream's) to the 224 px VGG was trained at,
    normalized as ImageNet's images."""
    both = F.interpolate(torch.cat([images, reconstructions]), size=VGG_RESOLUTION)
    mean = both.new_tensor(IMAGENET_MEAN).reshape(1, 3, 1, 1)
    std = both.new_tensor(IMAGENET_STD).reshape(1, 3, 1, 1)
    features = vgg(((both + 1) / 2 - mean) / std)
    losses = [F.mse_loss(*feature.float().chunk(2)) for feature in features]
    return sum(losses) / len(losses)


def reconstruction_loss(images, reconstructions, kind="l2"):
    """The pixels' squared (``"l2"``) or absolute (``"l1"``) error."""
    error = F.mse_loss if kind == "l2" else F.l1_loss
    return error(reconstructions.float(), images.float())


def adaptive_weight(perceptual, adversarial, last_layer, limit=1e4):
    """The adversarial loss's weight that matches its gradient's norm at ``last_layer`` (the decoder's last weight)
    to the perceptual loss's, at most ``limit`` (upstream's balance); a constant for the backward pass."""
    perceptual_grad, = torch.autograd.grad(perceptual, last_layer, retain_graph=True)
    adversarial_grad, = torch.autograd.grad(adversarial, last_layer, retain_graph=True)
    return (perceptual_grad.norm() / adversarial_grad.norm().clamp(min=1e-8)).clamp(max=limit).detach()


def gradient_penalty(images, scores, weight=10.0):
    """``weight`` times the mean of (|d scores / d images| - 1)^2 per image: the discriminator's slope at the real
    ``images`` (which require grad) held near 1."""
    gradients, = torch.autograd.grad(scores, images, grad_outputs=torch.ones_like(scores), create_graph=True)
    return weight * ((gradients.flatten(1).norm(dim=1) - 1) ** 2).mean()


def discriminator_loss(discriminator, images, reconstructions):
    """``(hinge loss + gradient penalty, gradient penalty)`` of ``discriminator`` on the real ``images`` and the
    (detached) ``reconstructions``, as upstream's."""
    images = images.detach().requires_grad_()
    real, fake = discriminator(images), discriminator(reconstructions.detach())
    penalty = gradient_penalty(images, real)
    return (F.relu(1 + fake) + F.relu(1 - real)).mean() + penalty, penalty


@contextlib.contextmanager
def frozen(module):
    """``module``'s parameters without grad inside the block: the generator's step scores its reconstructions with
    the discriminator, whose parameters that step must leave alone."""
    trained = [parameter for parameter in module.parameters() if parameter.requires_grad]
    for parameter in trained:
        parameter.requires_grad_(False)
    try:
        yield module
    finally:
        for parameter in trained:
            parameter.requires_grad_(True)


def load_config_file(model_class, value, flag, cache_dir=None):
    """``model_class``'s config from ``value`` (a json file, or a folder or hub id holding config.json), read before
    any weights load; a bad one stops the run in one line."""
    try:
        if Path(value).is_file():
            return json.loads(Path(value).read_text())
        return model_class.load_config(value, cache_dir=cache_dir)
    except (OSError, ValueError) as error:
        raise UsageError(flag, value, f"a {model_class.__name__} config: a json file, or a folder or hub id holding "
                                      f"config.json ({error})") from None


class VQReconstructionPipeline(DiffusionPipeline):
    """Reconstructs images through a ``VQModel`` (encode, quantize, decode): what a VQ-GAN's validation renders. It
    has no scheduler. A call takes one preprocessed ``image`` (CHW in [-1, 1]) and its ``prompt``, the name the
    validation log records for it; ``num_inference_steps`` and ``generator`` are accepted and unused (a
    reconstruction draws nothing)."""

    scheduler = None

    def __init__(self, vqmodel):
        super().__init__()
        self.register_modules(vqmodel=vqmodel)

    @torch.no_grad()
    def __call__(self, prompt, image, num_images_per_prompt=1, num_inference_steps=None, generator=None,
                 output_type="pil"):
        parameter = next(self.vqmodel.parameters())
        pixels = image[None].to(parameter.device, parameter.dtype).repeat(num_images_per_prompt, 1, 1, 1)
        reconstructions = self.vqmodel(pixels).sample
        return ImagePipelineOutput(images=to_pil(reconstructions))


def to_pil(pixels):
    """PIL images of a batch of CHW pixels in [-1, 1] (clamped)."""
    values = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(value.squeeze(-1) if value.shape[-1] == 1 else value) for value in values]

