"""``--blocks_to_swap N``: N of the transformer's repeated blocks keep their frozen weights in CPU memory.

Which blocks. `repeated_blocks` lists a model's repeated blocks in the order they run: the entries of its
``ModuleList``\\ s of a class that the model declares repeated (diffusers' ``_repeated_blocks``, or
`compile.REPEATED_BLOCKS`), else those of its longest ``ModuleList``\\ s of one class. FLUX.1's 19
``transformer_blocks`` then its 38 ``single_transformer_blocks``; Wan's ``blocks``; Lumina 2's refiners then its
``layers``. The first N of them swap (`BlockSwap`).

How. A swapped block's frozen parameters (``requires_grad`` False: the base weights, int8 ones included) are kept
on the CPU, pinned where CUDA is, and the block holds placeholders on the meta device in their place. Just before
the block runs, a copy of them is made on the accelerator and put in the placeholders' place; just after, it is
dropped. The next block in the direction of travel is copied meanwhile, on a side CUDA stream (on the CPU, at
once), so at most two swapped blocks (the window: the one running and the next) are ever on the accelerator.

Backward. Autograd saves what a block's backward needs; a saved base weight would keep its copy on the accelerator
until the backward pass. So while a swapped block runs with autograd recording, saved-tensor hooks replace each
tensor that is (a view of) one of its copies with a token, and the backward pass, when it needs the tensor, copies
the block in again (the next one, going backward, prefetched) and rebuilds the view: the same values, so the
gradients are bitwise those of a run without swapping. With gradient checkpointing nothing is saved in the forward
pass; the backward pass re-runs each block's forward, which copies the block in, and its backward follows before
the block before it comes in.

What stays. The trained tensors (the adapters' parameters) never move: they are on the accelerator, and so are their
gradients, the optimizer's state and the EMA (unless ``--ema_device cpu``). Checkpoints, exports and the EMA hold
trained tensors only, so they see no difference; validation renders through the same blocks, which swap the same.

Refused. Under FSDP2 (which shards the weights already), with ``--torch_compile`` (a compiled block would guard on
the tensors that swapping replaces, and recompile), for a model with no repeated blocks, and for N above their count.
"""

import contextlib
import functools
import logging

import torch

from .compile import repeated_block_classes
from .errors import require

logger = logging.getLogger(__name__)

# Pipeline components whose repeated blocks swap: the denoisers (Wan 2.2's second expert included).
SWAPPED_COMPONENTS = ("transformer", "transformer_2")
# Blocks on the accelerator at once: the one running and the next, being copied.
WINDOW = 2
PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors that hold their own data, unlike a tensor subclass (int8)


def add_block_swap_args(parser):
    """``--blocks_to_swap N`` (0: none)."""
    parser.add_argument(
        "--blocks_to_swap", type=int, default=0, metavar="N",
        help="keep the frozen weights of N of the transformer's repeated blocks in (pinned) CPU memory, each copied to "
             "the accelerator just before it runs, forward and backward, the next one copied meanwhile: less "
             "accelerator memory for some speed; training is bitwise the same")


def repeated_blocks(model):
    """``[(qualified name, block)]``: ``model``'s repeated blocks, in the order they run (that of its module tree).

    The entries of the ``ModuleList``\\ s whose entries are of a class the model declares repeated
    (`compile.repeated_block_classes`), if it declares any; else those of its longest ``ModuleList``\\ s of
    modules of one class (HiDream's wrapped double- and single-stream blocks, SANA's, Lumina 2's ``layers``). A list
    inside another's entries does not count. Empty for a model with no such list."""
    declared = repeated_block_classes(model)

    def lists(keep):
        found = []
        for name, module in model.named_modules():
            if (isinstance(module, torch.nn.ModuleList) and len(module) and keep(module)
                    and not any(name.startswith(f"{outer}.") for outer, _ in found)):
                found.append((name, module))
        return found

    chosen = lists(lambda blocks: all(type(block).__name__ in declared for block in blocks))
    if not chosen:
        chosen = lists(lambda blocks: len({type(block) for block in blocks}) == 1)
        longest = max((len(blocks) for _, blocks in chosen), default=0)
        chosen = [(name, blocks) for name, blocks in chosen if len(blocks) == longest]
    return [(f"{name}.{index}", block) for name, blocks in chosen for index, block in enumerate(blocks)]


def transformer_on_meta(pretrained, revision=None, component="transformer"):
    """The pipeline folder's (or hub id's) ``component``, built from its config on the meta device (no weights
    read), or None where the pipeline has none."""
    from accelerate import init_empty_weights
    from diffusers import DiffusionPipeline

    index = DiffusionPipeline.load_config(pretrained, revision=revision)
    entry = index.get(component)
    if not isinstance(entry, list) or entry[0] != "diffusers" or entry[1] is None:
        return None
    import diffusers

    model_class = getattr(diffusers, entry[1])
    config = model_class.load_config(pretrained, subfolder=component, revision=revision)
    with init_empty_weights():
        return model_class.from_config(config)


def check_block_swap_args(args):
    """Refuse, before any weights load, what block swap cannot do: a negative N, FSDP2, ``--torch_compile``, a
    transformer without repeated blocks, N above their count (read from the transformer's config)."""
    from .sharding.fsdp2 import FSDP2_LAUNCH, fsdp_requested

    count = args.blocks_to_swap
    require(count >= 0, "--blocks_to_swap", count, "a non-negative number of blocks")
    if count == 0:
        return
    require(not fsdp_requested(), "--blocks_to_swap", count,
            f"no FSDP2 launch ({FSDP2_LAUNCH}): FSDP2 shards the weights already; use one or the other")
    require(args.torch_compile is None, "--blocks_to_swap", count,
            "no --torch_compile: a compiled block would recompile whenever swapping replaces its weights")
    model = transformer_on_meta(args.pretrained_model_name_or_path, args.revision)
    blocks = [] if model is None else repeated_blocks(model)
    require(blocks, "--blocks_to_swap", count,
            f"a model with repeated blocks ({type(model).__name__} has none)" if model is not None
            else "a pipeline with a transformer")
    require(count <= len(blocks), "--blocks_to_swap", count,
            f"at most the {len(blocks)} repeated blocks of {type(model).__name__}")


def _inner_tensors(tensor):
    """``[(attribute or None, plain tensor)]`` that hold ``tensor``'s data: itself, or a tensor subclass's inner
    tensors (torchao's int8 ``qdata`` and ``scale``)."""
    if type(tensor) in PLAIN:
        return [(None, tensor)]
    names, _ = tensor.__tensor_flatten__()
    return [(name, getattr(tensor, name)) for name in names]


def _storage_key(tensor):
    return tensor.device, tensor.untyped_storage().data_ptr()


class BlockSwap:
    """Swaps the frozen parameters of ``model``'s first ``count`` repeated blocks between the CPU and ``device``
    (see the module's docstring). Made by `swap_blocks`, before the model moves to ``device``; ``loaded`` lists the
    blocks whose weights are on ``device`` now (never more than `WINDOW`)."""

    def __init__(self, model, count, device):
        self.model = model
        self.device = torch.device(device)
        self.blocks = [block for _, block in repeated_blocks(model)[:count]]
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        pin = self.device.type == "cuda"
        # Per block: [(module, parameter name, CPU tensor, meta placeholder)].
        self.frozen = []
        for block in self.blocks:
            entries = []
            for module in block.modules():
                for name, parameter in module._parameters.items():
                    if parameter is None or parameter.requires_grad:
                        continue
                    master = parameter.data
                    if pin and type(master) is torch.Tensor:
                        master = master.pin_memory()
                    entries.append((module, name, master,
                                    torch.nn.Parameter(master.to("meta"), requires_grad=False)))
            self.frozen.append(entries)
        self.copies = {}  # block index -> (copies, CUDA event or None)
        self.loaded = []  # block indices whose copies are in place
        self.storages = {}  # storage key -> (block index, entry index, inner attribute)
        for index, block in enumerate(self.blocks):
            self._park(index)
            block.forward = self._swapped_forward(index, block.forward)
            block._apply = functools.partial(self._apply_to_resident, index, block)

    # -- moving weights --------------------------------------------------------------------------------------------

    def _fetch(self, index):
        """Start copying block ``index``'s weights to the device (on the side stream where CUDA is)."""
        if index in self.copies:
            return
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            # On the CPU (the tests' accelerator), a copy all the same: torchao's .to(copy=True) shares the storage.
            copies = [master.clone() if master.device == self.device else
                      master.to(self.device, non_blocking=self.stream is not None)
                      for _, _, master, _ in self.frozen[index]]
        self.copies[index] = (copies, self.stream.record_event() if self.stream is not None else None)

    def _load(self, index):
        """Put block ``index``'s copies in place, once copied."""
        if index in self.loaded:
            return
        self._fetch(index)
        copies, event = self.copies[index]
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
        for entry, ((module, name, _, _), copy) in enumerate(zip(self.frozen[index], copies)):
            module._parameters[name] = torch.nn.Parameter(copy, requires_grad=False)
            for attribute, tensor in _inner_tensors(copy):
                if event is not None:  # used on the compute stream: freed only once that has used it
                    tensor.record_stream(current)
                self.storages[_storage_key(tensor)] = (index, entry, attribute)
        self.loaded.append(index)

    def _park(self, index):
        """Drop block ``index``'s copies: its placeholders take their place."""
        copies, _ = self.copies.pop(index, ([], None))
        for copy in copies:
            for _, tensor in _inner_tensors(copy):
                self.storages.pop(_storage_key(tensor), None)
        for module, name, _, placeholder in self.frozen[index]:
            module._parameters[name] = placeholder
        if index in self.loaded:
            self.loaded.remove(index)

    def _use(self, index, direction):
        """Block ``index`` runs next, travelling in ``direction`` (+1 forward, -1 backward): only it and its next
        stay or come in."""
        following = index + direction
        for other in [*self.loaded, *self.copies]:
            if other not in (index, following):
                self._park(other)
        self._load(index)
        if 0 <= following < len(self.blocks):
            self._fetch(following)

    # -- hooks -----------------------------------------------------------------------------------------------------

    def _swapped_forward(self, index, forward):
        @functools.wraps(forward)
        def swapped_forward(*args, **kwargs):
            in_backward = torch._C._current_graph_task_id() != -1  # gradient checkpointing re-running the block
            self._use(index, -1 if in_backward else 1)
            # Checkpointing saves nothing in the forward pass, and keeps what its re-run saves for the backward that
            # follows at once: hooks only where autograd records a forward pass it keeps.
            saving = torch.is_grad_enabled() and not getattr(self.model, "gradient_checkpointing", False)
            try:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack) if saving else \
                        contextlib.nullcontext():
                    return forward(*args, **kwargs)
            finally:
                if not in_backward:
                    self._park(index)

        return swapped_forward

    def _pack(self, tensor):
        if type(tensor) not in PLAIN or tensor.device.type != self.device.type:
            return tensor
        found = self.storages.get(_storage_key(tensor))
        if found is None:
            return tensor
        return found, tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset()

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        (index, entry, attribute), dtype, size, stride, offset = packed
        self._use(index, -1)
        copy = self.copies[index][0][entry]
        source = copy if attribute is None else getattr(copy, attribute)
        return torch.empty(0, dtype=dtype, device=source.device).set_(source.untyped_storage(), offset, size, stride)

    def _apply_to_resident(self, index, block, fn, recurse=True):
        """A swapped block's ``_apply`` (what ``.to()`` calls): its placeholders stay as they are (the CPU copies
        keep the dtype they had when swapping began), the rest (its adapters) moves."""
        self._park(index)
        for module, name, _, _ in self.frozen[index]:
            module._parameters[name] = None
        try:
            return torch.nn.Module._apply(block, fn, recurse)
        finally:
            for module, name, _, placeholder in self.frozen[index]:
                module._parameters[name] = placeholder


def swap_blocks(pipe, name, module, device):
    """Start swapping ``module``'s blocks (`BlockSwap`) if it is the ``name`` component of ``pipe`` that
    ``--blocks_to_swap`` asks for (`pipeline.load_pipeline` records it as ``pipe.blocks_to_swap``). Call once its
    dtypes are final and before it moves to ``device``. Returns the `BlockSwap`, or None."""
    count = getattr(pipe, "blocks_to_swap", 0)
    if not count or name not in SWAPPED_COMPONENTS:
        return None
    swap = BlockSwap(module, count, device)
    logger.info(f"--blocks_to_swap: the frozen weights of {count} of the {len(repeated_blocks(module))} blocks of "
                f"{name} stay in CPU memory")
    return swap
