"""training_utils.families.hunyuan_video15: the prompt rows and the transformer's inputs are the pipelines' own, as
their loops pass them at the first step (the tiny pipelines, the guider at scale 1: one conditional call a step)."""

import pytest
import torch
from PIL import Image

from training_utils.families import hunyuan_video15
from training_utils.testing.tiny.hunyuan_video15 import hunyuan_video15_i2v_pipeline, hunyuan_video15_pipeline

PROMPTS = ["a red circle on a white background", 'a sign that says "open"']


@pytest.fixture(scope="module")
def pipe():
    pipe = hunyuan_video15_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def capture_first_call(pipe, monkeypatch, **call_kwargs):
    """The keyword arguments of the transformer's first call in ``pipe(**call_kwargs)``."""
    calls = []

    def forward(**inputs):
        calls.append(inputs)
        return (torch.zeros_like(inputs["hidden_states"][:, :pipe.transformer.config.out_channels]),)

    monkeypatch.setattr(pipe.transformer, "forward", forward)
    pipe(num_inference_steps=2, output_type="latent", **call_kwargs)
    return calls[0]


def test_prompt_rows_are_the_pipelines_encode_prompt(pipe):
    settings = hunyuan_video15.prompt_settings(pipe, None)
    with torch.no_grad():
        rows = hunyuan_video15.encode_prompts(pipe, PROMPTS, "cpu", settings)
        expected = pipe.encode_prompt(PROMPTS, device="cpu", batch_size=2)
    assert len(rows) == len(expected) == 4
    for row, reference in zip(rows, expected):
        assert torch.equal(row, reference)
    assert not torch.equal(rows[0][0], rows[0][1])
    assert rows[3][0].sum() == 0 and rows[3][1].sum() > 0  # glyph tokens only for the quoted text
    text = hunyuan_video15.text_inputs(list(zip(*rows)))
    assert [text[name].shape[0] for name in text] == [2, 2, 2, 2]


def test_text_to_video_inputs_are_what_the_pipeline_passes_its_transformer(pipe, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(1, 4, 3, 2, 2, generator=generator)  # 9 frames of 32x32 pixels
    call = capture_first_call(pipe, monkeypatch, prompt=PROMPTS[0], height=32, width=32, num_frames=9,
                              latents=noise.clone())
    with torch.no_grad():
        rows = hunyuan_video15.encode_prompts(pipe, PROMPTS[:1], "cpu", {})
    text = hunyuan_video15.text_inputs(list(zip(*rows)))
    # The first step is at sigma 1: the latents are the noise alone.
    assert float(pipe.scheduler.sigmas[0]) == 1.0
    expected = hunyuan_video15.model_inputs(pipe, noise, pipe.scheduler.timesteps[:1], text)
    assert expected.keys() <= call.keys()
    for name, value in expected.items():
        assert torch.equal(call[name], value), name


def test_image_to_video_inputs_are_the_pipelines_conditioning_on_its_image(monkeypatch):
    pipe = hunyuan_video15_i2v_pipeline()
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    image = Image.fromarray(torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8).numpy())
    first_frame = pipe.video_processor.preprocess(image, height=32, width=32)  # what training lays out: [-1, 1]
    noise = torch.randn(1, 4, 3, 2, 2, generator=generator)
    call = capture_first_call(pipe, monkeypatch, image=image, prompt=PROMPTS[0], num_frames=9, latents=noise.clone())
    with torch.no_grad():
        rows = hunyuan_video15.encode_prompts(pipe, PROMPTS[:1], "cpu", {})
        conditioning = hunyuan_video15.image_to_video_conditioning(pipe, first_frame, noise)
    text = hunyuan_video15.text_inputs(list(zip(*rows)))
    expected = hunyuan_video15.image_to_video_inputs(pipe, noise, pipe.scheduler.timesteps[:1], text, conditioning)
    assert conditioning["mask"][:, :, 0].eq(1).all() and conditioning["mask"][:, :, 1:].eq(0).all()
    assert conditioning["condition"][:, :, 0].abs().sum() > 0
    for name, value in expected.items():
        assert torch.equal(call[name], value), name
