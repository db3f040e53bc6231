"""Textual inversion's pieces (`training_utils.embeddings`): the new rows and nothing else train, the prompts spell the
token's vectors out as the pipeline does, and the files load where users load them."""

import pytest
import torch
from diffusers import StableDiffusionPipeline
from safetensors.torch import load_file

from training_utils.embeddings import (EMBEDDINGS_NAME, NewTokenEmbedding, TextualInversion, placeholder_tokens,
                                       write_progress)
from training_utils.errors import UsageError
from training_utils.outputs.pipeline_folder import save_pipeline
from training_utils.pipeline import trainable_parameters
from training_utils.posthoc_ema.synthesis import export_from_description

TOKEN = "<cat-toy>"


def load(tiny):
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def inverted(tiny, num_vectors=2, initializer="a"):
    pipe = load(tiny)
    return pipe, TextualInversion(pipe, {"text_encoder": "tokenizer"}, TOKEN, num_vectors, initializer)


def test_placeholder_tokens_are_named_as_load_textual_inversion_names_a_multi_vector_embeddings():
    assert placeholder_tokens(TOKEN, 1) == [TOKEN]
    assert placeholder_tokens(TOKEN, 3) == [TOKEN, f"{TOKEN}_1", f"{TOKEN}_2"]


def test_new_token_embedding_reads_the_frozen_rows_then_the_new_ones_and_only_the_new_ones_get_gradients():
    torch.manual_seed(0)
    frozen = torch.nn.Embedding(5, 3)
    embedding = NewTokenEmbedding(frozen, torch.randn(2, 3))
    ids = torch.tensor([[0, 4, 5, 6, 2]])
    whole = torch.cat([frozen.weight, embedding.new_rows]).detach()
    assert torch.equal(embedding(ids), torch.nn.functional.embedding(ids, whole))
    assert torch.equal(embedding.weight, whole)
    embedding(ids).sum().backward()
    assert frozen.weight.grad is None
    assert torch.equal(embedding.new_rows.grad, torch.ones(2, 3))
    assert [name for name, parameter in embedding.named_parameters() if parameter.requires_grad] == ["new_rows"]


def test_new_token_embedding_over_padding_rows_reads_the_new_rows_from_the_tokenizers_next_id():
    torch.manual_seed(0)
    frozen = torch.nn.Embedding(6, 3)  # as T5's: rows past the tokenizer's 4 ids, never read
    embedding = NewTokenEmbedding(frozen, torch.randn(2, 3), first_new=4)
    ids = torch.tensor([[0, 3, 4, 5]])
    whole = torch.cat([frozen.weight[:4], embedding.new_rows]).detach()
    assert torch.equal(embedding(ids), torch.nn.functional.embedding(ids, whole))
    assert torch.equal(embedding.weight, whole)


def test_the_token_starts_as_its_initializer_and_a_step_with_weight_decay_changes_only_its_rows(tiny):
    pipe, inversion = inverted(tiny)
    text_encoder = pipe.text_encoder
    loaded = inversion.embeddings["text_encoder"].frozen.weight.detach().clone()
    initializer = pipe.tokenizer.encode("a", add_special_tokens=False)[0]
    assert torch.equal(inversion.embeddings["text_encoder"].new_rows, loaded[initializer].expand(2, -1))
    parameters = trainable_parameters(inversion.text_encoders)
    assert list(parameters) == ["text_encoder.embeddings.token_embedding.new_rows"]
    optimizer = torch.optim.AdamW(parameters.values(), lr=1e-1, weight_decay=1e-1)
    ids = pipe.tokenizer(inversion.spelled_out([f"a photo of a {TOKEN}"]), return_tensors="pt").input_ids
    text_encoder(ids)[0].square().mean().backward()
    optimizer.step()
    whole = text_encoder.get_input_embeddings().weight
    assert torch.equal(whole[:len(loaded)], loaded)
    assert not torch.equal(whole[len(loaded):], loaded[initializer].expand(2, -1))


def test_prompts_spell_the_tokens_vectors_out_as_the_pipeline_does_and_tokenize_apart_from_the_initializer(tiny):
    pipe, inversion = inverted(tiny, num_vectors=3)
    assert inversion.spelled_out([f"a {TOKEN} on a table"]) == [f"a {TOKEN} {TOKEN}_1 {TOKEN}_2 on a table"]
    with_token, with_initializer = (pipe.tokenizer(prompt).input_ids
                                    for prompt in inversion.spelled_out([f"a {TOKEN}", "a a"]))
    assert with_token[2:5] == pipe.tokenizer.convert_tokens_to_ids(placeholder_tokens(TOKEN, 3))
    assert with_token != with_initializer


@pytest.mark.parametrize("token, initializer, expected", [
    ("a", "a", "--placeholder_token='a': expected a token that tokenizer does not have already (a is one of its "
               "tokens)"),
    (TOKEN, "a red", "--initializer_token='a red': expected one token of tokenizer, not 2"),
])
def test_a_token_the_tokenizer_has_or_an_initializer_of_several_tokens_is_refused_before_anything_changes(
        tiny, token, initializer, expected):
    pipe = load(tiny)
    vocabulary = len(pipe.tokenizer)
    with pytest.raises(UsageError) as error:
        TextualInversion(pipe, {"text_encoder": "tokenizer"}, token, 1, initializer)
    assert str(error.value) == expected
    assert len(pipe.tokenizer) == vocabulary
    assert isinstance(pipe.text_encoder.get_input_embeddings(), torch.nn.Embedding)


def test_the_files_load_into_a_stock_pipeline_in_diffusers_and_ui_layouts_and_read_back_as_the_parameters(
        tiny, tmp_path):
    pipe, inversion = inverted(tiny)
    with torch.no_grad():
        inversion.embeddings["text_encoder"].new_rows.normal_()
    export = inversion.export(inversion.text_encoders)
    assert export.save(tmp_path) == tmp_path / EMBEDDINGS_NAME
    new_rows = inversion.embeddings["text_encoder"].new_rows.detach()
    assert torch.equal(load_file(tmp_path / "cat-toy.safetensors")["emb_params"], new_rows)
    for path, token in ((tmp_path, None), (tmp_path / "cat-toy.safetensors", TOKEN)):
        stock = load(tiny)
        stock.load_textual_inversion(path, token=token)
        assert torch.equal(stock.text_encoder.get_input_embeddings().weight,
                           pipe.text_encoder.get_input_embeddings().weight)
    assert {name: torch.equal(tensor, new_rows) for name, tensor in export.read_checkpoint(tmp_path).items()} == {
        "text_encoder.embeddings.token_embedding.new_rows": True}
    described = export_from_description(export.description())
    described.write(export.read_checkpoint(tmp_path), tmp_path / "again")
    assert torch.equal(load_file(tmp_path / "again" / EMBEDDINGS_NAME)[TOKEN], new_rows)
    write_progress(export, tmp_path, 7)
    assert torch.equal(load_file(tmp_path / "learned_embeds-steps-7.safetensors")[TOKEN], new_rows)


def test_the_merged_pipeline_saves_whole_and_loads_with_the_token_and_the_live_one_trains_on(tiny, tmp_path):
    pipe, inversion = inverted(tiny)
    with inversion.merged():
        assert save_pipeline(pipe, tmp_path, trained=inversion.text_encoders)["text_encoder"] == "written"
    assert isinstance(pipe.text_encoder.get_input_embeddings(), NewTokenEmbedding)
    assert pipe.text_encoder.config.vocab_size == inversion.embeddings["text_encoder"].frozen.num_embeddings
    saved = load(tiny | {"sd": tmp_path})
    assert torch.equal(saved.text_encoder.get_input_embeddings().weight,
                       pipe.text_encoder.get_input_embeddings().weight)
    assert saved.tokenizer.convert_tokens_to_ids(placeholder_tokens(TOKEN, 2)) == \
        pipe.tokenizer.convert_tokens_to_ids(placeholder_tokens(TOKEN, 2))
