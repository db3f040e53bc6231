"""Encoder outputs shared among processes and kept on disk (training_utils.data.feature_store)."""

import contextlib
import logging
import re
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from training_utils.data import feature_store
from training_utils.data.cache_keys import describe
from training_utils.data.feature_store import SHARD_PATTERN, Block, FeatureStore, encode_once
from training_utils.errors import UsageError, WriteFailed
from training_utils.outputs.manifest import file_hash
from training_utils.testing.tiny import parts as tiny


def squares_encoder(calls):
    """Encodes item i as the row [i, i²] (and item 5 as an error), recording the chunks it is given."""
    def encode_chunk(indices):
        calls.append(list(indices))
        rows = [index for index in indices if index != 5]
        return Block(torch.tensor(rows, dtype=torch.int64),
                     {"values": torch.tensor([[index, index ** 2] for index in rows], dtype=torch.float32)},
                     {5: "OSError: unreadable"} if 5 in indices else {})

    return encode_chunk


def encode(count, encode_chunk, store=None, batch_size=4):
    return encode_once("squares", count, encode_chunk, lambda: 8, contextlib.nullcontext, batch_size, store)


def by_index(blocks):
    """``{index: row as a list, or the error message}`` of all blocks."""
    found = {}
    for block in blocks:
        found.update(zip(block.indices.tolist(), block.tensors["values"].tolist() if block.tensors else []))
        found.update(block.errors)
    return found


def shard_names(folder):
    """The files of a store's folder, each shard as ``shard-<first item>`` after checking that its name holds the
    hash of its bytes."""
    names = []
    for path in sorted(Path(folder).iterdir()):
        match = SHARD_PATTERN.match(path.name)
        assert match is None or match.group(2) == file_hash(path), path
        names.append(path.name if match is None else f"shard-{match.group(1)}")
    return names


def test_encoding_in_memory_covers_every_item_in_fixed_chunks():
    calls = []
    found = by_index(encode(10, squares_encoder(calls)))
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert found == {**{index: [index, index ** 2] for index in range(10) if index != 5}, 5: "OSError: unreadable"}


def test_a_store_reads_back_what_was_encoded_and_a_second_encoding_runs_nothing(tmp_path):
    calls = []
    first = by_index(encode(10, squares_encoder(calls), FeatureStore(tmp_path, "squares", {"model": "a"})))
    again = []
    second = by_index(encode(10, squares_encoder(again), FeatureStore(tmp_path, "squares", {"model": "a"})))
    assert first == second == by_index(encode(10, squares_encoder([])))
    assert len(calls) == 3 and again == []
    (folder,) = tmp_path.iterdir()
    assert shard_names(folder) == ["meta.json", "shard-000000000"]


def test_interrupted_encoding_resumes_with_the_missing_chunks_and_never_reads_a_partial_shard(tmp_path):
    def interrupted(indices):
        if indices[0] == 8:
            raise KeyboardInterrupt
        return squares_encoder([])(indices)

    store = FeatureStore(tmp_path, "squares", {"model": "a"}, shard_bytes=0)  # a shard per chunk
    with pytest.raises(KeyboardInterrupt):
        encode(12, interrupted, store)
    assert shard_names(store.path) == ["meta.json", "shard-000000000", "shard-000000004"]
    # What a killed writer (a process that no longer runs) left half-written, and what a live one is writing.
    abandoned = store.path / f".shard-000000008.safetensors.{socket.gethostname()}-999999999.tmp"
    in_progress = store.path / f".shard-000000008.safetensors.{socket.gethostname()}-1.tmp"
    for partial in (abandoned, in_progress):
        partial.write_bytes(b"half a shard")
    calls = []
    resumed = by_index(encode(12, squares_encoder(calls), FeatureStore(tmp_path, "squares", {"model": "a"})))
    assert calls == [[8, 9, 10, 11]]
    assert resumed == by_index(encode(12, squares_encoder([])))
    assert not abandoned.exists() and in_progress.exists()


def data_offset(shard):
    """Where a safetensors file's tensor bytes begin: after its 8-byte header length and the header."""
    return 8 + int.from_bytes(shard.read_bytes()[:8], "little")


# Damage done to a shard's bytes after it was written, as a failing disk, a copy cut short or an editor would.
DAMAGES = {
    "truncated": lambda data, start: data[:-7],
    "zeroed": lambda data, start: data[:start] + bytes(len(data) - start),
    "set to 0x7f": lambda data, start: data[:start] + b"\x7f" * (len(data) - start),
    "one bit flipped": lambda data, start: data[:start] + bytes([data[start] ^ 1]) + data[start + 1:],
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_shard_is_named_removed_and_encoded_again_never_read(tmp_path, caplog, damage):
    encode(10, squares_encoder([]), FeatureStore(tmp_path, "squares", {"model": "a"}, shard_bytes=0))
    (folder,) = tmp_path.iterdir()
    shard = next(path for path in folder.iterdir() if path.name.startswith("shard-000000004-"))
    size = shard.stat().st_size
    shard.write_bytes(DAMAGES[damage](shard.read_bytes(), data_offset(shard)))
    assert damage == "truncated" or shard.stat().st_size == size
    calls = []
    found = by_index(encode(10, squares_encoder(calls), FeatureStore(tmp_path, "squares", {"model": "a"})))
    assert calls == [[4, 5, 6, 7]]
    assert found == by_index(encode(10, squares_encoder([])))
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings == [f"feature cache: {shard} does not hold the bytes it was written with (truncated, zeroed or "
                        f"altered); removed, its items are encoded again"]
    assert shard_names(folder) == ["meta.json", "shard-000000000", "shard-000000004", "shard-000000008"]


def test_a_shard_without_the_hash_of_its_bytes_in_its_name_is_never_read(tmp_path, caplog):
    encode(10, squares_encoder([]), FeatureStore(tmp_path, "squares", {"model": "a"}, shard_bytes=0))
    (folder,) = tmp_path.iterdir()
    shard = next(folder.glob("shard-000000008-*"))
    shard.rename(folder / "shard-000000008.safetensors")
    calls = []
    encode(10, squares_encoder(calls), FeatureStore(tmp_path, "squares", {"model": "a"}))
    assert calls == [[8, 9]]
    assert "shard-000000008.safetensors has no hash of its bytes in its name" in caplog.text


def test_a_shard_that_cannot_be_written_stops_in_one_line_saying_why(tmp_path, monkeypatch):
    def disk_full(tensors, path, metadata=None):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(feature_store, "save_file", disk_full)
    store = FeatureStore(tmp_path, "squares", {"model": "a"})
    with pytest.raises(WriteFailed) as stopped:
        encode(4, squares_encoder([]), store)
    assert re.fullmatch(f"could not write to {store.path}: {store.path}/\\.shard-000000000\\.safetensors\\..*\\.tmp: "
                        f"No space left on device", str(stopped.value))
    assert shard_names(store.path) == ["meta.json"]


def test_other_determinants_get_another_folder_and_the_log_says_what_differs(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="training_utils.data.feature_store")
    encode(4, squares_encoder([]), FeatureStore(tmp_path, "squares", {"model": "a", "resolution": 32}))
    calls = []
    store = FeatureStore(tmp_path, "squares", {"model": "a", "resolution": 64})
    encode(4, squares_encoder(calls), store)
    assert calls == [[0, 1, 2, 3]] and len(list(tmp_path.iterdir())) == 2
    assert "made for another resolution 32, now 64" in caplog.text
    assert f"squares: encoding 4 items into {store.path}, about 0.0 MiB on disk" in caplog.text


def test_a_cache_larger_than_the_available_host_memory_stops_with_one_line(monkeypatch):
    monkeypatch.setattr(feature_store.psutil, "virtual_memory", lambda: SimpleNamespace(available=2**30))
    with pytest.raises(UsageError) as error:
        encode_once("text embeddings", 3000, squares_encoder([]), lambda: 2**20, contextlib.nullcontext, 16)
    assert str(error.value) == ("the text embeddings would take about 2.93 GiB of host memory (1 process(es)), more "
                                "than the 1.00 GiB available: pass --feature_cache_dir DIR to keep them on disk")


def test_a_store_larger_than_the_free_disk_stops_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(feature_store.shutil, "disk_usage", lambda path: SimpleNamespace(free=2**20))
    with pytest.raises(UsageError, match="^--feature_cache_dir='.*': expected a disk with 2.0 MiB free for the "
                                         "squares \\(1.0 MiB is\\)$"):
        encode_once("squares", 2, squares_encoder([]), lambda: 2**20, contextlib.nullcontext, 16,
                    FeatureStore(tmp_path, "squares", {}))


def test_describe_tells_apart_weights_dtypes_configurations_vocabularies_and_code():
    encoder = tiny.tiny_clip_text_encoder(100)
    same = tiny.tiny_clip_text_encoder(100)
    assert describe(encoder) == describe(same)
    assert describe(tiny.tiny_clip_text_encoder(100, seed=1)) != describe(encoder)
    assert describe(tiny.tiny_clip_text_encoder(101)) != describe(encoder)
    assert describe(same.to(torch.bfloat16)) != describe(encoder)
    tokenizer = tiny.tiny_clip_tokenizer()
    assert describe(tokenizer) == describe(tiny.tiny_clip_tokenizer())
    used = tiny.tiny_clip_tokenizer()
    used(["a red circle"], padding="max_length", truncation=True, max_length=77)  # sets per-call state
    assert describe(used) == describe(tokenizer)
    assert describe(tiny.tiny_clip_tokenizer(model_max_length=16)) != describe(tokenizer)
    assert describe(tiny.tiny_clip_tokenizer(words=["red", "circle"])) != describe(tokenizer)

    def encoder_function(scale):
        def encode_text(captions):
            return scale * len(captions)
        return encode_text

    def edited(captions):
        return 2 * len(captions)

    assert describe(encoder_function(1)) == describe(encoder_function(2)) != describe(edited)
    assert describe(77) == "77" and describe(["a", 1]) == '["a", 1]'
