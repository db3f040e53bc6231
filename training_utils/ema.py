"""Exponential moving average (EMA) of named trained tensors, kept as fp32 shadows.

The EMA tracks a mapping ``name -> live Parameter`` (PEFT LoRA adapter tensors, or every
parameter of a module). Each update blends the live weights into fp32 shadow copies:

    shadow = beta * shadow + (1 - beta) * weight

When the EMA is updated only every K optimizer steps, ``beta`` is the product of the K
single-step decays ("interval correction"). A fixed per-update decay combined with an update
interval would make the EMA K times slower than intended, leaving it close to the initial weights.

Sharded (FSDP2), each process keeps the shadows of its own part of each parameter only (a DTensor's local tensor),
and an update blends those parts without any communication; whole shadows are gathered only to be written.
"""

import contextlib
import os
from collections import defaultdict
from typing import Dict, Iterator, Mapping, Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import few
from .sharding.fsdp2 import any_sharded, local_part, local_tensor, whole_tensors

EMA_FORMAT = "training_utils.ema"


@contextlib.contextmanager
def tensors_swapped_in(parameters: Mapping[str, torch.nn.Parameter], tensors: Mapping[str, torch.Tensor],
                       local: bool = False):
    """Copy ``tensors`` into the live ``parameters`` of the same names; restore them bitwise on exit,
    also when the body raises. The backup of each parameter is kept on its tensor's device. A sharded parameter
    takes this process's part of its whole tensor, or with ``local`` the tensor as it is (already that part)."""
    if parameters.keys() != tensors.keys():
        raise ValueError(f"tensors do not match the parameters: "
                         f"missing {few(sorted(parameters.keys() - tensors.keys()))}, "
                         f"unexpected {few(sorted(tensors.keys() - parameters.keys()))}")
    # no_grad only around the copies: the body keeps the caller's grad mode
    with torch.no_grad():
        backups = {name: local_tensor(param.detach()).to(device=tensors[name].device, copy=True)
                   for name, param in parameters.items()}
    try:
        with torch.no_grad():
            for name, param in parameters.items():
                local_tensor(param).copy_(tensors[name] if local else local_part(tensors[name], param))
        yield
    finally:
        with torch.no_grad():
            for name, param in parameters.items():
                local_tensor(param).copy_(backups[name])


class EMA:
    """Exponential moving average of named parameters, with one fp32 shadow per parameter.

    Args:
        parameters: name -> live parameter. Kept by reference: these are the tensors that get
            averaged in `update` and overwritten in `swapped_in`.
        decay: decay of one optimizer step (0 <= decay < 1).
        update_every: the intended update interval in optimizer steps; see `is_due`.
        warmup: if True, ramp the per-step decay up as ``1 - (1 + step / inv_gamma) ** -power``,
            capped at `decay`.
        inv_gamma: warm-up inverse multiplicative factor (> 0).
        power: warm-up exponential factor (> 0).
        device: where to keep the shadows (e.g. "cpu" to keep accelerator memory free). Defaults to
            each parameter's own device.
    """

    def __init__(
        self,
        parameters: Mapping[str, torch.nn.Parameter],
        decay: float = 0.9999,
        update_every: int = 1,
        warmup: bool = False,
        inv_gamma: float = 1.0,
        power: float = 2 / 3,
        device: Optional[Union[str, torch.device]] = None,
    ):
        if len(parameters) == 0:
            raise ValueError("EMA needs at least one parameter")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must satisfy 0 <= decay < 1, got {decay}")
        if update_every < 1:
            raise ValueError(f"update_every must be >= 1, got {update_every}")
        if inv_gamma <= 0:
            raise ValueError(f"inv_gamma must be > 0, got {inv_gamma}")
        if power <= 0:
            raise ValueError(f"power must be > 0, got {power}")

        self.parameters: Dict[str, torch.nn.Parameter] = dict(parameters)
        self.decay = decay
        self.update_every = update_every
        self.warmup = warmup
        self.inv_gamma = inv_gamma
        self.power = power

        shadow_device = torch.device(device) if device is not None else None
        self.shadows: Dict[str, torch.Tensor] = {name: shadow_of(local_tensor(param.detach()), shadow_device)
                                                 for name, param in self.parameters.items()}
        self.step = 0
        self._swapped = False

    def rebind(self, parameters: Mapping[str, torch.nn.Parameter]):
        """Track ``parameters`` (the same names and shapes) in place of the live parameters given so far: those
        accelerate's ``prepare`` put in their place (sharded by FSDP2: each shadow is cut to this process's part),
        or whole ones put back after sharded training (`sharding.fsdp2.unshard_trained`: the shadows are gathered whole,
        and every process must call this then). Nothing changes for the same unsharded parameters."""
        parameters = dict(parameters)
        if parameters.keys() != self.parameters.keys():
            raise ValueError("rebind needs the parameters of the same names")
        if not any_sharded(self.parameters) and not any_sharded(parameters):
            self.parameters = parameters
            return
        wholes = self.whole_shadows()
        self.parameters = parameters
        self.shadows = {name: shadow_of(local_part(wholes[name], parameters[name]), self.shadows[name].device)
                        for name in parameters}

    def whole_shadows(self) -> Dict[str, torch.Tensor]:
        """The shadows as whole tensors: gathered from every process onto the CPU when the parameters are sharded
        (then every process must call this), else the shadows themselves."""
        if not any_sharded(self.parameters):
            return dict(self.shadows)
        return whole_tensors(self.shadows, self.parameters)

    @property
    def num_bytes(self) -> int:
        """Total bytes held by the shadows."""
        return sum(shadow.numel() * shadow.element_size() for shadow in self.shadows.values())

    def step_decay(self, step: int) -> float:
        """Decay of the single optimizer step `step` (1-based). Override for other schedules."""
        if not self.warmup:
            return self.decay
        return min(self.decay, max(0.0, 1 - (1 + step / self.inv_gamma) ** -self.power))

    def decay_between(self, last_step: int, step: int) -> float:
        """Decay accumulated over steps last_step + 1 .. step: the product of their single-step decays."""
        beta = 1.0
        for s in range(last_step + 1, step + 1):
            beta *= self.step_decay(s)
        return beta

    def is_due(self, step: int, last_step: Optional[int] = None) -> bool:
        """Whether optimizer step `step` falls on the update interval, or is the run's `last_step`
        (so the EMA saved at the end includes the final weights; the interval correction keeps it exact)."""
        return step % self.update_every == 0 or step == last_step

    @torch.no_grad()
    def update(self, step: int):
        """Blends the live weights into the shadows as of optimizer step `step`.

        The first update copies the weights. Later ones apply the decay of every optimizer step
        since the previous update, so calling this off the interval (e.g. at the final step) is exact.
        """
        if step <= self.step:
            raise ValueError(f"EMA update step must increase: got {step} after {self.step}")
        beta = 0.0 if self.step == 0 else self.decay_between(self.step, step)

        # foreach ops need lists that share device and dtype: (shadow device, weight dtype) -> (shadows, weights)
        groups = defaultdict(lambda: ([], []))
        for name, shadow in self.shadows.items():
            weight = local_tensor(self.parameters[name].detach())  # this process's part: no communication
            shadows, weights = groups[(shadow.device, weight.dtype)]
            shadows.append(shadow)
            weights.append(weight)

        for (shadow_device, _), (shadows, weights) in groups.items():
            # .to() returns the tensor itself when it already is fp32 on the shadow's device
            weights = [weight.to(device=shadow_device, dtype=torch.float32) for weight in weights]
            if beta == 0.0:
                # a copy, so the EMA is exactly the weights rather than within rounding of them
                torch._foreach_copy_(shadows, weights)
            else:
                torch._foreach_lerp_(shadows, weights, 1.0 - beta)

        self.step = step

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Context manager that puts the EMA weights into the live parameters.

        On exit, also when the body raises, the live parameters are restored bitwise. Parameter
        identity, dtype, device, requires_grad and .grad are left untouched. The backup of the
        live weights is kept on the shadows' device, so a CPU EMA adds no accelerator memory.
        """
        if self._swapped:
            raise RuntimeError("EMA weights are already swapped in; swapped_in cannot be nested")
        self._swapped = True
        try:
            with tensors_swapped_in(self.parameters, self.shadows, local=True):
                yield
        finally:
            self._swapped = False

    def state_dict(self) -> dict:
        """Returns {"shadows": {name: tensor}, "step": int}. The shadows are references, not copies."""
        return {"shadows": dict(self.shadows), "step": self.step}

    def load_state_dict(self, state: Mapping):
        """Copies a `state_dict` (whole shadows) into the existing shadows (keeping their device; sharded, this
        process's part) and restores the step.

        Strict: missing names, unexpected names and shape mismatches raise ValueError.
        """
        shadows = state["shadows"]
        step = int(state["step"])

        missing = sorted(self.shadows.keys() - shadows.keys())
        unexpected = sorted(shadows.keys() - self.shadows.keys())
        mismatched = sorted(
            f"{name} (got {tuple(shadows[name].shape)}, expected {tuple(param.shape)})"
            for name, param in self.parameters.items()
            if name in shadows and shadows[name].shape != param.shape
        )
        problems = []
        if missing:
            problems.append(f"missing keys: {few(missing)}")
        if unexpected:
            problems.append(f"unexpected keys: {few(unexpected)}")
        if mismatched:
            problems.append(f"shape mismatch: {few(mismatched)}")
        if step < 0:
            problems.append(f"step must be >= 0, got {step}")
        if problems:
            raise ValueError("EMA state does not match this EMA: " + "; ".join(problems))

        with torch.no_grad():
            for name, shadow in self.shadows.items():
                shadow.copy_(local_part(shadows[name], self.parameters[name]))
        self.step = step

    def save(self, path: Union[str, os.PathLike]):
        """Writes the shadows and step to a safetensors file, atomically."""
        path = os.fspath(path)
        # same folder, so os.replace is an atomic rename: a crash never leaves a truncated file at `path`
        temporary_path = f"{path}.tmp{os.getpid()}"
        try:
            save_file(self.shadows, temporary_path, metadata={"step": str(self.step), "format": EMA_FORMAT})
            os.replace(temporary_path, path)
        finally:
            if os.path.exists(temporary_path):
                os.remove(temporary_path)

    def load(self, path: Union[str, os.PathLike]):
        """Loads a file written by `save`. Raises ValueError for other safetensors files."""
        with safe_open(os.fspath(path), framework="pt", device="cpu") as file:
            metadata = file.metadata() or {}
            if metadata.get("format") != EMA_FORMAT or "step" not in metadata:
                raise ValueError(f"{path} is not an EMA file written by {EMA_FORMAT}")
            shadows = {name: file.get_tensor(name) for name in file.keys()}
        self.load_state_dict({"shadows": shadows, "step": int(metadata["step"])})


def shadow_of(tensor, device=None):
    """A fp32 copy of ``tensor`` on ``device`` (by default its own), contiguous so that it can be written to
    safetensors as it is."""
    return tensor.to(device=device or tensor.device, dtype=torch.float32, memory_format=torch.contiguous_format,
                     copy=True)


class PowerEMA(EMA):
    """Power-function EMA (EDM2's post-hoc EMA profile): the single-step decay of step t is
    ``beta(t) = (1 - 1/t) ** (gamma + 1)``, t counted in optimizer steps from 1 (so beta(1) = 0).

    Only `step_decay` differs from `EMA`; the base class's interval correction makes the decay
    between updates at steps s < t the product of single-step decays, which telescopes to
    ``(s / t) ** (gamma + 1)``. What the shadow is, exactly (up to fp32 rounding):

        shadow(T) = integral over tau in [0, T] of p_T(tau) * w(tau) d tau,
        p_T(tau) = (gamma + 1) * tau ** gamma / T ** (gamma + 1),

    where T is the step of the last update and w is the piecewise-constant weight trajectory
    that the updates sampled: for update steps u_1 < u_2 < ..., w(tau) = weights at u_j for
    tau in (u_{j-1}, u_j] (u_0 = 0). The time axis is exact training time, whatever the update
    interval K, also for off-interval updates (e.g. the final step) and across resumes.

    Consequences:
      * K = 1 (as in EDM2's implementation, which updates every step): the shadow is the exact
        power-function average of the per-step weights: weight of step t is
        ``(t**(gamma+1) - (t-1)**(gamma+1)) / T**(gamma+1)``.
      * K > 1: each update's weights stand for the K steps before it (the weights are assumed
        constant between updates). Exact when they are; otherwise off by at most the weights'
        change within an interval.
      * The first update copies (base class). A copy at step s > 1 is exactly the power function
        applied to weights held at their step-s value over [0, s]: the mass (s/T)**(gamma+1)
        of the steps 1..s goes to the step-s weights. This is the same assumption as between
        updates, and its share of the average vanishes as (s/T)**(gamma+1).

    Args:
        parameters: name -> live parameter (as for `EMA`).
        gamma: the power-function exponent (> -1; EDM2's sigma_rel < 1/sqrt(12) means gamma > 0).
        update_every: the intended update interval K in optimizer steps.
        device: where the fp32 shadows live.
    """

    def __init__(self, parameters, gamma: float, update_every: int = 1,
                 device: Optional[Union[str, torch.device]] = None):
        gamma = float(gamma)
        if not gamma > -1.0:
            raise ValueError(f"gamma must be > -1, got {gamma}")
        # decay=0.0: unused, every decay comes from step_decay
        super().__init__(parameters, decay=0.0, update_every=update_every, device=device)
        self.gamma = gamma

    def step_decay(self, step: int) -> float:
        if step < 1:
            raise ValueError(f"optimizer steps count from 1, got {step}")
        return (1.0 - 1.0 / step) ** (self.gamma + 1.0)


def make_ema(args, parameters, accelerator):
    """The `EMA` of ``parameters`` that ``--use_ema`` and its flags ask for, or None."""
    if not args.use_ema:
        return None
    return EMA(parameters, decay=args.ema_decay, update_every=args.ema_update_every, warmup=args.ema_warmup,
               inv_gamma=args.ema_inv_gamma, power=args.ema_power,
               device="cpu" if args.ema_device == "cpu" else accelerator.device)
