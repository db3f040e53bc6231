"""`training_utils.sharding.fsdp2` and the EMA's shard-local half, in this process: the launch checks, the plugin, and
sharded tensors as process 1 of 2 sees them (torch's fake process group: shapes and placements as in a real
two-process run, no other process). Gathering and a whole run sharded are `test_fsdp2`'s."""

import pytest
import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from training_utils.ema import EMA, tensors_swapped_in
from training_utils.errors import UsageError
from training_utils.sharding.fsdp2 import (TrainedModules, any_sharded, check_launch, declare_unit_blocks,
                                           describe_held_bytes, enable_fsdp2_on_cpu, fsdp2_plugin, held_bytes,
                                           local_part, local_tensor, one_model_of, unit_blocks, unsharded_class,
                                           whole_bytes, without_model_state)


@pytest.fixture
def clean_launch(monkeypatch):
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_AUTO_WRAP_POLICY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_deepspeed_and_fsdp1_are_refused_in_one_line_naming_fsdp2(clean_launch):
    check_launch()
    clean_launch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(UsageError, match=r"^DeepSpeed is not supported here: shard with FSDP2 \(accelerate launch "
                                         r"--use_fsdp --fsdp_version 2\)$"):
        check_launch()
    clean_launch.delenv("ACCELERATE_USE_DEEPSPEED")
    clean_launch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(UsageError, match=r"^FSDP version 1 is not supported here: shard with FSDP2"):
        check_launch()
    clean_launch.setenv("FSDP_VERSION", "2")
    check_launch()
    quantized = type("Args", (), {"quantize_base": "int8", "bnb_quantization_config_path": None})()
    with pytest.raises(UsageError, match=r"^--quantize_base='int8': expected no quantised base under FSDP2 "):
        check_launch(quantized)
    clean_launch.delenv("ACCELERATE_USE_FSDP")
    check_launch(quantized)


def test_the_plugin_wraps_per_repeated_block_unless_the_launch_says_otherwise(clean_launch):
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
    assert fsdp2_plugin() is None
    clean_launch.setenv("ACCELERATE_USE_FSDP", "true")
    clean_launch.setenv("FSDP_VERSION", "2")
    plugin = fsdp2_plugin()
    assert plugin.fsdp_version == 2 and plugin.auto_wrap_policy is transformer_auto_wrap_policy
    clean_launch.setenv("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP")
    assert fsdp2_plugin().auto_wrap_policy is size_based_auto_wrap_policy


def test_cpu_processes_asked_for_fsdp2_take_accelerates_fsdp_path(clean_launch):
    clean_launch.setenv("ACCELERATE_USE_FSDP", "true")
    clean_launch.setenv("FSDP_VERSION", "2")
    plugin = fsdp2_plugin()
    clean_launch.setitem(PartialState._shared_state, "distributed_type", DistributedType.MULTI_CPU)

    class State:
        distributed_type = DistributedType.MULTI_CPU
        mixed_precision = "bf16"
        fsdp_plugin = None

    accelerator = type("Accelerator", (), {"state": State()})()
    enable_fsdp2_on_cpu(accelerator, plugin)
    assert accelerator.state.distributed_type == DistributedType.FSDP and accelerator.state.fsdp_plugin is plugin
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    assert PartialState._shared_state["distributed_type"] == DistributedType.FSDP  # later AcceleratorState()s too
    single = type("Accelerator", (), {"state": type("State", (), {"distributed_type": DistributedType.NO})()})()
    enable_fsdp2_on_cpu(single, plugin)
    assert single.state.distributed_type == DistributedType.NO


@pytest.fixture
def second_of_two():
    """This process as process 1 of 2 (a fake group: no other process, collectives do nothing)."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def sharded(whole, mesh):
    """``whole`` as FSDP2 shards it (dim 0, torch.chunk's split), this process's rows in its local tensor."""
    rows = -(-whole.shape[0] // 2)
    return torch.nn.Parameter(DTensor.from_local(whole[rows:].clone(), mesh, [Shard(0)], run_check=False,
                                                 shape=whole.shape, stride=whole.stride()))


def test_local_part_is_this_processs_rows(second_of_two):
    whole = torch.arange(10.0).reshape(5, 2)
    parameter = sharded(whole, second_of_two)
    assert torch.equal(local_part(whole, parameter), whole[3:])
    assert torch.equal(local_tensor(parameter), whole[3:])
    assert local_part(whole, torch.zeros(5, 2)) is whole and any_sharded({"a": parameter})


def test_the_ema_keeps_and_updates_this_processs_part_only(second_of_two):
    generator = torch.Generator().manual_seed(0)
    wholes = {"a": torch.randn(5, 2, generator=generator), "b": torch.randn(3, generator=generator)}
    ema = EMA({name: torch.nn.Parameter(whole.clone()) for name, whole in wholes.items()}, decay=0.5)
    ema.rebind({name: sharded(whole, second_of_two) for name, whole in wholes.items()})  # as prepare replaces them
    assert {name: shadow.shape for name, shadow in ema.shadows.items()} == {"a": (2, 2), "b": (1,)}
    assert torch.equal(ema.shadows["a"], wholes["a"][3:]) and ema.num_bytes == 4 * 5
    ema.update(1)
    with torch.no_grad():
        for parameter in ema.parameters.values():
            local_tensor(parameter).add_(1.0)
    ema.update(2)
    assert torch.allclose(ema.shadows["a"], wholes["a"][3:] + 0.5)
    live = {name: local_tensor(parameter).clone() for name, parameter in ema.parameters.items()}
    with ema.swapped_in():
        assert torch.equal(local_tensor(ema.parameters["a"]), ema.shadows["a"])
    assert all(torch.equal(local_tensor(ema.parameters[name]), live[name]) for name in live)
    ema.load_state_dict({"shadows": {name: whole * 2 for name, whole in wholes.items()}, "step": 2})  # whole tensors
    assert torch.equal(ema.shadows["b"], wholes["b"][2:] * 2)


def test_whole_tensors_swapped_into_sharded_parameters_are_cut_to_this_processs_part(second_of_two):
    whole = torch.arange(10.0).reshape(5, 2)
    parameter = sharded(whole, second_of_two)
    with tensors_swapped_in({"a": parameter}, {"a": -whole}):
        assert torch.equal(local_tensor(parameter), -whole[3:])
    assert torch.equal(local_tensor(parameter), whole[3:])


def test_held_bytes_count_what_trains_what_is_frozen_and_the_averages():
    module = torch.nn.Linear(4, 3)
    module.weight.requires_grad_(False)
    ema = EMA({"bias": module.bias}, decay=0.5)
    assert held_bytes({"linear": module}, [ema, None]) == {"frozen": 48, "trained": 12, "ema": 12}
    assert whole_bytes({"linear": module}, [ema]) == {"frozen": 48, "trained": 12, "ema": 12}
    assert describe_held_bytes([{"frozen": 24}, {"frozen": 24}], {"frozen": 48}) == (
        "sharded over 2 processes with FSDP2: process 0: frozen 24 B; process 1: frozen 24 B (whole: frozen 48 B)")


def test_several_trained_modules_are_one_model_whose_units_are_each_module_and_its_blocks():
    class Block(torch.nn.Linear):
        pass

    class Denoiser(torch.nn.Module):
        _no_split_modules = ["Block", "RelativeNotInIt"]

        def __init__(self):
            super().__init__()
            self.block = Block(2, 2)

    trained = {"unet": Denoiser(), "text_encoder": torch.nn.Linear(2, 2)}
    container = one_model_of(trained)
    assert isinstance(container, TrainedModules) and container["unet"] is trained["unet"]
    assert container._no_split_modules == ["Block", "Denoiser", "Linear"]
    with pytest.raises(TypeError, match="called one by one"):
        container()


def test_a_model_that_declares_only_repeated_blocks_is_sharded_per_block(clean_launch):
    """LTX-Video's transformer declares ``_repeated_blocks`` and no ``_no_split_modules``: its blocks are still FSDP2
    units (accelerate's wrap policy picks them), alone or among several trained modules; a model's own list wins."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from diffusers import ControlNetModel, LTXVideoTransformer3DModel, WanTransformer3DModel

    ltx = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
                                     cross_attention_dim=16, num_layers=2, caption_channels=16)
    assert ltx._no_split_modules is None and unit_blocks(ltx) == ("LTXVideoTransformerBlock",)
    assert one_model_of({"transformer": ltx, "text_encoder": torch.nn.Linear(2, 2)})._no_split_modules == [
        "LTXVideoTransformer3DModel", "LTXVideoTransformerBlock", "Linear"]
    clean_launch.setenv("ACCELERATE_USE_FSDP", "true")
    clean_launch.setenv("FSDP_VERSION", "2")
    declare_unit_blocks(ltx)
    policy = fsdp2_prepare_auto_wrap_policy(fsdp2_plugin(), ltx)
    assert [name for name, module in ltx.named_modules() if policy(module)] == ["transformer_blocks.0",
                                                                                "transformer_blocks.1"]
    assert LTXVideoTransformer3DModel._no_split_modules is None  # the instance's list, not the class's
    linear = torch.nn.Linear(2, 2)
    declare_unit_blocks(linear)
    assert unit_blocks(linear) == () and not hasattr(linear, "_no_split_modules")
    assert unit_blocks(WanTransformer3DModel) == ("WanTransformerBlock",)
    assert unit_blocks(ControlNetModel) == ()  # declares neither: one unit, as before


def test_accelerates_model_state_is_skipped_only_inside_and_only_sharded():
    import accelerate.accelerator
    writer, reader = accelerate.accelerator.save_fsdp_model, accelerate.accelerator.load_fsdp_model
    optimizer_writer = accelerate.accelerator.save_fsdp_optimizer
    with without_model_state(type("Accelerator", (), {"is_fsdp2": False})()):
        assert accelerate.accelerator.save_fsdp_model is writer
    with without_model_state(type("Accelerator", (), {"is_fsdp2": True})()):
        assert accelerate.accelerator.save_fsdp_model("plugin", "accelerator", "model", "folder", 0) is None
        assert accelerate.accelerator.load_fsdp_model("plugin", "accelerator", "model", "folder", 0) is None
        assert accelerate.accelerator.save_fsdp_optimizer is optimizer_writer
    assert (accelerate.accelerator.save_fsdp_model, accelerate.accelerator.load_fsdp_model) == (writer, reader)


def test_a_fully_trained_module_made_plain_again(second_of_two):
    from torch.distributed.fsdp import fully_shard

    from training_utils.sharding.fsdp2 import plain_modules, unshard_trained
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    for block in model:
        fully_shard(block, mesh=second_of_two)
    fully_shard(model, mesh=second_of_two)
    assert unsharded_class(model) is torch.nn.Sequential
    with pytest.raises(ValueError, match="still holds sharded parameters"):
        plain_modules({"model": model})
    unshard_trained({"model": model})
    plain_modules({"model": model})
    assert type(model) is torch.nn.Sequential and all(type(block) is torch.nn.Linear for block in model)
    assert not any(module._forward_pre_hooks or module._forward_hooks for module in model.modules())
    inputs = torch.ones(1, 4)
    expected = torch.nn.functional.linear(torch.nn.functional.linear(inputs, model[0].weight, model[0].bias),
                                          model[1].weight, model[1].bias)
    assert torch.equal(model(inputs), expected)  # no FSDP hook puts shards back


def test_a_sharded_text_encoder_still_records_its_hidden_states(second_of_two):
    from torch.distributed.fsdp import fully_shard
    from transformers import CLIPTextConfig, CLIPTextModel

    from training_utils.sharding.fsdp2 import keep_recorded_outputs
    torch.manual_seed(0)
    encoder = CLIPTextModel(CLIPTextConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                           num_attention_heads=2, max_position_embeddings=8))
    fully_shard(encoder, mesh=second_of_two)
    keep_recorded_outputs({"text_encoder": encoder})
    output = encoder(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert output.hidden_states is not None and len(output.hidden_states) == 3


def test_units_and_unsharding_of_a_fully_sharded_module(second_of_two):
    from torch.distributed.fsdp import fully_shard

    from training_utils.sharding.fsdp2 import sharded_units, unshard_trained
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    model[1].weight.requires_grad_(False)
    for block in model:
        fully_shard(block, mesh=second_of_two)
    fully_shard(model, mesh=second_of_two)
    assert sharded_units({"model": model}) == {"Sequential": 1, "Linear": 2}
    # Process 1's rows: 3 of the first layer's 6, 1 of the second's 3.
    assert held_bytes({"model": model}) == {"frozen": 4 * 6, "trained": 4 * (12 + 3 + 1), "ema": 0}
    unshard_trained({"model": model})  # gathered (here: a fake group's values), whole and plain
    trained = {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert {name: (type(parameter), parameter.shape) for name, parameter in trained.items()} == {
        "0.weight": (torch.nn.Parameter, (6, 4)), "0.bias": (torch.nn.Parameter, (6,)),
        "1.bias": (torch.nn.Parameter, (3,))}
    assert isinstance(model[1].weight, DTensor)  # the frozen weight stays sharded
