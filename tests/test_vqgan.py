"""Unit tests of training_utils.vqgan: the discriminator, timm's VGG layout read from its weights, the losses, and the
reconstruction pipeline of a VQ-GAN's validation."""

import pytest
import torch
import torch.nn.functional as F
from diffusers import VQModel
from safetensors.torch import save_file

from training_utils.errors import UsageError
from training_utils.testing.tiny.vqgan import TINY_DISCRIMINATOR, TINY_VGG_LAYOUT, TINY_VQMODEL
from training_utils.vqgan import (Discriminator, VGGFeatures, VQReconstructionPipeline, adaptive_weight,
                                  check_vgg_source, discriminator_loss, frozen, gradient_penalty, load_vgg,
                                  perceptual_loss, reconstruction_loss, to_pil, vgg_layout, vgg_taps)

# timm's cfgs["vgg19"], and where timm's VGG19 has its convolutions and its feature taps (feature_info's modules:
# the ReLU before each max pool, then the last max pool).
VGG19 = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]
VGG19_CONVOLUTIONS = [0, 2, 5, 7, 10, 12, 14, 16, 19, 21, 23, 25, 28, 30, 32, 34]
VGG19_TAPS = [3, 8, 17, 26, 35, 36]


def discriminator():
    torch.manual_seed(0)
    return Discriminator(**{key: value for key, value in TINY_DISCRIMINATOR.items() if not key.startswith("_")})


def test_the_discriminator_has_upstreams_layers_for_upstreams_config():
    weights = {name: tuple(tensor.shape) for name, tensor in discriminator().state_dict().items()
               if name.endswith("original") or name.startswith("shuffle")}
    # Paella's widths for hidden_channels 8, depth 4: 8 // 2**3 up to 8, one stride-2 convolution each.
    assert weights == {"encoder.0.parametrizations.weight.original": (1, 3, 3, 3),
                       "encoder.2.parametrizations.weight.original": (2, 1, 3, 3),
                       "encoder.5.parametrizations.weight.original": (4, 2, 3, 3),
                       "encoder.8.parametrizations.weight.original": (8, 4, 3, 3),
                       "shuffle.weight": (1, 8, 1, 1), "shuffle.bias": (1,)}
    scores = discriminator()(torch.randn(2, 3, 32, 32))
    assert scores.shape == (2, 1, 2, 2) and ((scores > 0) & (scores < 1)).all()


def test_a_conditioned_discriminator_takes_a_vector_per_image():
    model = Discriminator(hidden_channels=8, depth=4, cond_channels=5)
    assert model(torch.randn(2, 3, 32, 32), torch.randn(2, 5)).shape == (2, 1, 2, 2)


def test_the_discriminator_saves_and_loads_whole_its_spectral_norm_state_included(tmp_path):
    model = discriminator()
    images = torch.randn(2, 3, 32, 32)
    model(images)  # a power iteration: the spectral norms' vectors move on
    model.save_pretrained(tmp_path)
    loaded = Discriminator.from_pretrained(tmp_path)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in model.state_dict().items())
    assert torch.equal(loaded.eval()(images), model.eval()(images))


def test_the_vgg_is_laid_out_as_timms_and_its_layout_read_back_from_its_weights():
    with torch.device("meta"):
        vgg = VGGFeatures(VGG19, range(6))
    state = vgg.state_dict()
    assert sorted({int(name.split(".")[1]) for name in state}) == VGG19_CONVOLUTIONS
    assert vgg.tap_ends == VGG19_TAPS
    assert vgg_layout(state) == VGG19
    # Upstream's default --timm_model_layers head: the third tap, the ReLU before the third max pool (256 channels).
    assert vgg_taps("head") == [2] and vgg_taps("features|head") == [0, 2] and vgg_taps("head", 1) == [1]


def test_the_vgg_runs_only_up_to_its_last_tap_and_returns_the_taps_in_the_order_asked():
    torch.manual_seed(0)
    vgg = VGGFeatures(TINY_VGG_LAYOUT, [2, 0])
    assert len(vgg.features) == vgg.tap_ends[0] + 1
    features = vgg(torch.randn(1, 3, 32, 32))
    assert [feature.shape for feature in features] == [(1, 8, 8, 8), (1, 4, 32, 32)]


def test_weights_of_anything_but_a_vgg_without_batch_norm_are_refused():
    with pytest.raises(ValueError, match="features.1"):  # vgg11_bn: a batch norm after each convolution
        vgg_layout({"features.0.weight": torch.zeros(4, 3, 3, 3), "features.1.weight": torch.zeros(4)})
    with pytest.raises(ValueError, match="no features"):
        vgg_layout({"conv1.weight": torch.zeros(4, 3, 3, 3)})
    with pytest.raises(ValueError, match="taps"):
        VGGFeatures(TINY_VGG_LAYOUT, [6])


def test_the_vgg_loads_from_a_timm_weights_file_ignoring_its_classifier(tmp_path):
    torch.manual_seed(0)
    source = VGGFeatures(TINY_VGG_LAYOUT, [5])
    save_file({**{f"features.{name}": tensor for name, tensor in source.features.state_dict().items()},
               "head.fc.weight": torch.zeros(10, 8)}, tmp_path / "model.safetensors")
    vgg = load_vgg(tmp_path, [2])
    assert not any(parameter.requires_grad for parameter in vgg.parameters()) and not vgg.training
    images = torch.randn(1, 3, 32, 32)
    assert torch.equal(vgg(images)[0], source.features[:vgg.tap_ends[0] + 1](images))
    with pytest.raises(UsageError, match="timm's VGG without batch norm"):
        save_file({"features.0.weight": torch.zeros(4, 3, 3, 3), "features.1.weight": torch.zeros(4)},
                  tmp_path / "bn.safetensors")
        load_vgg(tmp_path / "bn.safetensors", [0])


def test_the_vgg_source_is_checked_before_anything_loads(tmp_path):
    for value in ("vgg19", "vgg19.tv_in1k", "vgg11", "someone/my-vgg"):
        check_vgg_source(value)
    for value in ("resnet50", "vgg19_bn", str(tmp_path / "missing.safetensors"), str(tmp_path)):
        with pytest.raises(UsageError, match="--timm_model_backend"):
            check_vgg_source(value)
    (tmp_path / "broken.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UsageError, match="a whole safetensors file"):
        check_vgg_source(str(tmp_path / "broken.safetensors"))
    with pytest.raises(UsageError, match="--timm_model_layers"):
        vgg_taps("features|classifier")


def test_the_perceptual_loss_compares_the_imagenet_normalized_features_at_224_pixels():
    torch.manual_seed(0)
    vgg = VGGFeatures(TINY_VGG_LAYOUT, [0, 2]).eval()
    images, reconstructions = torch.rand(2, 3, 32, 32) * 2 - 1, torch.rand(2, 3, 32, 32) * 2 - 1
    assert perceptual_loss(vgg, images, images) == 0
    mean, std = torch.tensor([0.485, 0.456, 0.406]).reshape(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225])

    def features(pixels):
        return vgg(((F.interpolate(pixels, size=224) + 1) / 2 - mean) / std.reshape(1, 3, 1, 1))

    expected = sum(F.mse_loss(a, b) for a, b in zip(features(images), features(reconstructions))) / 2
    assert torch.allclose(perceptual_loss(vgg, images, reconstructions), expected, rtol=1e-5)


def test_the_pixel_losses():
    images, reconstructions = torch.zeros(1, 3, 2, 2), torch.full((1, 3, 2, 2), 0.5)
    assert reconstruction_loss(images, reconstructions) == 0.25
    assert reconstruction_loss(images, reconstructions, "l1") == 0.5


def test_the_gradient_penalty_holds_the_discriminators_slope_near_one():
    weight = torch.tensor([3.0, 4.0])  # a linear score of slope |w| = 5 everywhere

    images = torch.randn(4, 2, requires_grad=True)
    assert gradient_penalty(images, images @ weight) == 10 * (5 - 1) ** 2
    assert gradient_penalty(images, images @ (weight / 5)) == 0


def test_the_discriminator_loss_is_the_hinge_on_real_and_reconstructed_images_plus_the_penalty():
    def scores(images):  # 0.25 for the real (all ones), 0.75 for the fake (all zeros); slope 0.25
        return 0.75 - 0.5 * images.mean(dim=(1, 2, 3), keepdim=True)

    real, fake = torch.ones(2, 1, 2, 2), torch.zeros(2, 1, 2, 2)
    loss, penalty = discriminator_loss(scores, real, fake)
    # |d score / d image| = 0.5 / 4 per pixel over 4 pixels: 0.25.
    assert penalty.item() == pytest.approx(10 * (0.25 - 1) ** 2)
    assert loss.item() == pytest.approx((1 + 0.75) + (1 - 0.25) + penalty.item())


def test_the_adaptive_weight_matches_the_adversarial_gradient_to_the_perceptual_one():
    layer = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    perceptual, adversarial = (layer * torch.tensor([6.0, 8.0])).sum(), (layer * torch.tensor([0.6, 0.8])).sum()
    assert adaptive_weight(perceptual, adversarial, layer) == pytest.approx(10.0)
    assert adaptive_weight(perceptual, adversarial * 0, layer) == 1e4  # no adversarial gradient: the limit


def test_a_frozen_discriminator_gets_no_gradient_and_trains_again_after():
    model = discriminator()
    images = torch.randn(1, 3, 32, 32, requires_grad=True)
    with frozen(model):
        model(images).mean().backward()
    assert images.grad is not None and all(parameter.grad is None for parameter in model.parameters())
    assert all(parameter.requires_grad for parameter in model.parameters())


def test_the_reconstruction_pipeline_renders_what_the_vqmodel_reconstructs():
    torch.manual_seed(0)
    vqmodel = VQModel.from_config(TINY_VQMODEL).eval()
    pixels = torch.rand(3, 32, 32) * 2 - 1
    images = VQReconstructionPipeline(vqmodel)("a name", image=pixels, num_images_per_prompt=2).images
    with torch.no_grad():
        expected = to_pil(vqmodel(pixels[None]).sample)[0]
    assert len(images) == 2 and all(list(image.getdata()) == list(expected.getdata()) for image in images)
    assert expected.size == (32, 32) and expected.mode == "RGB"
