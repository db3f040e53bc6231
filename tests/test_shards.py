"""Unit tests of training_utils.data.shards: WebDataset tar shards named as upstream names them, read as a dataset."""

from types import SimpleNamespace

import pytest

from training_utils.data.shards import brace_expanded, load_shards, shard_paths
from training_utils.errors import UsageError


def test_brace_patterns_expand_ranges_zero_padded_and_alternatives_left_to_right():
    assert brace_expanded("d/{00008..00011}.tar") == [f"d/000{n:02d}.tar" for n in (8, 9, 10, 11)]
    assert brace_expanded("{a,b}/{1..2}.tar") == ["a/1.tar", "a/2.tar", "b/1.tar", "b/2.tar"]
    assert brace_expanded("plain.tar") == ["plain.tar"]


def test_shards_are_a_folders_tars_files_or_patterns_in_order(tiny):
    folder = tiny["shapes_wds"]
    tars = [str(folder / "00000.tar"), str(folder / "00001.tar")]
    assert shard_paths([str(folder)]) == tars
    assert shard_paths([f"{folder}/{{00000..00001}}.tar"]) == tars
    assert shard_paths([tars[1], tars[0]]) == tars[::-1]


@pytest.mark.parametrize("value, message", [
    ("pipe:curl -s https://x/{0..9}.tar", "expected local tar shards (a folder, files or brace patterns; download "
                                          "remote shards first)"),
    ("s3://bucket/shard.tar", "expected local tar shards"),
])
def test_remote_shards_are_refused_in_one_line(value, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        shard_paths([value])


def test_a_missing_shard_or_a_folder_without_shards_is_named(tiny, tmp_path):
    with pytest.raises(UsageError) as error:
        shard_paths([f"{tiny['shapes_wds']}/{{00000..00002}}.tar"])
    assert str(error.value) == (f"--train_shards_path_or_url='{tiny['shapes_wds']}/00002.tar': expected an existing "
                                ".tar shard or folder of them")
    with pytest.raises(UsageError, match="a folder holding .tar shards"):
        shard_paths([str(tmp_path)])


def test_the_samples_load_with_image_and_text_columns_at_most_max_train_samples(tiny, tmp_path):
    args = SimpleNamespace(train_shards_path_or_url=[str(tiny["shapes_wds"])], cache_dir=str(tmp_path),
                           max_train_samples=None)
    dataset = load_shards(args)
    assert dataset.column_names == ["image", "text"] and len(dataset) == 16
    assert dataset[0]["image"].size == (64, 64) and dataset[0]["text"].startswith("a ")
    args.max_train_samples = 5
    assert len(load_shards(args)) == 5


def test_samples_without_a_caption_are_refused_in_one_line(tiny, tmp_path):
    import io
    import tarfile

    shard = tmp_path / "00000.tar"
    with tarfile.open(shard, "w") as tar:
        for index in range(2):
            data = (tiny["shapes"] / f"{index:04d}.png").read_bytes()
            info = tarfile.TarInfo(f"{index:06d}.png")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    args = SimpleNamespace(train_shards_path_or_url=[str(shard)], cache_dir=str(tmp_path / "cache"),
                           max_train_samples=None)
    with pytest.raises(UsageError, match=r"expected samples with one text file each, of one type \(.text, .txt, "
                                         r".caption; found png\)"):
        load_shards(args)
