"""Pivotal tuning's pieces (`training_utils.pivotal`): the abstractions' tokens named and spelled out as upstream's,
refused before anything loads where they clash, started from a concept or at random, stopped bitwise at their step,
and written with the LoRA into files that read back as the parameters."""

import argparse

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusionXLPipeline
from safetensors.torch import load_file

from training_utils.adapters.export import adapter_export
from training_utils.adapters.injection import add_lora
from training_utils.errors import UsageError
from training_utils.pipeline import trainable_parameters
from training_utils.pivotal import (PivotalExport, PivotalTokens, TrainingStops, abstraction_tokens, check_new_tokens,
                                    embedding_file, stop_step)
from training_utils.posthoc_ema.synthesis import export_from_description

TOKENIZERS = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}


def options(abstraction="TOK", count=2, concept=None):
    return argparse.Namespace(token_abstraction=abstraction, num_new_tokens_per_abstraction=count,
                              initializer_concept=concept)


@pytest.fixture(scope="module")
def sdxl(tiny):
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_each_abstraction_names_its_tokens_on_from_the_last_as_upstream_does(sdxl):
    assert abstraction_tokens(options("TOK, SKS", 2), sdxl.tokenizer) == {"TOK": ["<s0>", "<s1>"],
                                                                          "SKS": ["<s2>", "<s3>"]}
    concept = len(sdxl.tokenizer.encode("a dog", add_special_tokens=False))
    assert abstraction_tokens(options("TOK", 5, "a dog"), sdxl.tokenizer) == {
        "TOK": [f"<s{index}>" for index in range(concept)]}


def test_tokens_a_tokenizer_has_are_refused_before_anything_loads(sdxl):
    with pytest.raises(UsageError, match="--token_abstraction"):
        check_new_tokens({"tokenizer": sdxl.tokenizer}, {"TOK": ["a</w>"]}, None)
    check_new_tokens({"tokenizer": sdxl.tokenizer}, {"TOK": ["<s0>"]}, "a dog")


def test_the_tokens_start_as_the_concept_and_prompts_spell_the_abstractions_out(tiny):
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"])
    base = [pipe.components[name].get_input_embeddings().weight.detach().clone() for name in TOKENIZERS]
    tokens = PivotalTokens(pipe, TOKENIZERS, {"TOK": ["<s0>", "<s1>"], "SKS": ["<s2>"]}, "a dog")
    ids = pipe.tokenizer.encode("a dog", add_special_tokens=False)
    for name, rows in zip(TOKENIZERS, base):
        weight = pipe.components[name].get_input_embeddings().weight
        assert torch.equal(weight[:len(rows)], rows)
        assert torch.equal(weight[len(rows):], rows[[ids[index % len(ids)] for index in range(3)]])
    assert tokens.replaced("a TOK next to SKS") == "a <s0><s1> next to <s2>"
    assert pipe.tokenizer.encode("<s0><s1>", add_special_tokens=False) == [len(base[0]), len(base[0]) + 1]
    random = PivotalTokens(StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"]), TOKENIZERS, {"TOK": ["<s0>"]},
                           seed=3)
    again = PivotalTokens(StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"]), TOKENIZERS, {"TOK": ["<s0>"]},
                          seed=3)
    assert torch.equal(random.embeddings["text_encoder"].new_rows, again.embeddings["text_encoder"].new_rows)


def test_a_stopped_parameter_stays_bitwise_under_adamw_with_weight_decay_while_the_others_go_on():
    torch.manual_seed(0)
    stopping, going = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    optimizer = torch.optim.AdamW([stopping, going], lr=0.1, weight_decay=0.1)
    stops = TrainingStops(optimizer, {stop_step(0.5, 4): [stopping]})
    seen = []
    for step in range(4):
        stops.at(step)
        ((stopping * going).sum() ** 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append((stopping.detach().clone(), going.detach().clone()))
    assert not torch.equal(seen[0][0], seen[1][0])
    assert torch.equal(seen[1][0], seen[2][0]) and torch.equal(seen[1][0], seen[3][0])
    assert not torch.equal(seen[2][1], seen[3][1])
    assert stop_step(0.1, 4) == 1 and stop_step(1.0, 4) == 4


def test_the_lora_and_the_rows_are_written_together_and_read_back_as_the_parameters(tiny, tmp_path):
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"])
    tokens = PivotalTokens(pipe, TOKENIZERS, {"TOK": ["<s0>", "<s1>"]}, seed=0)
    add_lora(pipe.unet, 2, ["to_q"])
    trained = {"unet": pipe.unet, "text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}
    lora = adapter_export(type(pipe), {"unet": pipe.unet}, ["diffusers", "kohya"])
    export = PivotalExport(lora, tokens.parameter_names(trained), tokens.tokens, embedding_file(tmp_path / "out"),
                           trained)
    assert export.embedding_file == "out_emb.safetensors"
    parameters = trainable_parameters(trained)
    export.save(tmp_path / "out")
    rows = load_file(tmp_path / "out" / "out_emb.safetensors")
    assert torch.equal(rows["clip_g"], tokens.embeddings["text_encoder_2"].new_rows.detach())
    assert (tmp_path / "out" / "pytorch_lora_weights_kohya.safetensors").is_file()
    (tmp_path / "out").rename(tmp_path / "moved")  # a checkpoint reads back wherever it is
    read = export.read_checkpoint(tmp_path / "moved")
    assert read.keys() == parameters.keys()
    assert all(torch.equal(read[name], parameter.detach()) for name, parameter in parameters.items())
    # The post-hoc EMA's synthesis writes the same files from the run's description.
    described = export_from_description(export.description())
    assert described.description() == export.description()
    described.write({name: parameter.detach() + 1 for name, parameter in parameters.items()}, tmp_path / "synth")
    assert torch.equal(load_file(tmp_path / "synth" / "out_emb.safetensors")["clip_l"], rows["clip_l"] + 1)


def test_while_they_train_the_new_rows_are_scaled_towards_the_vocabularys_scale_then_left_alone(tiny):
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"])
    tokens = PivotalTokens(pipe, {"text_encoder": "tokenizer"}, {"TOK": ["<s0>", "<s1>"]}, seed=0)
    rows = tokens.embeddings["text_encoder"].new_rows
    with torch.no_grad():
        rows.mul_(10)
    vocabulary = tokens.embeddings["text_encoder"].frozen.weight.detach().float().std()
    optimizer = torch.optim.SGD(tokens.parameters(), lr=0.0)
    stops = TrainingStops(optimizer, {1: tokens.parameters()})
    tokens.keep_scale(optimizer, stops)
    before = rows.detach().clone()
    optimizer.step()
    assert torch.equal(rows.detach(), before * (vocabulary / before.std()) ** 0.1)
    stops.at(1)
    after = rows.detach().clone()
    rows.grad = torch.ones_like(rows)
    optimizer.step()
    assert torch.equal(rows.detach(), after) and rows.grad is None


def test_with_clip_and_t5_the_concept_gives_as_many_tokens_as_the_tokenizer_that_makes_the_most(tiny):
    pipe = FluxPipeline.from_pretrained(tiny["flux"])
    concept = "a dog on a skateboard"
    counts = [len(tokenizer.encode(concept, add_special_tokens=False)) for tokenizer in (pipe.tokenizer,
                                                                                       pipe.tokenizer_2)]
    assert counts[0] != counts[1]
    assert abstraction_tokens(options("TOK", 1, concept), pipe.tokenizer, pipe.tokenizer_2) == {
        "TOK": [f"<s{index}>" for index in range(max(counts))]}

