"""Load the pipeline once, then hand out its components ready for training.

The scripts never load a component on its own: the pipeline built here is the one that trains
(its modules are the live ones) and the one that renders validation images.
"""

import torch
from diffusers import DDPMScheduler


def weight_dtype_for(mixed_precision):
    """The dtype of the frozen weights: half precision under mixed precision, else fp32."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision, torch.float32)


def load_pipeline(pipeline_class, args, **components):
    """``pipeline_class.from_pretrained`` with the shared flags; ``components`` replace loaded ones.

    Loads in fp32; ``prepare_components`` casts the frozen parts afterwards, so trained
    parameters never pass through half precision.
    """
    pipe = pipeline_class.from_pretrained(
        args.pretrained_model_name_or_path, revision=args.revision, variant=args.variant, **components
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def modules_of(pipe):
    """The pipeline's ``torch.nn.Module`` components, by component name."""
    return {name: module for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}


def prepare_components(pipe, trained, device, weight_dtype):
    """Freeze every module of ``pipe``, move it to ``device`` in ``weight_dtype``; keep trained tensors fp32.

    ``trained`` maps component names to modules whose ``requires_grad`` parameters are trained
    (call after adding adapters). Parameters that require grad stay fp32 for the optimizer;
    everything else is frozen and cast, so mixed precision saves memory on the frozen parts only.
    """
    trained_modules = {id(module) for module in trained.values()}
    for module in modules_of(pipe).values():
        module.to(device)
        if id(module) not in trained_modules:
            module.requires_grad_(False)
            module.eval()
            if weight_dtype != torch.float32:
                module.to(dtype=weight_dtype)
            continue
        # Cast tensor by tensor, so trained weights never pass through half precision.
        for parameter in module.parameters():
            parameter.data = parameter.data.float() if parameter.requires_grad else parameter.data.to(weight_dtype)


def trainable_parameters(trained):
    """``{"<component>.<parameter name>": parameter}`` for every parameter that requires grad.

    These names key the EMA, the checkpoints and the export check, so they must not depend on
    wrappers such as DDP: take them from the unwrapped modules.
    """
    parameters = {
        f"{component}.{name}": parameter
        for component, module in trained.items()
        for name, parameter in module.named_parameters()
        if parameter.requires_grad
    }
    if not parameters:
        raise ValueError(f"nothing to train: no parameter of {', '.join(trained)} requires grad")
    return parameters


def training_noise_scheduler(pipe, scheduler_class=DDPMScheduler, prediction_type=None):
    """The scheduler that adds noise during training, made from the pipeline's scheduler config.

    With ``prediction_type``, the pipeline's own (inference) scheduler is switched to it too, so
    validation renders with what the model is being trained to predict.
    """
    if prediction_type is not None:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, prediction_type=prediction_type)
    return scheduler_class.from_config(pipe.scheduler.config)
