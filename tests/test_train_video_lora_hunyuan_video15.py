"""Smoke tests of the HunyuanVideo 1.5 LoRA scripts on the tiny pipelines (the family's real 16× by 4× VAE) and the
moving-shapes clips at ``--num_frames 9``, the runs launched together:

- full: text-to-video, 3 steps with EMA, validating videos at step 2 and at the end, checkpointing at step 2;
- resumed: the full run resumed from its checkpoint-2;
- i2v: the image-to-video script, 2 steps with cached latents, validating from the first clip's first frame at its
  last step.

The pipelines have no ``load_lora_weights``: a LoRA loads with the transformer's ``load_lora_adapter``, as the model
card says.
"""

import functools
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from helpers import launch, launch_together, launching, together, usage_error
from training_utils.data.rendered_video import write_mp4
from training_utils.data.video import probe
from training_utils.testing import assert_same_files, assert_validated_at, checkpoint_names
from training_utils.testing.tiny.video import moving_shape

SCRIPT = "video/train_text_to_video_lora_hunyuan_video15.py"
I2V_SCRIPT = "video/train_image_to_video_lora_hunyuan_video15.py"
LORA = "pytorch_lora_weights.safetensors"
PROMPT = "a red circle on a white background"


def common(tiny, output_dir, *extra, model="hunyuan_video15", steps=3):
    return ["--pretrained_model_name_or_path", tiny[model], "--train_data_dir", tiny["moving_shapes"],
            "--output_dir", output_dir, "--resolution", 32, "--num_frames", 9, "--learning_rate", 1e-3,
            "--center_crop", "--seed", 3, "--max_train_steps", steps, *extra]


def validation(*extra):
    return ["--validation_prompt", PROMPT, "--num_validation_images", 1, "--validation_inference_steps", 2, *extra]


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("hunyuan_video15")
    results = together({
        "full": functools.partial(launch, SCRIPT, *common(
            tiny, root / "full", "--use_ema", "--ema_decay", 0.9, *validation("--validation_steps", 2),
            "--checkpointing_steps", 2)),
        "i2v": functools.partial(launch, I2V_SCRIPT, *common(
            tiny, root / "i2v", "--cache_latents", "--checkpointing_steps", 1000, *validation(),
            model="hunyuan_video15_i2v", steps=2)),
    })
    shutil.copytree(root / "full" / "checkpoint-2", root / "resumed" / "checkpoint-2")
    results.update(launch_together({"resumed": (SCRIPT, *common(
        tiny, root / "resumed", "--use_ema", "--ema_decay", 0.9, "--checkpointing_steps", 1000,
        "--resume_from_checkpoint", "latest"))}))
    return {name: (root / name, result) for name, result in results.items()}


def render(pipe, **call_kwargs):
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt=PROMPT, num_inference_steps=2, num_frames=5, output_type="np",
                generator=torch.Generator().manual_seed(0), **call_kwargs).frames


def assert_lora_loads_and_changes_the_video(pipeline_class, base_model, lora_dir, **call_kwargs):
    """The adapter in ``lora_dir`` loads as the model card says (``pipe.transformer.load_lora_adapter``), and the
    pipeline's video with it differs from the base model's at the same seed."""
    pipe = pipeline_class.from_pretrained(base_model)
    before = render(pipe, **call_kwargs)
    pipe.transformer.load_lora_adapter(str(lora_dir), prefix=None, use_safetensors=True)
    after = render(pipe, **call_kwargs)
    assert np.isfinite(after).all() and np.abs(after - before).max() > 1e-7


def assert_videos_decode(output_dir, log, frames, size):
    for record in log:  # a decodable mp4 of the validation's frames, and its frame strip, not a blank
        assert probe(output_dir / record["videos"][0]) == (frames, 24.0, size)
        strip = Image.open(output_dir / record["images"][0])
        assert strip.size == (frames * size[0], size[1])
        assert len(np.unique(np.asarray(strip))) > 1


def test_writes_raw_and_ema_loras_and_validates_videos_at_the_due_steps(runs):
    output_dir, _ = runs["full"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys()
    # The transformer's own names (load_lora_adapter with no prefix): its blocks' and its token refiner's attention.
    assert {key.split(".attn.")[0] for key in raw} == {*(f"transformer_blocks.{block}" for block in (0, 1)),
                                                      "context_embedder.token_refiner.refiner_blocks.0"}
    assert {key.split(".attn.")[1].split(".")[0] for key in raw} == {"to_q", "to_k", "to_v", "to_out"}
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    log = assert_validated_at(output_dir, [2, 3], ("raw", "ema"), [PROMPT], num_images=1)
    assert_videos_decode(output_dir, log, 9, (32, 32))
    card = (output_dir / "README.md").read_text()
    assert "HunyuanVideo15Pipeline" in card and "load_lora_adapter" in card
    assert checkpoint_names(output_dir) == ["checkpoint-2"]


def test_the_text_to_video_loras_load_into_the_pipeline_and_change_its_video(tiny, runs):
    from diffusers import HunyuanVideo15Pipeline

    output_dir, _ = runs["full"]
    for lora_dir in (output_dir, output_dir / "ema"):
        assert_lora_loads_and_changes_the_video(HunyuanVideo15Pipeline, tiny["hunyuan_video15"], lora_dir,
                                                height=32, width=32)


def test_a_resumed_run_ends_with_the_weights_of_the_uninterrupted_one(runs):
    (output_dir, result), (straight_dir, _) = runs["resumed"], runs["full"]
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in result.stdout
    for name in (LORA, f"ema/{LORA}"):
        assert_same_files(output_dir / name, straight_dir / name)


def test_image_to_video_trains_on_cached_latents_and_validates_from_the_first_frame(tiny, runs):
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    output_dir, _ = runs["i2v"]
    lora = load_file(output_dir / LORA)
    assert lora.keys() == load_file(runs["full"][0] / LORA).keys()
    log = assert_validated_at(output_dir, [2], ("raw",), [PROMPT], num_images=1)
    assert_videos_decode(output_dir, log, 9, (32, 32))
    first_frame = Image.open(output_dir / "validation" / "conditioning-p00.png")
    assert first_frame.size == (32, 32)
    assert "HunyuanVideo15ImageToVideoPipeline" in (output_dir / "README.md").read_text()
    assert_lora_loads_and_changes_the_video(HunyuanVideo15ImageToVideoPipeline, tiny["hunyuan_video15_i2v"],
                                            output_dir, image=first_frame)


def test_a_resolution_the_vae_does_not_take_fails_in_one_line(tiny, tmp_path):
    message = usage_error(SCRIPT, *common(tiny, tmp_path / "out", "--resolution", 24))
    assert message == ("error: --resolution=24: expected a multiple of 16 (the VAE divides sides by 16, and the "
                       "pipeline takes whole patches)")
    assert not (tmp_path / "out").exists()


def test_a_clip_too_short_for_a_frame_bucket_is_named_before_anything_loads(tiny, tmp_path):
    data_dir = tmp_path / "clips"
    data_dir.mkdir()
    write_mp4(data_dir / "short.mp4", moving_shape("square", "red", "white", 3), fps=8)
    (data_dir / "short.txt").write_text("a short clip")
    args = common(tiny, tmp_path / "out")
    args[args.index("--train_data_dir") + 1] = data_dir
    message = usage_error(SCRIPT, *args)
    assert message.startswith(f"error: --train_data_dir={str(data_dir)!r}: expected readable videos of 5 frames")
    assert f"{data_dir / 'short.mp4'} (too short: 3 frames sampled, 5 needed)" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script, flags, message", [
    (SCRIPT, ["--validation_guidance_scale", 5], "--validation_guidance_scale=5.0: expected none: "
     "HunyuanVideo15Pipeline takes its guidance from its guider component (guider/config.json's guidance_scale)"),
    (I2V_SCRIPT, ["--validation_height", 32], "--validation_height/--validation_width='32/None': expected none: the "
     "pipeline renders at the size its transformer's target_size picks for the validation image's aspect ratio"),
])
def test_validation_settings_the_pipelines_do_not_take_fail_in_one_line(tiny, tmp_path, script, flags, message):
    model = "hunyuan_video15" if script == SCRIPT else "hunyuan_video15_i2v"
    assert usage_error(script, *common(tiny, tmp_path / "out", *flags, model=model)) == f"error: {message}"


def test_a_model_the_scripts_do_not_train_is_refused_before_anything_loads(tiny, tmp_path):
    text_to_video = str(tiny["hunyuan_video15"])
    message = usage_error(I2V_SCRIPT, *common(tiny, tmp_path / "out"))
    assert message == (f"error: --pretrained_model_name_or_path={text_to_video!r}: expected a "
                       "HunyuanVideo15ImageToVideoPipeline (it is a HunyuanVideo15Pipeline)")
    distilled = tmp_path / "distilled"
    shutil.copytree(text_to_video, distilled)
    config_file = distilled / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "use_meanflow": True}))
    args = common(tiny, tmp_path / "out")
    args[args.index("--pretrained_model_name_or_path") + 1] = distilled
    assert usage_error(SCRIPT, *args).startswith(f"error: --pretrained_model_name_or_path={str(distilled)!r}: "
                                                 "expected a transformer trained by flow matching (its use_meanflow")
    assert not (tmp_path / "out").exists()
