"""Frozen encoders' outputs computed once for a whole run, shared among its processes, and kept on disk between runs.

`encode_once` runs an encoder over a list of items in fixed chunks: every process encodes its share of the
chunks, then every process has all of them. A chunk holds the same items whatever the number of processes,
so what an item encodes to does not depend on how many processes shared the work.

With a `FeatureStore` the chunks go to disk as safetensors shards, read back memory-mapped (file-backed
pages that the processes share, not a copy in each one). A store lives in a folder named by a hash of what
determines its content (`cache_keys.describe` turns encoders, tokenizers and the encoding code into short stable
strings), so a later run with the same model, data and settings finds it and runs no encoder, and one with
anything changed gets a new folder. Shards are written to a temporary name and renamed, so a killed run
leaves only whole shards, and the next run encodes just the chunks no shard holds.

A shard's name holds the hash of its bytes (``shard-<first item>-<blake2b>.safetensors``). Every run hashes each
shard before it maps any (`FeatureStore.check_shards`, the processes sharing the work), so a shard truncated,
zeroed or altered since it was written is named in a warning, removed and encoded again: never read as data. The
check reads the store once, at the disk's speed or the hash's, whichever is slower (blake2b, about 0.9 GB/s on one
core of the test machine: a 10 GB store in about 11 s, divided among the processes), and leaves its pages in the
page cache, where the memory-mapped reads of training find them.
"""

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import NamedTuple

import psutil
import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import UsageError
from ..outputs.manifest import file_hash
from ..outputs.writing import stopping_on_write_errors
from ..sharding.text_encoders import in_lockstep, is_sharded, most_calls
from .cache_keys import digest

logger = logging.getLogger(__name__)

# 2: text embeddings as numbered parts (a tuple per caption), whatever the encoding returned. 3: shards named by
# the hash of their bytes.
FORMAT_VERSION = 3
SHARD_BYTES = 256 * 2**20
SHARD_PATTERN = re.compile(r"^shard-(\d+)-([0-9a-f]+)\.safetensors$")


class Block(NamedTuple):
    """Encoded items: ``tensors`` (name -> batch) hold one row per item of ``indices``; the items of ``errors``
    (index -> message, e.g. an unreadable image) have no row."""

    indices: torch.Tensor
    tensors: dict
    errors: dict


def block_bytes(block):
    return sum(tensor.nbytes for tensor in block.tensors.values())


def human_bytes(count):
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


class FeatureStore:
    """One folder of shards under ``root``, for the outputs of one encoding: ``kind`` (e.g. "latents") and
    ``determinants``, a dict of strings (see `cache_keys.describe`) naming everything the outputs depend on."""

    def __init__(self, root, kind, determinants, shard_bytes=SHARD_BYTES):
        self.root = Path(root)
        self.kind = kind
        self.determinants = {"format": FORMAT_VERSION, **determinants}
        self.path = self.root / f"{kind}-{digest(json.dumps(self.determinants, sort_keys=True))}"
        self.shard_bytes = shard_bytes
        self.pending = []

    def open(self, state):
        """Make the folder (the main process), say whether it is new and, if so, what is different in the
        stores of the same kind already there; check its shards (`check_shards`); then every process may read it."""
        if state.is_main_process:
            existing = self.path.is_dir()
            with stopping_on_write_errors(self.path):
                self.path.mkdir(parents=True, exist_ok=True)
                remove_abandoned_temporaries(self.path)
                meta = self.path / "meta.json"
                if not meta.exists():
                    write_atomically(meta, lambda path: Path(path).write_text(json.dumps(self.determinants, indent=1)))
            if not existing:
                for reason in self.differences():
                    logger.info(reason)
        state.wait_for_everyone()
        self.check_shards(state)

    def check_shards(self, state):
        """Hash every shard, each process its share, and remove those whose bytes are not those their names hold
        (the main process, with a line naming each), so that their items are encoded again."""
        shards = self.shards()
        mine = [(shard, shard_problem(shard)) for shard in shards[state.process_index::state.num_processes]]
        problems = gather_object(mine) if state.num_processes > 1 else mine
        if state.is_main_process:
            for shard, problem in problems:
                if problem is not None:
                    logger.warning(f"feature cache: {shard} {problem}; removed, its items are encoded again")
                    with stopping_on_write_errors(self.path):
                        shard.unlink(missing_ok=True)
        state.wait_for_everyone()

    def differences(self):
        """For each other store of this kind under root, a line saying which determinants differ."""
        for other in sorted(self.root.glob(f"{self.kind}-*/meta.json")):
            if other.parent == self.path:
                continue
            try:
                theirs = json.loads(other.read_text())
            except (OSError, ValueError):
                continue
            ours = self.determinants
            changed = [f"{key} {theirs.get(key)!r}, now {ours.get(key)!r}"
                       for key in sorted({*theirs, *ours}) if theirs.get(key) != ours.get(key)]
            yield f"not reusing {other.parent}: made for another {'; '.join(changed)}"

    def shards(self):
        return sorted(self.path.glob("shard-*.safetensors"))

    def covered(self):
        """The indices of the items some shard holds (an unreadable item included)."""
        covered = set()
        for shard in self.shards():
            with safe_open(shard, framework="pt") as file:
                covered.update(int(index) for index in json.loads(file.metadata()["errors"]))
                for name in file.keys():
                    if name.endswith("/indices"):
                        covered.update(file.get_tensor(name).tolist())
        return covered

    def add(self, block):
        self.pending.append(block)
        if sum(block_bytes(pending) for pending in self.pending) >= self.shard_bytes:
            self.flush()

    def flush(self):
        """Write the pending blocks as one shard, named by its first item (items are never in two shards) and the
        hash of its bytes."""
        if not self.pending:
            return
        tensors, errors = {}, {}
        for number, block in enumerate(self.pending):
            tensors[f"{number}/indices"] = block.indices
            tensors.update({f"{number}/{name}": tensor.contiguous() for name, tensor in block.tensors.items()})
            errors.update({str(index): message for index, message in block.errors.items()})
        first = min(int(block.indices.min()) if len(block.indices) else min(block.errors) for block in self.pending)
        temporary = temporary_path(self.path / f"shard-{first:09d}.safetensors")
        with stopping_on_write_errors(self.path):
            try:
                save_file(tensors, str(temporary), metadata={"errors": json.dumps(errors)})
                os.replace(temporary, self.path / f"shard-{first:09d}-{file_hash(temporary)}.safetensors")
            finally:
                temporary.unlink(missing_ok=True)
        self.pending.clear()

    def blocks(self):
        """Every shard's blocks, their tensors memory-mapped."""
        blocks = []
        for shard in self.shards():
            with safe_open(shard, framework="pt") as file:
                tensors = {name: file.get_tensor(name) for name in file.keys()}
                errors = {int(index): message for index, message in json.loads(file.metadata()["errors"]).items()}
            numbers = sorted({name.split("/")[0] for name in tensors}, key=int)
            for number in numbers:
                prefix = f"{number}/"
                blocks.append(Block(tensors[prefix + "indices"], {
                    name[len(prefix):]: tensor for name, tensor in tensors.items()
                    if name.startswith(prefix) and name != prefix + "indices"}, {}))
            if errors:
                blocks.append(Block(torch.zeros(0, dtype=torch.int64), {}, errors))
        return blocks


def shard_problem(shard):
    """What is wrong with the shard file ``shard`` against the hash its name holds, in a few words; None if nothing."""
    match = SHARD_PATTERN.match(shard.name)
    if match is None:
        return "has no hash of its bytes in its name (not written by this version)"
    if file_hash(shard) != match.group(2):
        return "does not hold the bytes it was written with (truncated, zeroed or altered)"
    return None


def temporary_path(path):
    """Where `write_atomically` writes ``path`` first: a name that says which process writes it, so that two runs
    filling one store never share one."""
    return path.with_name(f".{path.name}.{socket.gethostname()}-{os.getpid()}.tmp")


def write_atomically(path, write):
    """``write(temporary path)``, then rename it to ``path``: a reader never sees a half-written file."""
    temporary = temporary_path(path)
    write(str(temporary))
    os.replace(temporary, path)



def remove_abandoned_temporaries(folder):
    """Remove the temporary files of `write_atomically` whose writer, on this host, no longer runs (it was killed)."""
    for temporary in folder.glob(".*.tmp"):
        writer, _, pid = temporary.name.removesuffix(".tmp").rpartition("-")
        if writer.endswith(f".{socket.gethostname()}") and pid.isdigit() and not psutil.pid_exists(int(pid)):
            temporary.unlink(missing_ok=True)


def encode_once(what, count, encode_chunk, bytes_per_item, on_device, batch_size, store=None, lockstep=False):
    """The blocks of all ``count`` items, each encoded once by one of the run's processes.

    ``encode_chunk(indices)`` encodes a list of item indices into a `Block`; ``bytes_per_item()`` estimates an
    item's size (e.g. by encoding one); both run inside ``on_device()``, which holds the encoders on the
    accelerator, entered only if something is left to encode. Without a ``store`` the processes exchange their
    blocks and each holds all of them in memory; if that would not fit in the host's memory the run stops and
    says to use ``--feature_cache_dir``. With one, the blocks are read back memory-mapped from its shards, and the
    chunks some shard already holds are not encoded again.

    With ``lockstep`` (encoders sharded with FSDP2, whose forwards are collective) every process makes as many
    encoder calls as the one with the most chunks to encode (`sharding.text_encoders.in_lockstep`), ``bytes_per_item``
    included, even one with none left to encode.
    """
    state = PartialState()
    chunks = [list(range(start, min(start + batch_size, count))) for start in range(0, count, batch_size)]
    if store is not None:
        store.open(state)
        covered = store.covered()
        state.wait_for_everyone()  # everyone has listed the shards before anyone writes one
        chunks = [chunk for chunk in chunks if not set(chunk) <= covered]
        if not chunks:
            if state.is_main_process:
                logger.info(f"{what}: reusing {store.path} ({count} items); no encoder runs")
    mine = chunks[state.process_index::state.num_processes]
    blocks = []
    started = time.perf_counter()
    if (most_calls(len(chunks)) > 0) if lockstep else chunks:  # in lockstep, whether any process encodes
        with on_device(), torch.no_grad():
            todo = sum(map(len, chunks))
            estimate = bytes_per_item() * todo
            check_room(what, estimate, count, todo, store, state)
            encoded = (in_lockstep(mine, encode_chunk, lambda: encode_chunk([0])) if lockstep
                       else map(encode_chunk, mine))
            for block in encoded:
                if store is None:
                    blocks.append(block)
                else:
                    store.add(block)
            if store is not None:
                store.flush()
    if store is None:
        blocks = gather_object(blocks) if state.num_processes > 1 else blocks
    else:
        state.wait_for_everyone()
        blocks = store.blocks()
    if chunks and state.is_main_process:
        logger.info(f"{what}: {todo} items encoded in {time.perf_counter() - started:.1f} s by "
                    f"{state.num_processes} process(es)")
    return blocks


def check_room(what, estimate, count, todo, store, state):
    """Log the estimated size of what is about to be encoded; stop if the host's memory (or the store's disk)
    cannot hold it."""
    if store is not None:
        if state.is_main_process:
            resumed = f" ({count - todo} of {count} are there already)" if todo < count else ""
            logger.info(f"{what}: encoding {todo} items{resumed} into {store.path}, about {human_bytes(estimate)} "
                        f"on disk")
        free = shutil.disk_usage(store.path).free
        if estimate > free:
            raise UsageError("--feature_cache_dir", str(store.root),
                             f"a disk with {human_bytes(estimate)} free for the {what} ({human_bytes(free)} is)")
        return
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))
    if state.is_main_process:
        logger.info(f"{what}: {count} items, about {human_bytes(estimate)} of host memory in each of "
                    f"{processes} process(es)")
    available = psutil.virtual_memory().available
    if estimate * processes > available:
        raise UsageError(None, None, f"the {what} would take about {human_bytes(estimate * processes)} of host "
                         f"memory ({processes} process(es)), more than the {human_bytes(available)} available: "
                         "pass --feature_cache_dir DIR to keep them on disk")


@contextlib.contextmanager
def encoders_on(device, encoders):
    """``encoders`` on ``device`` while the block runs, on the CPU after."""
    movable = [module for module in encoders if not is_sharded(module)]  # a sharded one stays where FSDP2 put it
    for module in movable:
        module.to(device)
    try:
        yield
    finally:
        for module in movable:
            module.to("cpu")
