"""What a checkpoint holds, file by file, so that a damaged one is found before anything is loaded from it.

`write_manifest` lists every file of a folder with its size and content hash, in ``manifest.json``, written
last; `check_manifest` says what is wrong with a folder against it: a file missing, shorter or longer than it
was, or with other bytes.
"""

import hashlib
import json
from pathlib import Path
from ..names import MANIFEST_FILE

CHUNK_BYTES = 8 * 2**20


def file_hash(path):
    hasher = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()


def files_of(folder):
    """The files under ``folder``, by path relative to it, the manifest excluded."""
    folder = Path(folder)
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*")
                  if path.is_file() and path.name != MANIFEST_FILE)


def write_manifest(folder):
    """List every file under ``folder`` with its size and hash in ``folder/manifest.json``. Written in place:
    ``folder`` is a checkpoint's staging folder, renamed whole once the manifest is in it."""
    folder = Path(folder)
    files = {name: {"bytes": (folder / name).stat().st_size, "blake2b": file_hash(folder / name)}
             for name in files_of(folder)}
    (folder / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1))


def check_manifest(folder):
    """What is wrong with ``folder`` against its manifest, in a few words naming the file; None if nothing."""
    folder = Path(folder)
    try:
        listed = json.loads((folder / MANIFEST_FILE).read_text())["files"]
    except FileNotFoundError:
        return f"{MANIFEST_FILE} is missing"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{MANIFEST_FILE} is unreadable ({error})"
    for name, expected in listed.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"{name} is {size} bytes, not the {expected['bytes']} it was written with (truncated or replaced)"
        if file_hash(path) != expected["blake2b"]:
            return f"{name} does not hold the bytes it was written with (altered or corrupt)"
    return None
