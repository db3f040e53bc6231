"""The offline fixtures of training_utils.testing.tiny: a usable tokenizer, a pipeline that renders, a true dataset."""

import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from training_utils.testing import tiny as tiny_module
from training_utils.testing.tiny import main
from training_utils.testing.tiny.data import BACKGROUNDS, COLORS, SHAPES
from training_utils.testing.tiny.parts import tiny_clip_tokenizer

@pytest.mark.parametrize(
    "first, second",
    [
        ("a red circle", "a blue circle"),
        ("a red circle", "a red square"),
        ("a green triangle on a white background", "a green triangle on a black background"),
        ("a photo of sks dog", "a photo of a dog"),
        ("a purple square", "a orange square"),
        ("a yellow circle", "a gray circle"),
    ],
)
def test_distinct_prompts_tokenize_to_distinct_ids(tiny_sd_pipe, first, second):
    tokenizer = tiny_sd_pipe.tokenizer
    first_ids, second_ids = tokenizer(first).input_ids, tokenizer(second).input_ids
    assert first_ids != second_ids
    assert len(first_ids) == len(first.split()) + 2  # every word one token, plus start and end
    assert len(second_ids) == len(second.split()) + 2
    # CLIP's unknown token is its end token: it may only close the sequence
    assert tokenizer.unk_token_id not in first_ids[1:-1] + second_ids[1:-1]


def test_vocabulary_words_are_single_tokens(tiny_sd_pipe):
    tokenizer = tiny_sd_pipe.tokenizer
    words = list(COLORS) + list(BACKGROUNDS) + list(SHAPES) + ["sks", "dog", "background"]
    for word in words:
        ids = tokenizer(word, add_special_tokens=False).input_ids
        assert len(ids) == 1, word
    ids = [tokenizer(word, add_special_tokens=False).input_ids[0] for word in words]
    assert len(set(ids)) == len(ids)


def test_tokenizer_round_trips_unknown_text(tiny_sd_pipe):
    tokenizer = tiny_sd_pipe.tokenizer
    text = "zebra purple"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True).strip() == text


def test_model_max_length(tiny_sd_pipe):
    assert tiny_sd_pipe.tokenizer.model_max_length == 77
    assert tiny_clip_tokenizer(["red"]).model_max_length == 77
    assert tiny_sd_pipe.text_encoder.config.max_position_embeddings == 77
    assert tiny_sd_pipe.text_encoder.config.vocab_size == len(tiny_sd_pipe.tokenizer)


def test_pipeline_renders_32x32(tiny):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    pipe.set_progress_bar_config(disable=True)

    def render(seed, prompt="a red circle"):
        return pipe(prompt, height=32, width=32, num_inference_steps=2, guidance_scale=1.0,
                    generator=torch.Generator().manual_seed(seed), output_type="np").images

    images = render(0)
    assert images.shape == (1, 32, 32, 3)
    assert np.isfinite(images).all()
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert images.std() > 0
    assert np.array_equal(render(0), images)
    assert not np.array_equal(render(1), images)


def test_pipeline_components(tiny_sd_pipe):
    assert type(tiny_sd_pipe.scheduler).__name__ == "PNDMScheduler"
    assert tiny_sd_pipe.vae.config.latent_channels == tiny_sd_pipe.unet.config.in_channels == 4
    assert tiny_sd_pipe.unet.config.cross_attention_dim == tiny_sd_pipe.text_encoder.config.hidden_size
    assert tiny_sd_pipe.safety_checker is None


def caption_words(caption):
    words = caption.split()
    color = [w for w in words if w in COLORS]
    shape = [w for w in words if w in SHAPES]
    background = [w for w in words if w in BACKGROUNDS]
    return color, shape, background


def test_shapes_dataset_captions_describe_the_images(tiny):
    folder = Path(tiny["shapes"])
    records = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    assert len(records) >= 24
    assert len({record["file_name"] for record in records}) == len(records)
    fill_ratios = {shape: [] for shape in SHAPES}
    for record in records:
        color, shape, background = caption_words(record["text"])
        assert len(color) == 1 and len(shape) == 1 and len(background) == 1, record["text"]
        pixels = np.asarray(Image.open(folder / record["file_name"]).convert("RGB"))
        assert pixels.shape == (64, 64, 3)
        corners = [tuple(pixels[y, x]) for y, x in ((0, 0), (0, -1), (-1, 0), (-1, -1))]
        assert all(corner == BACKGROUNDS[background[0]] for corner in corners), record
        mask = np.all(pixels == COLORS[color[0]], axis=-1)
        assert mask.sum() > 64, record  # the named colour is really there
        ys, xs = np.nonzero(mask)
        box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
        fill_ratios[shape[0]].append(mask.sum() / box)
    # a square fills its bounding box, a circle about pi/4 of it, a triangle about half
    assert all(ratio > 0.97 for ratio in fill_ratios["square"])
    assert all(0.70 < ratio < 0.85 for ratio in fill_ratios["circle"])
    assert all(0.40 < ratio < 0.62 for ratio in fill_ratios["triangle"])
    assert all(fill_ratios[shape] for shape in SHAPES)
    assert len({caption_words(record["text"])[0][0] for record in records}) == len(COLORS)


@pytest.mark.parametrize("shapes", [SHAPES, ("circle", "square")])
def test_shapes_dataset_takes_the_shapes_colours_backgrounds_and_sizes_asked(tmp_path, shapes):
    from training_utils.testing.tiny.data import LARGE_EXTENT, build_shapes

    build_shapes(tmp_path, num_images=12, extent=LARGE_EXTENT, colors=("red", "blue"), backgrounds=("black",),
                 shapes=shapes)
    records = [json.loads(line) for line in (tmp_path / "metadata.jsonl").read_text().splitlines()]
    words = [caption_words(record["text"]) for record in records]
    assert {color[0] for color, _, _ in words} == {"red", "blue"} and {b[0] for _, _, b in words} == {"black"}
    assert {shape[0] for _, shape, _ in words} == set(shapes)
    for record, (color, _, _) in zip(records, words):
        ys, xs = np.nonzero(np.all(np.asarray(Image.open(tmp_path / record["file_name"]).convert("RGB")) ==
                                   COLORS[color[0]], axis=-1))
        assert LARGE_EXTENT[0] - 1 <= max(ys.max() - ys.min(), xs.max() - xs.min()) <= LARGE_EXTENT[1] + 1


def test_build_is_deterministic(tmp_path):
    first = tiny_module.build(tmp_path / "a", ["shapes"])
    second = tiny_module.build(tmp_path / "b", ["shapes"])
    assert set(first) == {"shapes"}
    names = sorted(p.name for p in first["shapes"].iterdir())
    assert names == sorted(p.name for p in second["shapes"].iterdir())
    for name in names:
        assert (first["shapes"] / name).read_bytes() == (second["shapes"] / name).read_bytes(), name


def test_main_unknown_name_exits_non_zero(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--output_dir", str(tmp_path), "sd", "no_such_fixture"])
    assert exited.value.code != 0
    assert "no_such_fixture" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing built before the name was checked


def test_main_builds_named_fixture(tmp_path, capsys):
    main(["--output_dir", str(tmp_path), "shapes"])
    assert capsys.readouterr().out.strip() == f"shapes: {tmp_path / 'shapes'}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shapes"]
    assert (tmp_path / "shapes" / "metadata.jsonl").is_file()


def test_module_cli_unknown_name(tmp_path, monkeypatch, capsys):
    # As `python -m training_utils.testing.tiny` runs it (its __main__), in this process.
    monkeypatch.setattr(sys, "argv", ["tiny", "--output_dir", str(tmp_path), "bogus"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("training_utils.testing.tiny", run_name="__main__", alter_sys=True)
    assert exited.value.code != 0
    assert "unknown fixture 'bogus'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def tiny_flux2_klein_pipe(tiny):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(tiny["flux2_klein"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_flux2_klein_tokenizer_keeps_words_whole_and_wraps_prompts_in_qwen3s_chat_format(tiny_flux2_klein_pipe):
    tokenizer = tiny_flux2_klein_pipe.tokenizer
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    first, second = "a photo of sks triangle", "a photo of a triangle"
    first_ids, second_ids = tokenizer(first).input_ids, tokenizer(second).input_ids
    assert first_ids != second_ids and len(first_ids) == len(first.split())
    for word in list(COLORS) + list(BACKGROUNDS) + list(SHAPES) + ["sks", "dog", "photo"]:
        assert len(tokenizer(word).input_ids) == len(tokenizer(" " + word).input_ids) == 1, word
    text = tokenizer.apply_chat_template([{"role": "user", "content": first}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    assert text == f"<|im_start|>user\n{first}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tokenizer.decode(tokenizer("zebra purple").input_ids) == "zebra purple"


def test_flux2_klein_components_fit_together_as_klein_does(tiny_flux2_klein_pipe):
    pipe = tiny_flux2_klein_pipe
    transformer, text_encoder, vae = pipe.transformer.config, pipe.text_encoder.config, pipe.vae
    assert transformer.in_channels == 4 * vae.config.latent_channels and not transformer.guidance_embeds
    # The pipeline's default hidden layers (9, 18, 27) exist and together make the transformer's text features.
    assert text_encoder.num_hidden_layers >= 27 and transformer.joint_attention_dim == 3 * text_encoder.hidden_size
    assert text_encoder.vocab_size == len(pipe.tokenizer)
    assert not torch.equal(vae.bn.running_mean, torch.zeros_like(vae.bn.running_mean))
    assert pipe.scheduler.config.use_dynamic_shifting and not pipe.config.is_distilled


def test_flux2_klein_pipeline_renders_32x32(tiny_flux2_klein_pipe):
    def render(seed, prompt="a red circle"):
        return tiny_flux2_klein_pipe(prompt=prompt, height=32, width=32, num_inference_steps=2, max_sequence_length=16,
                                     generator=torch.Generator().manual_seed(seed), output_type="np").images

    images = render(0)
    assert images.shape == (1, 32, 32, 3) and np.isfinite(images).all() and images.std() > 0
    assert np.array_equal(render(0), images)
    assert not np.array_equal(render(1), images) and not np.array_equal(render(0, "a blue square"), images)


def test_flux2_dev_is_laid_out_as_released_its_tokenizer_a_pixtral_processor(tiny):
    """As diffusers' conversion saves FLUX.2-dev: ``tokenizer`` is Mistral's processor (tokenizer, Pixtral's image
    processor and the processor's settings, in one folder), whose tokenizer with its chat template loads alone."""
    from transformers import AutoTokenizer

    folder = tiny["flux2_dev"]
    assert json.loads((folder / "model_index.json").read_text())["tokenizer"] == ["transformers", "PixtralProcessor"]
    processor = json.loads((folder / "tokenizer" / "processor_config.json").read_text())
    assert processor["processor_class"] == "PixtralProcessor"
    image_processor = json.loads((folder / "tokenizer" / "preprocessor_config.json").read_text())
    assert image_processor["image_processor_type"] == "PixtralImageProcessor"
    tokenizer = AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")
    assert "[SYSTEM_PROMPT]" in tokenizer.chat_template
    assert all(tokenizer.convert_tokens_to_ids(processor[key]) != tokenizer.unk_token_id
               for key in ("image_token", "image_break_token", "image_end_token"))


def test_wan_i2v_names_its_image_processor_as_released_and_loads_without_torchvision(tiny):
    from diffusers import WanImageToVideoPipeline

    index = json.loads((tiny["wan_i2v"] / "model_index.json").read_text())
    assert index["image_processor"] == ["transformers", "CLIPImageProcessor"]
    pipe = WanImageToVideoPipeline.from_pretrained(tiny["wan_i2v"])
    assert pipe.image_processor(Image.new("RGB", (40, 24)), return_tensors="pt").pixel_values.shape == (1, 3, 32, 32)
