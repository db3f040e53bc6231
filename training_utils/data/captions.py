"""Captions as people write them: checked before anything loads, and counted when the text encoder cuts them.

A caption is a string (``""`` is the empty caption, on purpose) or a non-empty list of strings, one drawn per
sample. A row without one (its key missing, ``null``, a number), and a ``metadata.jsonl`` line that is not UTF-8
text or not a JSON object, stops the run before anything loads, in one line naming the file and line (or, for a
dataset without files, the row): training on an empty caption in its place would teach the model what the row was
not meant to say, and the fix (the caption, or ``"text": ""``) is the user's to choose.

A caption saved as "UTF-8 with BOM" (Windows Notepad's default) starts with the byte-order mark, U+FEFF, which
is no part of what was written: it is removed wherever a caption is read (`without_bom`), or it would train as the
first characters of the trigger word.

A caption longer than a text encoder takes is cut to fit, as the pipelines cut prompts; `cut_captions_warning`
counts them in one warning line, so that a dataset of long captions is not trained on half of each unnoticed.
"""

import json
from pathlib import Path

from ..errors import UsageError, few

A_CAPTION = "a caption (a string, or a list of strings)"
BOM = "\ufeff"


def is_caption(value):
    """Whether ``value`` is a caption: a string, or a non-empty list of strings."""
    return isinstance(value, str) or (isinstance(value, (list, tuple)) and bool(value)
                                      and all(isinstance(caption, str) for caption in value))


def without_bom(value):
    """``value`` (a caption, or anything else, which is left as it is) without a byte-order mark leading it or any of
    its strings."""
    if isinstance(value, str):
        return value.removeprefix(BOM)
    return [without_bom(caption) for caption in value] if is_caption(value) else value


def has_bom(value):
    return without_bom(value) != value


def read_caption_file(path, flag, value):
    """The stripped text of the caption file ``path`` (a sidecar ``.txt`` beside its image or clip; a leading
    byte-order mark is no part of it), or None if there is none; one that is not UTF-8 stops the run in one line
    naming it (``flag``, ``value``: what pointed to it)."""
    if not path.is_file():
        return None
    try:
        return path.read_bytes().decode("utf-8-sig").strip()
    except UnicodeDecodeError:
        raise UsageError(flag, value, f"UTF-8 caption files: {path} is not") from None


def check_metadata(path, flag, value, caption_column=None):
    """Stop with one line naming the file and line if ``path`` (an imagefolder's ``metadata.jsonl``) is not UTF-8
    text of one JSON object per line (a byte-order mark may lead it, as datasets reads it), if a line names a file
    (``file_name``, ``reference_file_name(s)``) that is not there, or, with ``caption_column``, if a line holds no
    caption there. A column that no line has is left to the dataset's column check, which lists the columns there
    are."""
    rows, without_caption = 0, []
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise UsageError(flag, value, f"UTF-8 text in {path}: line {number} is not (byte "
                                 f"0x{raw[error.start]:02x} at position {error.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:
                raise UsageError(flag, value, f"one JSON object per line in {path}: line {number} is not ({error})") \
                    from None
            if not isinstance(row, dict):
                raise UsageError(flag, value, f"one JSON object per line in {path}: line {number} is a "
                                 f"{type(row).__name__}")
            rows += 1
            check_files_named(row, path, number, flag, value)
            if caption_column is None or is_caption(row.get(caption_column)):
                continue
            if caption_column not in row:
                without_caption.append(number)
                continue
            raise UsageError(flag, value, f"{A_CAPTION} in every line of {path}: line {number} has "
                             f"{json.dumps(caption_column)}: {json.dumps(row[caption_column])}; "
                             f"{empty_caption_hint(caption_column)}")
    if without_caption and len(without_caption) < rows:
        raise UsageError(flag, value, f"{A_CAPTION} in every line of {path}: line {without_caption[0]} has no "
                         f"{json.dumps(caption_column)}; {empty_caption_hint(caption_column)}")


def check_files_named(row, path, number, flag, value):
    """Stop in one line if the ``metadata.jsonl`` line ``row`` (line ``number`` of ``path``) names a file that is not
    there: datasets keeps such a row, and its image fails only when a training step reads it."""
    for key, names in row.items():
        if not key.endswith(("file_name", "file_names")):
            continue
        for name in names if isinstance(names, list) else [names]:
            if isinstance(name, str) and not (Path(path).parent / name).is_file():
                raise UsageError(flag, value, f"files that are there for every line of {path}: line {number} has "
                                              f"{json.dumps(key)}: {json.dumps(name)}, and {Path(path).parent / name} "
                                              "is not there")


def empty_caption_hint(column):
    return f'write {json.dumps(column)}: "" for an empty caption'


def check_captions(dataset, column, flag="--caption_column"):
    """Stop with one line naming the first row of ``dataset`` (a `datasets.Dataset`) whose ``column`` holds no
    caption."""
    for index, caption in enumerate(dataset[column]):
        if not is_caption(caption):
            raise UsageError(flag, column, f"{A_CAPTION} in every row: row {index} has "
                             f"{json.dumps(caption, default=repr)}; {empty_caption_hint(column)}")


def captions_without_bom(dataset, column):
    """``dataset`` (a `datasets.Dataset`) with the captions of ``column`` `without_bom`; itself where none has one."""
    captions = list(dataset[column])
    if not any(map(has_bom, captions)):
        return dataset
    return dataset.remove_columns(column).add_column(column, list(map(without_bom, captions)),
                                                     feature=dataset.features[column])


def distinct_captions(values):
    """Each caption once, in order of appearance, from strings and lists of strings."""
    captions = {}
    for value in values:
        for caption in [value] if isinstance(value, str) else value:
            captions[caption] = None
    return list(captions)


def cut_captions_warning(captions, depends_on):
    """One line counting the ``captions`` longer than a tokenizer among ``depends_on`` (what a family's text rows
    depend on) lets its encoder take, or None if none is. The limit is the tokenizer's length, or a
    ``max_sequence_length`` setting among ``depends_on`` where that is shorter (the T5 and Qwen encoders); a chat
    template's own tokens are not counted, so for the families that wrap prompts in one the count is a lower bound."""
    settings = [thing for thing in depends_on if isinstance(thing, dict) and "max_sequence_length" in thing]
    setting = settings[0]["max_sequence_length"] if settings else None
    counts = []
    for tokenizer in (thing for thing in depends_on if hasattr(thing, "get_vocab")):
        limit = min(tokenizer.model_max_length, setting or tokenizer.model_max_length)
        lengths = [len(ids) for ids in tokenizer(list(captions), truncation=False, verbose=False).input_ids]
        cut = [caption for caption, length in zip(captions, lengths) if length > limit]
        if cut:
            counts.append(f"{len(cut)} of {len(captions)} longer than the {limit} tokens {type(tokenizer).__name__} "
                          f"takes ({few([repr(caption[:40] + '...') for caption in cut], 2)})")
    return f"captions cut to fit the text encoders: {'; '.join(counts)}" if counts else None
