"""``--torch_compile``: compile the trained model's repeated blocks (regional compilation).

What is compiled. The blocks that a model repeats: the classes its ``_repeated_blocks`` names (diffusers'
list for `compile_repeated_blocks`: ``BasicTransformerBlock`` in the UNet, ``Flux2TransformerBlock`` and
``Flux2SingleTransformerBlock`` in FLUX.2, ...), else the classes `REPEATED_BLOCKS` names for models that do
not declare them (ControlNet, SD3), else, for a model with neither, the whole model. Each is compiled in place
(``module.compile()``): the model object, its parameters and its state-dict keys stay what they were (no
``_orig_mod.`` prefix), so LoRA export, checkpoints, the EMA's names and the validation pipeline, which holds
the same object, see no difference, and validation renders through the compiled blocks.

Why regional. A model repeats one block tens of times; compiling the block once and reusing the code for every
instance of the same shapes takes a fraction of a whole-model compile, and the blocks hold nearly all of the
compute. What lies between the blocks (embeddings, convolutions of the UNet's resnets, gradient checkpointing's
`torch.utils.checkpoint` calls, the pipeline's Python) stays eager, so nothing there can break a graph.

What recompiles and what does not. Dynamo guards each compiled graph on what it assumed: the input shapes,
dtypes and ``requires_grad``, grad mode, autocast, the modules' ``training`` flags and the Python attributes it
read (peft's active adapter, for one). It does not guard on parameter values:

* the EMA swap (`ema.tensors_swapped_in`) copies values into the same parameters in place: no recompilation;
* an optimizer step, a checkpoint load (`load_state_dict` copies in place too): none;
* blocks of one class at different widths (SDXL's 640 and 1280 channels) get one graph per width: the width
  sizes the layer norms, so it stays specialised; batch and sequence length become dynamic at the second size
  dynamo sees, so other batches and resolutions reuse that graph;
* a block whose input does not require grad (the first one behind frozen layers) gets its own graph;
* validation renders under ``torch.no_grad``: one more graph per width (grad mode is guarded), whose batch and
  sequence length are dynamic. Train/eval mode and autocast are guarded too: each further combination of them
  that runs a block adds one graph per width (the tiny UNet: eval mode together with no_grad, +1; no_grad in
  train mode besides, +1 more; autocast besides, +1 more). All are made at the first validation and reused by
  every later one.

So the number of compilations is bounded by the distinct (width, input requires_grad, grad mode, train/eval,
autocast) combinations that training and validation use, whatever the number of steps, validations and EMA swaps
(``tests/test_compile.py`` counts them: 2 graphs for training the tiny UNet, 1 more for validating it, however
often). Changing a parameter's dtype, device or ``requires_grad`` after the first step would recompile: compile
after the model has its final structure and dtypes. Past dynamo's recompile limit per block class
(``torch._dynamo.config.recompile_limit``, 8) a block runs eager, with a warning; SDXL's UNet should use 5 (training:
640 channels with and without grad on the input, 1280; validation: both widths).
"""

import logging
from collections import Counter

import torch

logger = logging.getLogger(__name__)

# Models whose classes declare no ``_repeated_blocks`` in the installed diffusers: the class of the blocks they
# repeat, as diffusers names it for the models that do declare them.
REPEATED_BLOCKS = {
    "ControlNetModel": ("BasicTransformerBlock",),  # the UNet's encoder half, with the UNet's blocks
    "SD3Transformer2DModel": ("JointTransformerBlock",),
    "SD3ControlNetModel": ("JointTransformerBlock",),
}


def add_compile_args(parser):
    parser.add_argument(
        "--torch_compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
        help="compile the trained model's repeated blocks with torch.compile (regional compilation), with BACKEND "
             "(default inductor; aot_eager traces without generating code, to debug): the first steps and the "
             "first validation take longer while they compile, every later one runs faster")


def declared_repeated_blocks(model):
    """The class names ``model`` declares repeated (diffusers' ``_repeated_blocks``), none where it declares none."""
    return tuple(getattr(model, "_repeated_blocks", None) or ())


def repeated_block_classes(model):
    """The class names of ``model``'s repeated blocks: its ``_repeated_blocks``, else `REPEATED_BLOCKS`'."""
    return declared_repeated_blocks(model) or REPEATED_BLOCKS.get(type(model).__name__, ())


def compile_repeated_blocks(model, backend, fullgraph=False):
    """Compile ``model``'s repeated blocks in place with ``backend`` (``--torch_compile``), or the whole model if it
    has none; ``backend`` None does nothing. Compilation itself is lazy: it happens in the first forward pass of
    each block.

    Call it once the model has its final structure and dtypes (after adding LoRA, casting and enabling gradient
    checkpointing) and before ``accelerator.prepare``, which may wrap the model in DDP. Returns
    ``{class name: number of modules compiled}`` (empty when not enabled), for the log.

    ``fullgraph`` stays False by default: a graph break (a quantised base's kernels, for one) then costs speed
    in that block instead of stopping the run. ``backend="aot_eager"`` traces the same graphs without generating
    code (the tests use it: inductor's C++ compile of even a tiny block takes minutes on a small CPU).
    """
    if backend is None:
        return {}
    names = repeated_block_classes(model)
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        blocks = [model]
    for block in blocks:
        block.compile(backend=backend, fullgraph=fullgraph)
    compiled = dict(Counter(type(block).__name__ for block in blocks))
    logger.info(f"--torch_compile: {backend} compiles, at their first call, "
                + ", ".join(f"{count} {name}" for name, count in compiled.items()))
    return compiled


def compilation_count():
    """How many graphs dynamo has compiled in this process so far (``torch._dynamo.reset()`` does not zero it:
    compare two counts)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
