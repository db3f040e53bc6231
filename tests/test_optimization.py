"""`training_utils.optimization.make_optimizer`: AdamW's implementation per device, and exact resume."""

import io
from types import SimpleNamespace

import torch

from training_utils.optimization import adamw_implementation, make_optimizer


def optimizer_args(**overrides):
    """The flags `make_optimizer` reads, at the scripts' defaults."""
    return SimpleNamespace(**{"learning_rate": 1e-2, "scale_lr": False, "gradient_accumulation_steps": 1,
                              "train_batch_size": 1, "use_8bit_adam": False, "adam_beta1": 0.9, "adam_beta2": 0.999,
                              "adam_weight_decay": 1e-2, "adam_epsilon": 1e-8, **overrides})


def fake_parameter(device, dtype=torch.float32):
    # no GPU here: the choice reads only a tensor's device and dtype
    return SimpleNamespace(device=torch.device(device), dtype=dtype)


def test_cuda_parameters_get_the_fused_kernel():
    assert adamw_implementation([fake_parameter("cuda:0"), fake_parameter("cuda:1", torch.bfloat16)]) == {
        "fused": True}


def test_anything_else_gets_foreach():
    assert adamw_implementation([fake_parameter("cpu")]) == {"foreach": True}
    assert adamw_implementation([fake_parameter("cuda:0"), fake_parameter("cpu")]) == {"foreach": True}
    assert adamw_implementation([fake_parameter("cuda:0", torch.int8)]) == {"foreach": True}
    assert adamw_implementation([]) == {"foreach": True}


def test_the_cpu_optimizer_is_foreach_adamw():
    optimizer = make_optimizer(optimizer_args(), {"unet.weight": torch.nn.Parameter(torch.ones(3))}, num_processes=1)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.param_groups[0]["foreach"] is True and not optimizer.param_groups[0]["fused"]


def named(parameters):
    """``parameters`` by name, as the scripts give them: a transformer's and a text encoder's."""
    return dict(zip(["transformer.weight", "text_encoder.weight"], parameters, strict=True))


def test_the_text_encoders_take_their_own_learning_rate_and_weight_decay_where_set():
    parameters = named([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))])
    optimizer = make_optimizer(optimizer_args(scale_lr=True, train_batch_size=4, text_encoder_lr=5e-6,
                                              adam_weight_decay_text_encoder=1e-3), parameters, num_processes=2)
    assert [(group["params"], group["lr"], group["weight_decay"]) for group in optimizer.param_groups] == [
        ([parameters["transformer.weight"]], 1e-2 * 4 * 2, 1e-2), ([parameters["text_encoder.weight"]], 5e-6, 1e-3)]
    # Unset (as in the scripts without upstream's flags), they take the others'.
    optimizer = make_optimizer(optimizer_args(), parameters, num_processes=1)
    assert [(group["lr"], group["weight_decay"]) for group in optimizer.param_groups] == [(1e-2, 1e-2)] * 2


def test_parameters_named_as_no_decay_asks_train_without_weight_decay():
    parameters = {name: torch.nn.Parameter(torch.ones(2)) for name in
                  ("transformer.proj.weight", "transformer.proj.bias", "transformer.embeddings.weight")}
    optimizer = make_optimizer(optimizer_args(), parameters, num_processes=1, no_decay=("bias", "embeddings.weight"))
    assert [(group["params"], group["weight_decay"]) for group in optimizer.param_groups] == [
        ([parameters["transformer.proj.weight"]], 1e-2),
        ([parameters["transformer.proj.bias"], parameters["transformer.embeddings.weight"]], 0.0)]


def train(parameters, optimizer, steps):
    for _ in range(steps):
        loss = sum((parameter.sin() ** 2).sum() for parameter in parameters)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_resuming_from_the_state_dict_continues_bitwise():
    torch.manual_seed(0)
    initial = [torch.randn(5, 3), torch.randn(7)]

    straight = [torch.nn.Parameter(tensor.clone()) for tensor in initial]
    train(straight, make_optimizer(optimizer_args(), named(straight), num_processes=1), 4)

    resumed = [torch.nn.Parameter(tensor.clone()) for tensor in initial]
    optimizer = make_optimizer(optimizer_args(), named(resumed), num_processes=1)
    train(resumed, optimizer, 2)
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    saved.seek(0)
    optimizer = make_optimizer(optimizer_args(), named(resumed), num_processes=1)
    optimizer.load_state_dict(torch.load(saved))
    train(resumed, optimizer, 2)
    for expected, actual in zip(straight, resumed):
        assert torch.equal(expected, actual)
