"""`training_utils.compile`: regional compilation with LoRA, gradient checkpointing and the EMA swap.

The tests compile with the "aot_eager" backend: dynamo traces, guards and recompiles exactly as with inductor,
and AOTAutograd builds the joint forward-backward graphs, but no code is generated (inductor's C++ compile of
the tiny UNet's blocks takes about two minutes on two CPU cores). The counts are dynamo's, whatever the backend.
"""

import argparse
import contextlib
import re
from pathlib import Path

import pytest
import torch

from training_utils.adapters.injection import ATTENTION_PROJECTIONS, add_lora
from training_utils.compile import add_compile_args, compilation_count, compile_repeated_blocks
from training_utils.ema import tensors_swapped_in
from training_utils.testing.tiny.parts import tiny_unet

REPO = Path(__file__).resolve().parent.parent
BACKEND = "aot_eager"
STEPS = 3
# aot_eager runs the graphs with eager's kernels: the weights come out bitwise equal (inductor's fused kernels
# round differently: the device benchmark compares its first-step losses with eager's).
TOLERANCE = 0.0


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def lora_unet():
    # one block width and head count: every BasicTransformerBlock shares its graphs, which keeps compiling short
    unet = tiny_unet(seed=0, block_out_channels=(32, 32), attention_head_dim=(2, 2))
    torch.manual_seed(1)  # the LoRA's gaussian init
    add_lora(unet, 4, ATTENTION_PROJECTIONS)
    unet.enable_gradient_checkpointing()
    return unet.train()


def trained_parameters(model):
    return {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}


def training_batch(batch_size=2):
    generator = torch.Generator().manual_seed(2)
    return (torch.randn(batch_size, 4, 16, 16, generator=generator), torch.tensor([10, 500][:batch_size]),
            torch.randn(batch_size, 7, 32, generator=generator))


def train(unet, optimizer, steps):
    for _ in range(steps):
        sample, timesteps, text = training_batch()
        loss = unet(sample, timesteps, text, return_dict=False)[0].pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def validation_cycle(unet, ema_tensors, optimizer):
    """What a validation with EMA does to the model, then one more training step: render with the raw weights,
    swap the EMA's in (in place) and render again, in eval mode under no_grad, at another batch size."""
    parameters = trained_parameters(unet)
    for swap in (contextlib.nullcontext, lambda: tensors_swapped_in(parameters, ema_tensors)):
        with swap():
            unet.eval()
            with torch.no_grad():
                unet(torch.randn(4, 4, 16, 16), torch.tensor([999, 600, 300, 1]), torch.randn(4, 7, 32))
            unet.train()
    train(unet, optimizer, 1)


def test_compiled_training_matches_eager_and_validation_does_not_recompile():
    eager = lora_unet()
    train(eager, torch.optim.AdamW(trained_parameters(eager).values(), lr=1e-3), STEPS)

    compiled = lora_unet()
    assert compile_repeated_blocks(compiled, BACKEND) == {"BasicTransformerBlock": 4}
    optimizer = torch.optim.AdamW(trained_parameters(compiled).values(), lr=1e-3)
    before = compilation_count()
    train(compiled, optimizer, STEPS)
    for name, parameter in trained_parameters(compiled).items():
        torch.testing.assert_close(parameter, trained_parameters(eager)[name], rtol=0, atol=TOLERANCE, msg=name)
    # the names every export and the EMA key by are the eager model's
    assert compiled.state_dict().keys() == eager.state_dict().keys()

    training_graphs = compilation_count() - before
    ema_tensors = {name: parameter.detach() * 0.5 for name, parameter in trained_parameters(compiled).items()}
    validation_cycle(compiled, ema_tensors, optimizer)
    after_one_cycle = compilation_count() - before
    for _ in range(2):
        validation_cycle(compiled, ema_tensors, optimizer)
    # One block width: training makes 2 graphs (the first block's input needs no grad, the others' do), the
    # first validation 1 (no_grad, eval, another batch); the EMA swap and every later validation none.
    assert (training_graphs, after_one_cycle) == (2, 3)
    assert compilation_count() - before == after_one_cycle


class NoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, inputs):
        return self.second(torch.nn.functional.gelu(self.first(inputs)))


def test_a_model_without_repeated_blocks_is_compiled_whole():
    torch.manual_seed(0)
    model = NoBlocks()
    inputs = torch.randn(3, 8)
    expected = model(inputs)
    keys = model.state_dict().keys()
    assert compile_repeated_blocks(model, BACKEND) == {"NoBlocks": 1}
    before = compilation_count()
    torch.testing.assert_close(model(inputs), expected, rtol=0, atol=TOLERANCE)
    assert compilation_count() - before == 1
    assert model.state_dict().keys() == keys  # compiled in place: no "_orig_mod." wrapper


def test_controlnet_compiles_the_blocks_it_shares_with_the_unet():
    from diffusers import ControlNetModel

    controlnet = ControlNetModel.from_unet(tiny_unet(), conditioning_embedding_out_channels=(16, 32))
    assert compile_repeated_blocks(controlnet, BACKEND) == {"BasicTransformerBlock": 2}


def test_disabled_compiles_nothing_and_the_flag_parses():
    unet = tiny_unet()
    assert compile_repeated_blocks(unet, None) == {}
    assert all(module._compiled_call_impl is None for module in unet.modules())
    parser = argparse.ArgumentParser()
    add_compile_args(parser)
    assert parser.parse_args([]).torch_compile is None
    assert parser.parse_args(["--torch_compile"]).torch_compile == "inductor"
    assert parser.parse_args(["--torch_compile", "aot_eager"]).torch_compile == "aot_eager"


@pytest.mark.parametrize("script", sorted((REPO / "examples").rglob("*.py")), ids=lambda path: path.stem)
def test_every_script_compiles_its_trained_model_after_its_last_change_and_before_accelerate_wraps_it(script):
    source = script.read_text()
    # At the top of main, or in a loop over the models that train (Wan 2.2's two experts).
    call = re.search(r"\n +compile_repeated_blocks\((\w+), args\.torch_compile\)\n", source)
    assert call, f"{script.name} does not call compile_repeated_blocks(<model>, args.torch_compile)"
    model = call.group(1)
    # After its adapter, casting and gradient checkpointing; before DDP may wrap it.
    # (Gradient checkpointing where the script has it: Kandinsky's prior refuses --gradient_checkpointing.)
    # (A transformers model, LLaDA2's, names it gradient_checkpointing_enable.)
    checkpointing = [] if '"--gradient_checkpointing":' in source else [
        next((call for call in (f"{model}.enable_gradient_checkpointing()", f"{model}.gradient_checkpointing_enable()")
              if call in source), f"{model}.enable_gradient_checkpointing()")]
    for before in ("prepare_components(", *checkpointing):
        assert source.index(before) < call.start(), (script.name, before)
    prepared = source.index("= prepare_trained(accelerator, trained, ")
    assert call.start() < prepared, script.name
