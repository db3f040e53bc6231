"""The guidance that validation renders at: the pipeline's own, or what --validation_guidance_scale and
--validation_true_cfg_scale ask for, so that the pictures show the adapter as a user will sample it."""

import inspect

from .errors import require

# The guidance scales a pipeline may take, each set for validation by --validation_<name>.
GUIDANCE = ("guidance_scale", "true_cfg_scale")


def with_validation_guidance(args, pipe, call_kwargs):
    """``call_kwargs`` with ``--validation_guidance_scale`` and ``--validation_true_cfg_scale`` where given (true
    classifier-free guidance against the empty prompt, unless they give a negative prompt). Only validation renders
    with them: what a script embeds in training (FLUX [dev]'s --guidance_scale) and its class images keep theirs."""
    parameters = inspect.signature(pipe.__call__).parameters
    call_kwargs = dict(call_kwargs or {})
    for name in GUIDANCE:
        value = getattr(args, f"validation_{name}")
        if value is not None:
            require(name in parameters, f"--validation_{name}", value,
                    f"a pipeline that takes {name} ({type(pipe).__name__} takes none)")
            call_kwargs[name] = value
    if call_kwargs.get("true_cfg_scale", 1) > 1:
        call_kwargs.setdefault("negative_prompt", "")
    return call_kwargs


def guidance_used(pipe, call_kwargs):
    """``{name: value}`` of each `GUIDANCE` scale that ``pipe`` takes: as ``call_kwargs`` give it, or its default."""
    parameters = inspect.signature(pipe.__call__).parameters
    return {name: call_kwargs.get(name, parameters[name].default) for name in GUIDANCE if name in parameters}
