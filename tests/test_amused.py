"""training_utils.amused: upstream's masking schedule, masked tokens and loss, micro-conditioning and LoRA file."""

import math

import torch
import torch.nn.functional as F
from PIL import Image
from safetensors import safe_open

from training_utils import amused


def test_masking_rate_is_the_cosine_schedule_floored_at_the_minimum():
    timesteps = torch.tensor([0.0, 1 / 3, 0.5, 1.0])
    expected = torch.tensor([1.0, math.cos(math.pi / 6), math.cos(math.pi / 4), math.cos(math.pi / 2)])
    assert torch.allclose(amused.masking_rate(timesteps), expected)
    assert torch.allclose(amused.masking_rate(timesteps, 0.8), expected.clip(0.8))


def test_mask_tokens_masks_the_scheduled_count_with_the_mask_id_and_labels_only_those():
    torch.manual_seed(0)
    tokens = torch.randint(0, 8, (64, 16))
    input_ids, labels, rate = amused.mask_tokens(tokens, 31)
    masked = input_ids == 31
    assert torch.equal(masked.sum(-1), (16 * rate).round().clamp(min=1).long())
    assert torch.equal(labels[masked], tokens[masked]) and (labels[~masked] == amused.IGNORED).all()
    assert torch.equal(input_ids[~masked], tokens[~masked])
    _, _, floored = amused.mask_tokens(tokens, 31, min_masking_rate=0.9)
    assert (floored >= 0.9).all()


def test_token_loss_is_the_cross_entropy_on_masked_tokens_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 8, 2, 2)
    labels = torch.tensor([[3, -100, 1, -100], [-100, -100, -100, 7]])
    picked = [(0, 0, 3), (0, 2, 1), (1, 3, 7)]
    expected = torch.stack([F.cross_entropy(logits[b].reshape(8, 4)[:, i], torch.tensor(t)) for b, i, t in picked])
    assert torch.allclose(amused.token_loss(logits, labels), expected.mean())


def test_process_image_crops_a_square_and_gives_the_original_size_and_crop_as_micro_conditioning():
    image = Image.new("RGB", (40, 20), "white")
    image.putpixel((39, 19), (255, 0, 0))
    pixels, micro = amused.process_image(image, 10, torch.Generator().manual_seed(0))
    top, left = int(micro[2]), int(micro[3])
    assert pixels.shape == (3, 10, 10) and 0 <= pixels.min() and pixels.max() <= 1
    assert micro.tolist() == [40, 20, top, left, 6.0] and top == 0 and 0 <= left <= 10


def test_the_mask_id_is_the_transformers_last_and_the_schedulers(tiny):
    from diffusers import AmusedPipeline

    pipe = AmusedPipeline.from_pretrained(tiny["amused"])
    assert amused.mask_token_id(pipe.transformer) == pipe.scheduler.config.mask_token_id == 31
    assert pipe.vae_scale_factor == 16


def test_lora_writer_keeps_the_adapter_config_in_the_file(tmp_path):
    layers = {"layer.lora_A.weight": torch.ones(2, 3)}
    amused.AmusedLoraWriter.save_lora_weights(tmp_path, transformer_lora_layers=layers,
                                              transformer_lora_adapter_metadata={"r": 2, "lora_alpha": 4.0},
                                              weight_name="w.safetensors")
    with safe_open(tmp_path / "w.safetensors", "pt") as file:
        assert list(file.keys()) == ["transformer.layer.lora_A.weight"]
        assert '"transformer.lora_alpha": 4.0' in file.metadata()["lora_adapter_metadata"]


def test_validation_renders_an_amused_pipeline_one_generator_a_call():
    from diffusers import AmusedPipeline, StableDiffusionPipeline

    from training_utils.validation import takes_generator_list

    assert not takes_generator_list(AmusedPipeline) and takes_generator_list(StableDiffusionPipeline)
