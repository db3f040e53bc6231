"""training_utils.families.qwen_image_edit: Qwen-Image-Edit's references reach the prompt and the image stream as
the pipelines put them.

The central check: sampling with a transformer that predicts exactly the training target follows the training
path, and at every step the transformer gets what training gives it: the target's tokens then the references',
their ``img_shapes``, and the prompt encoded with the references."""

import contextlib
import functools
import json

import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from PIL import Image, ImageOps

from helpers import family_args
from training_utils.args import training_parser
from training_utils.data.edit import add_edit_args, check_edit_args, edit_rows_from_args
from training_utils.data.edit_samples import embeddings_with_references
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import read_image
from training_utils.errors import UsageError
from training_utils.families import qwen_image_edit
from training_utils.flow_matching import add_noise, velocity

INSTRUCTION = "a purple triangle on a white background"
# The references' area for the VAE in the tests (--reference_area): 32×32 pixels for both references below (sides
# are multiples of 32), instead of the pipeline's 1024×1024, which the tiny VAE takes seconds to encode.
AREA = 32 * 32


def references():
    """Two references of other aspect ratios, a wide red one and a tall blue one."""
    return [Image.new("RGB", (48, 32), (255, 0, 0)), Image.new("RGB", (32, 64), (0, 0, 255))]


def load(tiny, name, pipeline_class):
    pipe = pipeline_class.from_pretrained(tiny[name], processor=qwen_image_edit.load_processor(tiny[name]))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def plus(tiny):
    return load(tiny, "qwen_image_edit_plus", QwenImageEditPlusPipeline)


@pytest.fixture(scope="module")
def edit(tiny):
    return load(tiny, "qwen_image_edit", QwenImageEditPipeline)


@pytest.fixture(scope="module")
def parse(tiny):
    return functools.partial(family_args, qwen_image_edit, tiny["qwen_image_edit_plus"])


def test_the_processor_loads_without_torchvision_and_the_tokenizer_drops_the_templates_system_turn(plus):
    assert type(plus.processor) is qwen_image_edit.QwenVLImageProcessor
    assert type(plus.processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    system_turn = plus.prompt_template_encode.split("{}")[0]
    tokens = plus.tokenizer.tokenize(system_turn)
    assert len(tokens) == plus.prompt_template_encode_start_idx == 64 and tokens[-2:] == ["user", "Ċ"]
    first, second = (plus.tokenizer(prompt).input_ids for prompt in ["a red circle", INSTRUCTION])
    assert first != second


def at_area(*pipes):
    """The pipelines' references at the tests' `AREA` while inside."""
    stack = contextlib.ExitStack()
    for pipe in pipes:
        stack.enter_context(qwen_image_edit.references_at_area(pipe, AREA))
    return stack


def test_reference_sizes_follow_the_pipelines_rules(plus, edit):
    wide, tall = references()
    # Edit Plus: about 384×384 for the text encoder, 1024×1024 for the VAE, at the reference's aspect ratio.
    assert qwen_image_edit.reference_sizes(plus, wide) == ((480, 320), (1248, 832))
    assert qwen_image_edit.reference_sizes(plus, tall) == ((256, 544), (736, 1440))
    assert qwen_image_edit.reference_sizes(edit, wide) == ((1248, 832), (1248, 832))
    with at_area(plus, edit):
        assert qwen_image_edit.reference_sizes(plus, wide) == ((480, 320), (32, 32))
        assert qwen_image_edit.reference_sizes(edit, tall) == ((32, 32), (32, 32))


def test_the_reference_layout_is_the_vaes_input_and_depends_on_the_area(plus, edit):
    wide = references()[0]
    with at_area(plus, edit):
        lay_out, small = qwen_image_edit.reference_layout(plus)
        pixels = lay_out(wide)
        others = [qwen_image_edit.reference_layout(edit)[1]]
    assert torch.equal(pixels, plus.image_processor.preprocess(wide, 32, 32)[0]) and pixels.shape == (3, 32, 32)
    others += [qwen_image_edit.reference_layout(pipe)[1] for pipe in (plus, edit)]
    assert len({json.dumps(dependencies, default=str) for dependencies in [small, *others]}) == 4


def test_a_bad_reference_area_fails_in_one_line(parse):
    with pytest.raises(UsageError) as error:
        parse("--reference_area", 100)
    assert str(error.value) == ("--reference_area=100: expected a number of pixels of at least 32*32 (the pipeline "
                                "rounds sides to multiples of 32)")


@pytest.mark.parametrize("count", [0, 1, 2])
def test_the_prompt_is_encoded_with_its_references_as_the_pipeline_encodes_it(plus, parse, count):
    settings = qwen_image_edit.prompt_settings(plus, parse("--reference_area", AREA))
    refs = references()[:count]
    with torch.no_grad(), at_area(plus):
        prompt_embeds, mask = qwen_image_edit.encode_prompts(plus, [(INSTRUCTION, refs), "a red circle"], "cpu",
                                                             settings)
        condition = [plus.image_processor.resize(ref, height, width)
                     for ref, (width, height) in zip(refs, [(480, 320), (256, 544)])]
        expected, _ = plus.encode_prompt(INSTRUCTION, image=condition or None)
        alone, _ = plus.encode_prompt("a red circle")
    # The references' vision tokens (the processor's patches of each, at most 8×8 pixels), each with "Picture n: ",
    # are among the prompt's tokens.
    assert expected.shape[1] == [12, 31, 48][count] and mask.sum(1).tolist() == [expected.shape[1], alone.shape[1]]
    assert torch.equal(prompt_embeds[0, : expected.shape[1]], expected[0]) and not prompt_embeds[1, 8:].any()
    assert torch.equal(prompt_embeds[1, : alone.shape[1]], alone[0])


def test_the_first_edit_encodes_its_one_reference_at_the_vaes_size(edit, parse):
    settings = qwen_image_edit.prompt_settings(edit, parse("--reference_area", AREA))
    with torch.no_grad(), at_area(edit):
        prompt_embeds, _ = qwen_image_edit.encode_prompts(edit, [(INSTRUCTION, references()[:1])], "cpu", settings)
        expected, _ = edit.encode_prompt(INSTRUCTION, image=edit.image_processor.resize(references()[0], 32, 32))
    assert torch.equal(prompt_embeds, expected)


def test_the_area_changes_the_pipelines_rule_only_inside(plus, edit):
    # Edit Plus: its module's area for the VAE; the first Edit: the area its call gives calculate_dimensions.
    for pipe, rule in [(plus, lambda module: module.VAE_IMAGE_SIZE),
                       (edit, lambda module: module.calculate_dimensions(1024 * 1024, 1.5)[:2])]:
        module = qwen_image_edit._pipeline_module(pipe)
        before = dict(vars(module))
        pipelines = rule(module)
        with qwen_image_edit.references_at_area(pipe, AREA):
            assert rule(module) == {plus: AREA, edit: (32, 32)}[pipe] != pipelines
        assert vars(module) == before
    with qwen_image_edit.references_at_area(plus, None):
        assert qwen_image_edit._pipeline_module(plus).VAE_IMAGE_SIZE == 1024 * 1024


def sampled_and_trained_inputs(pipe, settings, refs, monkeypatch, height=32, width=48):
    """The transformer's inputs at each step of the pipeline's sampling loop with a transformer that predicts the
    training target, and those that training computes at the same noise levels."""
    generator = torch.Generator().manual_seed(0)
    latent_height, latent_width = height // pipe.vae_scale_factor, width // pipe.vae_scale_factor
    vae_latents = torch.randn(1, 4, 1, latent_height, latent_width, generator=generator)
    latents = qwen_image_edit.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target_tokens = pipe._pack_latents(velocity(latents, noise), 1, 4, latent_height, latent_width)
    packed_noise = pipe._pack_latents(noise, 1, 4, latent_height, latent_width)
    calls, decoded = [], []

    def transformer_predicting_the_target(**inputs):
        calls.append(inputs)
        # The references' tokens' output follows the target's: the pipeline cuts it off, as training does.
        return (torch.cat([target_tokens, torch.randn_like(inputs["hidden_states"][:, target_tokens.shape[1]:])], 1),)

    def decode(latents, return_dict=True):
        decoded.append(latents)
        return (torch.zeros(1, 3, 1, height, width),)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    monkeypatch.setattr(pipe.vae, "decode", decode)
    with at_area(pipe):
        pipe(prompt=INSTRUCTION, height=height, width=width, num_inference_steps=3, latents=packed_noise,
             output_type="np", **qwen_image_edit.call_kwargs(pipe, settings),
             image=refs if type(pipe) is QwenImageEditPlusPipeline else refs[0])
    torch.testing.assert_close(decoded[0], vae_latents, rtol=0, atol=1e-5)
    output = calls[0]["hidden_states"]  # what an output of the inputs' layout reads back as, in the latents'
    assert torch.equal(qwen_image_edit.prediction(pipe, output, latents), pipe._unpack_latents(
        output[:, : packed_noise.shape[1]], height, width, pipe.vae_scale_factor))

    monkeypatch.undo()
    with torch.no_grad(), at_area(pipe):
        rows = list(zip(*qwen_image_edit.encode_prompts(pipe, [(INSTRUCTION, refs)], "cpu", settings)))
        # As training lays out and encodes them (`edit_samples.References`), one at a time.
        lay_out, vae = qwen_image_edit.reference_layout(pipe)[0], qwen_image_edit.image_vae(pipe)
        reference_latents = qwen_image_edit.reference_latents(
            pipe, [vae.encode(lay_out(ref)[None]).latent_dist.parameters for ref in refs])
    trained = [qwen_image_edit.model_inputs(pipe, add_noise(latents, noise, pipe.scheduler.sigmas[step]),
                                            pipe.scheduler.timesteps[step].expand(1), qwen_image_edit.text_inputs(rows),
                                            reference_latents) for step in range(len(calls))]
    return calls, trained


@pytest.mark.parametrize("pipeline, count", [("plus", 1), ("plus", 2), ("edit", 1)])
def test_sampling_towards_the_training_target_gets_the_training_inputs_with_references(request, parse, monkeypatch,
                                                                                       pipeline, count):
    pipe = request.getfixturevalue(pipeline)
    settings = qwen_image_edit.prompt_settings(pipe, parse("--reference_area", AREA))
    refs = references()[:count]
    calls, trained = sampled_and_trained_inputs(pipe, settings, refs, monkeypatch)
    # The target (32×48 pixels: 16×24 latents, 8×12 tokens), then each reference at about 32×32 pixels.
    reference_shapes = [(1, 8, 8), (1, 8, 8)][:count]
    for call, expected in zip(calls, trained):
        assert call["img_shapes"] == expected["img_shapes"] == [[(1, 8, 12), *reference_shapes]]
        assert call["hidden_states"].shape[1] == 96 + 64 * count
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        assert torch.equal(call["hidden_states"][:, 96:], expected["hidden_states"][:, 96:])
        assert torch.equal(call["timestep"], expected["timestep"])
        assert torch.equal(call["encoder_hidden_states"], expected["encoder_hidden_states"])
        assert call["encoder_hidden_states_mask"] is expected["encoder_hidden_states_mask"] is None


def test_each_rows_instructions_are_embedded_with_its_references_once_and_cached_on_disk(tiny, plus, parse, tmp_path):
    data = tiny["shapes_edit"]
    parser = training_parser("edit")
    add_edit_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", "unused", "--dataset_name", str(data),
                              "--cond_image_column", "reference", "--caption_column", "text"])
    check_edit_args(args)
    rows = edit_rows_from_args(args)
    rows = rows.select([0, 1, 2])  # one reference, two, none
    settings = qwen_image_edit.prompt_settings(plus, parse("--reference_area", AREA))
    encoded = []

    def encode(prompts):
        encoded.extend(prompts)
        return qwen_image_edit.encode_prompts(plus, prompts, "cpu", settings)

    def embeddings():
        encoders = FrozenEncoders(qwen_image_edit.image_vae(plus), [plus.text_encoder], None, "cpu", torch.float32,
                                  cache_dir=tmp_path / "features")
        return embeddings_with_references(encoders, rows, 0.5, encode,
                                          qwen_image_edit.prompt_dependencies(plus, settings), mirrored=True)

    found = embeddings()
    # Each row's instruction and the empty one, each with the row's references as they are and mirrored.
    assert sorted(found) == sorted((row, instruction, flip) for row, caption in enumerate(rows.captions)
                                   for instruction in (caption, "") for flip in (False, True))
    assert len(found) == 4 * len(rows.captions) and len(encoded) == len(found) + 1  # the first once more, to size it
    for row, instruction, flip in [(1, rows.captions[1], True), (1, "", False), (2, rows.captions[2], False)]:
        references = [read_image(reference) for reference in rows.references[row]]
        with torch.no_grad():
            expected = qwen_image_edit.encode_prompts(
                plus, [(instruction, [ImageOps.mirror(image) if flip else image for image in references])], "cpu",
                settings)
        embeds, mask = found[row, instruction, flip]
        torch.testing.assert_close(embeds[: int(mask.sum())], expected[0][0], rtol=1e-5, atol=1e-6)
        assert mask.sum() == expected[1].sum()
    # Mirrored references are what the text encoder sees: their embedding differs.
    assert not torch.equal(found[1, rows.captions[1], True][0], found[1, rows.captions[1], False][0])
    again = embeddings()  # a second run reads them back: the encoder does not run
    assert len(encoded) == len(found) + 1 and all(torch.equal(again[key][0], found[key][0]) for key in found)

