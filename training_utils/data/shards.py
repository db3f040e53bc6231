"""WebDataset tar shards (upstream's ``--train_shards_path_or_url``) as a training dataset.

Each shard is a tar of samples, a sample's files sharing a key: its image (``.jpg``, ``.png``, ``.jpeg`` or
``.webp``) and its caption (``.txt``, ``.text`` or ``.caption``), one type of each throughout, as LAION's shards
are (other files, such as a .json of metadata, are left out). datasets' own ``webdataset`` builder reads them (no
other package) into an on-disk table, which trains as any dataset here does (seeded shuffling, exact resume,
captions encoded once), the image and caption in its ``image`` and ``text`` columns.

The shards are local: a folder (its ``*.tar``), files, or brace patterns of them as upstream writes them
(``data/{00000..00099}.tar``); a URL or a ``pipe:`` command is refused in one line (download the shards first).
"""

import re
from pathlib import Path

from ..errors import UsageError

IMAGE_KEYS = ("jpg", "png", "jpeg", "webp")
TEXT_KEYS = ("text", "txt", "caption")
FLAG = "--train_shards_path_or_url"


def add_shard_args(parser):
    """``--train_shards_path_or_url``: the shards, one or more values."""
    parser.add_argument(FLAG, nargs="+", default=None, required=True,
                        help="WebDataset tar shards: a folder of them, files, or brace patterns such as "
                             "data/{00000..00099}.tar (local only)")


def brace_expanded(pattern):
    """``pattern`` with its brace groups expanded, left to right: ``{a,b}`` alternatives and ``{000..012}`` numeric
    ranges (zero-padded to the first bound's width)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    body = match.group(1)
    numeric = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numeric:
        start, stop = numeric.groups()
        choices = [str(number).zfill(len(start)) for number in range(int(start), int(stop) + 1)]
    else:
        choices = body.split(",")
    head, tail = pattern[:match.start()], pattern[match.end():]
    return [expanded for choice in choices for expanded in brace_expanded(head + choice + tail)]


def shard_paths(values, flag=FLAG):
    """The tar files ``values`` name (folders, files, brace patterns), in order; a remote or missing one stops the run
    in one line."""
    paths = []
    for value in values:
        if re.match(r"^[a-z][a-z0-9+.-]*:", value) and not Path(value).exists():
            raise UsageError(flag, value, "local tar shards (a folder, files or brace patterns; download remote "
                                          "shards first)")
        for expanded in brace_expanded(value):
            path = Path(expanded)
            if path.is_dir():
                found = sorted(path.glob("*.tar"))
                if not found:
                    raise UsageError(flag, value, "a folder holding .tar shards")
                paths.extend(found)
            elif path.is_file():
                paths.append(path)
            else:
                raise UsageError(flag, expanded, "an existing .tar shard or folder of them")
    return [str(path) for path in paths]


def load_shards(args):
    """The samples of ``--train_shards_path_or_url``'s shards (at most ``--max_train_samples``), with ``image`` and
    ``text`` columns, as `datasets.load_train_dataset` gives a dataset."""
    import datasets

    from .datasets import checked_dataset

    paths = shard_paths(args.train_shards_path_or_url)
    dataset = datasets.load_dataset("webdataset", data_files={"train": paths}, cache_dir=args.cache_dir)["train"]
    found = ", ".join(name for name in dataset.column_names if not name.startswith("__"))
    for column, keys in (("image", IMAGE_KEYS), ("text", TEXT_KEYS)):
        present = [key for key in keys if key in dataset.column_names]
        if len(present) != 1:
            raise UsageError(FLAG, " ".join(args.train_shards_path_or_url),
                             f"samples with one {column} file each, of one type ({', '.join('.' + key for key in keys)}"
                             f"; found {found})")
        dataset = dataset.rename_column(present[0], column)
    dataset = dataset.select_columns(["image", "text"])
    return checked_dataset(args, {"--image_column": "image", "--caption_column": "text"}, FLAG,
                           args.train_shards_path_or_url[0], dataset)
