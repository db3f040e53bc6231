"""`training_utils.block_swap` (``--blocks_to_swap``): which blocks are found, that training with swapped blocks is
bitwise that without, and that no more than the window of blocks is ever materialised, forward and backward."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from accelerate import init_empty_weights
from diffusers import FluxTransformer2DModel
from peft import LoraConfig
from torch.multiprocessing.reductions import StorageWeakRef

from training_utils.block_swap import WINDOW, BlockSwap, _inner_tensors, check_block_swap_args, repeated_blocks
from training_utils.errors import UsageError


def tiny_flux(int8=False):
    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=3, attention_head_dim=8,
                                   num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8,
                                   guidance_embeds=False, axes_dims_rope=(2, 2, 4))
    model.requires_grad_(False)
    if int8:  # what --quantize_base int8 loads: torchao's int8 weight-only linear layers
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig())
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian",
                                 target_modules=["to_q", "to_k", "to_v", "proj_out", "ff.net.2"]))
    return model


def batch(step):
    generator = torch.Generator().manual_seed(step)
    return dict(hidden_states=torch.randn(2, 16, 4, generator=generator),
                encoder_hidden_states=torch.randn(2, 5, 16, generator=generator),
                pooled_projections=torch.randn(2, 8, generator=generator),
                timestep=torch.rand(2, generator=generator), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3),
                return_dict=False)


def train(blocks_to_swap, checkpointing, steps=3, on_step=None, int8=False):
    """The adapter's tensors after ``steps`` AdamW steps of the tiny FLUX.1 transformer, and its no-grad output."""
    model = tiny_flux(int8)
    swap = BlockSwap(model, blocks_to_swap, "cpu") if blocks_to_swap else None
    model.to("cpu")  # what prepare_components and accelerate do: the placeholders stay, the rest moves
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    trained = {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}
    optimizer = torch.optim.AdamW(trained.values(), lr=1e-2)
    for step in range(steps):
        loss = model(**batch(step))[0].square().mean()
        if on_step is not None:
            on_step(swap, loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        rendered = model(**batch(steps))[0]
    return {name: tensor.detach().clone() for name, tensor in trained.items()}, rendered, swap


def test_repeated_blocks():
    names = [name for name, _ in repeated_blocks(tiny_flux())]
    assert names == ["transformer_blocks.0", "transformer_blocks.1", "single_transformer_blocks.0",
                     "single_transformer_blocks.1", "single_transformer_blocks.2"]

    with init_empty_weights():  # a declared class counts in a list of one
        one_double = FluxTransformer2DModel(num_layers=1, num_single_layers=2, attention_head_dim=8,
                                            num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8,
                                            axes_dims_rope=(2, 2, 4))
    assert [name for name, _ in repeated_blocks(one_double)] == [
        "transformer_blocks.0", "single_transformer_blocks.0", "single_transformer_blocks.1"]

    class Undeclared(torch.nn.Module):  # no _repeated_blocks: the longest lists of one class, not those inside them
        def __init__(self):
            super().__init__()
            self.short = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
            self.mixed = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2)])
            self.long = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 5))
                                             for _ in range(3)])

    assert [name for name, _ in repeated_blocks(Undeclared())] == ["long.0", "long.1", "long.2"]
    assert repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())) == []


@pytest.mark.parametrize("checkpointing, int8", [(False, False), (True, False), (False, True)],
                         ids=["plain", "checkpointing", "int8"])
def test_swapping_trains_bitwise_the_same(checkpointing, int8):
    expected, expected_render, _ = train(0, checkpointing, int8=int8)
    swapped, render, swap = train(4, checkpointing, int8=int8)
    assert swapped.keys() == expected.keys() and len(expected) > 0
    for name in expected:
        assert torch.equal(swapped[name], expected[name]), name
    assert torch.equal(render, expected_render)
    # The trained tensors never left; the swapped blocks' base weights are placeholders again, their CPU copies kept.
    assert all(block.attn.to_q.base_layer.weight.is_meta for block in swap.blocks[:2])
    assert not any(tensor.is_meta for tensor in swapped.values())
    assert swap.loaded == [] and swap.copies == {}  # the last forward pass (the render) put every block back


@pytest.mark.parametrize("checkpointing, int8", [(False, False), (True, False), (True, True)],
                         ids=["plain", "checkpointing", "int8_checkpointing"])
def test_no_more_than_the_window_is_materialised(checkpointing, int8):
    """Each copy's storage is tracked by a weak reference: alive while anything (a parameter, a tensor autograd
    saved) holds it. Sampled whenever a linear layer runs (forward, and checkpointing's re-run) and before every node
    of the backward pass, the swapped blocks with a live copy never exceed the window; and each block has its weights
    in place whenever one of its layers runs, and was copied back in during the backward pass."""
    alive = {}  # block index -> [weak references to its copies' storages]
    samples, ran_without_weights, backward_blocks = [], [], set()

    def materialised():
        return {index for index, storages in alive.items() if any(not ref.expired() for ref in storages)}

    original_fetch = BlockSwap._fetch

    def fetch(self, index):
        fresh = index not in self.copies
        original_fetch(self, index)
        if fresh:
            alive.setdefault(index, []).extend(StorageWeakRef(tensor.untyped_storage()) for copy in self.copies[index][0]
                                               for _, tensor in _inner_tensors(copy))

    def watch_linears(swap):
        for index, block in enumerate(swap.blocks):
            for layer in block.modules():
                if isinstance(layer, torch.nn.Linear):
                    def check(layer, inputs, index=index):
                        samples.append(len(materialised()))
                        if layer.weight.is_meta:  # (never true of torchao's linear layers: see `tiny_flux`)
                            ran_without_weights.append(index)
                    layer.register_forward_pre_hook(check)

    def on_step(swap, loss):
        if not samples:
            watch_linears(swap)
        nodes, seen = [loss.grad_fn], set()
        while nodes:  # every node of the backward graph samples before it runs
            node = nodes.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            node.register_prehook(lambda grads: (samples.append(len(materialised())),
                                                 backward_blocks.update(materialised())) and None)
            nodes.extend(next_node for next_node, _ in node.next_functions)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(BlockSwap, "_fetch", fetch)
    try:
        train(5, checkpointing, steps=2, on_step=on_step, int8=int8)
    finally:
        monkeypatch.undo()
    assert samples and max(samples) <= WINDOW < 5
    assert ran_without_weights == []
    assert backward_blocks == set(range(5))


# Every transformer family's tiny pipeline: (fixture, its render's keyword arguments, what prepares it to render).
def families():
    from test_train_dreambooth_transformers import FAMILIES

    rows = []
    for family in FAMILIES:
        length = dict(zip(family.flags[::2], family.flags[1::2])).get("--max_sequence_length")
        rows.append(pytest.param(family.name, {**family.render_kwargs,
                                               **({"max_sequence_length": length} if length else {})},
                                 family.prepare_render, id=family.name))
    video = {"num_frames": 5, "max_sequence_length": 16, "guidance_scale": 1.0}
    return [*rows, pytest.param("wan21", video, None, id="wan21"), pytest.param("wan22", video, None, id="wan22")]


@pytest.mark.parametrize("fixture, render_kwargs, prepare", families())
def test_every_transformer_family_swaps_neutrally(tiny, fixture, render_kwargs, prepare):
    """Each family's tiny transformer(s), an adapter on every linear layer of their blocks, all blocks swapped: the
    gradients of a step on what the pipeline's sampling loop feeds the transformer, and the render, are those
    without swapping (bitwise but for the alignment of the copied weights)."""
    from diffusers import DiffusionPipeline

    from training_utils.block_swap import SWAPPED_COMPONENTS
    from training_utils.pipeline import from_pretrained

    pipe = from_pretrained(DiffusionPipeline, tiny[fixture])
    pipe.set_progress_bar_config(disable=True)
    if prepare is not None:
        prepare(pipe)
    transformers = [getattr(pipe, name) for name in SWAPPED_COMPONENTS if getattr(pipe, name, None) is not None]
    calls = []
    for transformer in transformers:
        transformer.requires_grad_(False)
        blocks = repeated_blocks(transformer)
        assert blocks, type(transformer).__name__
        layers = [f"{name}.{layer}" for name, block in blocks for layer, module in block.named_modules()
                  if isinstance(module, torch.nn.Linear)]
        torch.manual_seed(0)
        transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian", target_modules=layers))
        transformer.register_forward_pre_hook(
            lambda module, args, kwargs: calls.append((module, args, kwargs)) if len(calls) < len(transformers) else
            None, with_kwargs=True)

    def render():
        output = pipe(prompt="a photo of sks triangle", num_inference_steps=2, height=32, width=32,
                      output_type="np", generator=torch.Generator().manual_seed(0), **render_kwargs)
        return torch.from_numpy(output.frames if hasattr(output, "frames") else output.images)

    def gradients():
        for transformer, args, kwargs in calls:
            output = transformer(*args, **kwargs)
            sample = output[0] if isinstance(output, tuple) else output.sample
            torch.stack([part.float().square().mean() for part in sample]).sum().backward()  # Z-Image's: a list
        grads = {(id(transformer), name): parameter.grad.clone() for transformer in transformers
                 for name, parameter in transformer.named_parameters() if parameter.grad is not None}
        for transformer in transformers:
            transformer.zero_grad(set_to_none=True)
        return grads

    expected_render = render()
    expected = gradients()
    for transformer in transformers:
        BlockSwap(transformer, len(repeated_blocks(transformer)), "cpu")
    # The same operations on the same values, but the swapped weights are copies at other addresses, and some CPUs'
    # kernels (seen on AMD EPYC, for Qwen-Image) round a last bit by the data's alignment: equal to float32's rounding.
    torch.testing.assert_close(render(), expected_render, rtol=0, atol=1e-6)
    swapped = gradients()
    assert swapped.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(swapped[key], expected[key], rtol=1e-5, atol=1e-7)
    assert any(grad.abs().sum() > 0 for grad in expected.values())


@pytest.mark.parametrize("flags, env, message", [
    (["--blocks_to_swap", -1], {}, "--blocks_to_swap=-1: expected a non-negative number of blocks"),
    (["--blocks_to_swap", 1, "--torch_compile", "aot_eager"], {},
     "--blocks_to_swap=1: expected no --torch_compile: a compiled block would recompile whenever swapping replaces "
     "its weights"),
    (["--blocks_to_swap", 1], {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"},
     "--blocks_to_swap=1: expected no FSDP2 launch (accelerate launch --use_fsdp --fsdp_version 2): FSDP2 shards the "
     "weights already; use one or the other"),
    (["--use_8bit_adam"], {}, "--use_8bit_adam=True: expected bitsandbytes installed (pip install bitsandbytes)"),
], ids=["negative", "compiled", "fsdp2", "8bit_adam_without_bitsandbytes"])
def test_refused_in_one_line_before_anything_loads(tiny, tmp_path, monkeypatch, flags, env, message):
    """(FLUX.1's table row refuses more blocks than the model has.)"""
    from helpers import usage_error
    from test_train_dreambooth_transformers import FAMILIES, common

    if flags[0] == "--use_8bit_adam" and importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed here")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    flux = next(family for family in FAMILIES if family.name == "flux")
    assert usage_error(flux.script, *common(tiny, flux, tmp_path / "out", *flags)) == f"error: {message}"
    assert not (tmp_path / "out").exists()


def test_a_pipeline_without_a_transformer_is_refused(tiny):
    args = SimpleNamespace(pretrained_model_name_or_path=str(tiny["sd"]), revision=None, torch_compile=None,
                           blocks_to_swap=1)
    with pytest.raises(UsageError, match=r"^--blocks_to_swap=1: expected a pipeline with a transformer$"):
        check_block_swap_args(args)
    args.pretrained_model_name_or_path = str(tiny["flux"])
    check_block_swap_args(args)
    args.blocks_to_swap = 4
    with pytest.raises(UsageError, match=r"expected at most the 3 repeated blocks of FluxTransformer2DModel$"):
        check_block_swap_args(args)
