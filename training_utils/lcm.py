"""Latent consistency distillation (LCM, LCM-LoRA): the pieces the consistency_distillation scripts share.

The student learns to map a noisy latent at a timestep of a skipping-step DDIM schedule straight to the clean latent,
matching what it maps the teacher's one DDIM step further along the guided probability-flow ODE to:

- `DDIMSolver`: the skipping-step DDIM schedule (``num_ddim_timesteps`` of the ``num_train_timesteps``) and its
  deterministic step from a predicted clean sample and predicted noise, as ``DDIMScheduler.step`` with ``eta=0``;
- `boundary_scalings`: ``c_skip`` and ``c_out`` of the consistency parameterisation ``c_skip * x + c_out * x0``
  (``LCMScheduler``'s ``get_scalings_for_boundary_condition_discrete``), so that the function is the identity at t=0;
- `predicted_original_sample` and `predicted_noise` from a model output of any prediction type;
- `sample_guidance_scales`: one guidance scale per sample, uniform in ``[w_min, w_max]`` (the LCM paper's CFG
  formulation, ``cond + w * (cond - uncond)``);
- `consistency_loss`: l2 or pseudo-Huber;
- `adapters_disabled`: the student's UNet as the teacher, its LoRA off;
- `student_unet`: a full distillation's student, the teacher's UNet with a guidance-scale (w) embedding;
- `add_args`: the distillation flags, and upstream's names for flags every script here has; `add_student_args`,
  the full distillation's;
- `with_lcm_scheduler`: a model card's loading code, rendering as an LCM (LoRA) renders.
"""

import contextlib
import re

import torch
import torch.nn.functional as F


def add_args(parser):
    """The distillation flags (upstream's names and defaults), and upstream's spellings of the pipeline and LoRA
    flags: the teacher is the pipeline (``--pretrained_teacher_model``, ``--teacher_revision``), ``--lora_rank`` is
    ``--rank`` (where the parser has it), ``--interpolation_type`` is ``--image_interpolation_mode``."""
    group = parser.add_argument_group("consistency distillation")
    group.add_argument("--w_min", type=float, default=3.0,
                       help="the smallest guidance scale sampled for the teacher (LCM's formulation: Imagen's minus 1)")
    group.add_argument("--w_max", type=float, default=15.0, help="the largest guidance scale sampled for the teacher")
    group.add_argument("--num_ddim_timesteps", type=int, default=50,
                       help="the timesteps of the skipping-step DDIM solver the teacher steps with")
    group.add_argument("--loss_type", default="l2", choices=["l2", "huber"])
    group.add_argument("--huber_c", type=float, default=0.001, help="the pseudo-Huber loss's c (--loss_type huber)")
    group.add_argument("--timestep_scaling_factor", type=float, default=10.0,
                       help="the timestep scaling of the consistency boundary conditions (LCMScheduler's "
                            "timestep_scaling)")
    from .args import add_aliases

    aliases = {"--pretrained_model_name_or_path": "--pretrained_teacher_model", "--revision": "--teacher_revision",
               "--rank": "--lora_rank", "--image_interpolation_mode": "--interpolation_type"}
    # A full distillation has no --rank.
    add_aliases(parser, {flag: alias for flag, alias in aliases.items() if flag in parser._option_string_actions})


def add_student_args(parser):
    """The full distillation's flags: the size of the student's guidance-scale embedding, and the EMA as its target
    network, always kept, at upstream's decay (``--ema_decay`` 0.95)."""
    parser.add_argument("--unet_time_cond_proj_dim", type=int, default=256,
                        help="the size of the student UNet's guidance-scale embedding, where the teacher's UNet has "
                             "none (its time_cond_proj_dim)")
    parser.set_defaults(use_ema=True, ema_decay=0.95)


def check_args(args, num_train_timesteps=None):
    """Fail fast on the distillation flags' values."""
    from .errors import require

    require(args.w_min <= args.w_max, "--w_max", args.w_max, f"at least --w_min ({args.w_min})")
    require(args.num_ddim_timesteps > 0, "--num_ddim_timesteps", args.num_ddim_timesteps, "a positive count")
    if num_train_timesteps is not None:
        require(args.num_ddim_timesteps <= num_train_timesteps, "--num_ddim_timesteps", args.num_ddim_timesteps,
                f"at most the scheduler's {num_train_timesteps} training timesteps")
    require(args.huber_c > 0, "--huber_c", args.huber_c, "a positive number")
    if hasattr(args, "unet_time_cond_proj_dim"):
        require(args.unet_time_cond_proj_dim > 0, "--unet_time_cond_proj_dim", args.unet_time_cond_proj_dim,
                "a positive size")


def gathered(values, indices, ndim):
    """``values[indices]``, shaped to broadcast against a batch of ``ndim`` dimensions."""
    return values.to(indices.device)[indices].reshape(-1, *([1] * (ndim - 1)))


class DDIMSolver:
    """The skipping-step DDIM schedule ``[k - 1, 2k - 1, ..., T - 1]`` (``k = T // num_ddim_timesteps``) of a noise
    schedule's ``alphas_cumprod`` (``T`` of them), and its deterministic step from one of those timesteps to the one
    before it (to timestep 0's alpha from the first)."""

    def __init__(self, alphas_cumprod, num_ddim_timesteps=50):
        alphas_cumprod = torch.as_tensor(alphas_cumprod)
        self.step_ratio = len(alphas_cumprod) // num_ddim_timesteps
        self.timesteps = torch.arange(1, num_ddim_timesteps + 1) * self.step_ratio - 1
        self.alphas_cumprod_prev = torch.cat([alphas_cumprod[:1], alphas_cumprod[self.timesteps[:-1]]])

    def sample(self, batch_size, device):
        """``(index, start timesteps, timesteps)``: a uniform draw of the schedule's timesteps (``t_{n+k}``), and
        the timesteps one skip earlier (``t_n``, at least 0)."""
        index = torch.randint(0, len(self.timesteps), (batch_size,), device=device)
        start = self.timesteps.to(device)[index]
        return index, start, (start - self.step_ratio).clamp(min=0)

    def step(self, pred_x0, pred_noise, index):
        """The DDIM (``eta=0``) step from the schedule's ``index``-th timesteps to the ones before them."""
        alpha_prev = gathered(self.alphas_cumprod_prev, index, pred_x0.ndim).to(pred_x0.dtype)
        return alpha_prev.sqrt() * pred_x0 + (1 - alpha_prev).sqrt() * pred_noise


def boundary_scalings(timesteps, timestep_scaling=10.0, sigma_data=0.5):
    """``(c_skip, c_out)`` at ``timesteps``: ``c_skip = s^2 / ((ct)^2 + s^2)``, ``c_out = ct / sqrt((ct)^2 + s^2)``
    (``s = sigma_data``, ``c = timestep_scaling``)."""
    scaled = timestep_scaling * timesteps.double()
    c_skip = sigma_data ** 2 / (scaled ** 2 + sigma_data ** 2)
    c_out = scaled / (scaled ** 2 + sigma_data ** 2) ** 0.5
    return c_skip.float(), c_out.float()


def consistency_output(model_output, timesteps, sample, noise_scheduler, timestep_scaling):
    """The consistency function's value ``c_skip * sample + c_out * x0`` for a model output at ``timesteps``."""
    c_skip, c_out = (c.reshape(-1, *([1] * (sample.ndim - 1)))
                     for c in boundary_scalings(timesteps, timestep_scaling))
    return c_skip * sample + c_out * predicted_original_sample(model_output, timesteps, sample, noise_scheduler)


def _alphas_sigmas(noise_scheduler, timesteps, ndim):
    alphas_cumprod = noise_scheduler.alphas_cumprod
    return (gathered(alphas_cumprod.sqrt(), timesteps, ndim), gathered((1 - alphas_cumprod).sqrt(), timesteps, ndim))


def predicted_original_sample(model_output, timesteps, sample, noise_scheduler):
    """The clean sample ``x0`` that ``model_output`` (of the scheduler's prediction type) predicts for ``sample`` at
    ``timesteps``."""
    alphas, sigmas = _alphas_sigmas(noise_scheduler, timesteps, sample.ndim)
    prediction_type = noise_scheduler.config.prediction_type
    if prediction_type == "epsilon":
        return (sample - sigmas * model_output) / alphas
    if prediction_type == "v_prediction":
        return alphas * sample - sigmas * model_output
    if prediction_type == "sample":
        return model_output
    raise ValueError(f"prediction type {prediction_type!r}: expected epsilon, v_prediction or sample")


def predicted_noise(model_output, timesteps, sample, noise_scheduler):
    """The noise that ``model_output`` (of the scheduler's prediction type) predicts for ``sample`` at
    ``timesteps``."""
    alphas, sigmas = _alphas_sigmas(noise_scheduler, timesteps, sample.ndim)
    prediction_type = noise_scheduler.config.prediction_type
    if prediction_type == "epsilon":
        return model_output
    if prediction_type == "v_prediction":
        return alphas * model_output + sigmas * sample
    if prediction_type == "sample":
        return (sample - alphas * model_output) / sigmas
    raise ValueError(f"prediction type {prediction_type!r}: expected epsilon, v_prediction or sample")


def sample_guidance_scales(batch_size, w_min, w_max, ndim, device, dtype):
    """One guidance scale per sample, uniform in ``[w_min, w_max]``, shaped to broadcast over a batch of ``ndim``
    dimensions."""
    w = (w_max - w_min) * torch.rand(batch_size) + w_min
    return w.reshape(-1, *([1] * (ndim - 1))).to(device=device, dtype=dtype)


def guided(cond, uncond, w):
    """The LCM paper's classifier-free guidance: ``cond + w * (cond - uncond)``."""
    return cond + w * (cond - uncond)


@contextlib.contextmanager
def adapters_disabled(model):
    """``model`` (a diffusers model with a peft adapter) without its adapters inside the block: the teacher."""
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()


def student_unet(teacher, time_cond_proj_dim):
    """A full distillation's student: ``teacher``'s UNet with a guidance-scale (w) embedding of ``time_cond_proj_dim``
    (the teacher's own, where it has one), holding the teacher's weights (in fp32); the embedding's
    projection, which the teacher lacks, starts as the model initialises it (from the seeded global generator)."""
    embedding_dim = teacher.config.time_cond_proj_dim or time_cond_proj_dim
    with torch.device(teacher.device):  # the meta device where the run only plans its memory
        student = type(teacher).from_config(teacher.config, time_cond_proj_dim=embedding_dim)
    missing, unexpected = student.load_state_dict(teacher.state_dict(), strict=False)
    if unexpected or any(".cond_proj." not in name for name in missing):
        raise ValueError(f"the student UNet does not hold the teacher's weights: missing {missing}, unexpected "
                         f"{unexpected}")
    return student


def consistency_loss(prediction, target, loss_type="l2", huber_c=0.001):
    """The mean l2 or pseudo-Huber (``sqrt(d^2 + c^2) - c``) distance, in fp32."""
    prediction, target = prediction.float(), target.float()
    if loss_type == "l2":
        return F.mse_loss(prediction, target)
    return torch.mean(torch.sqrt((prediction - target) ** 2 + huber_c ** 2) - huber_c)


def with_lcm_scheduler(loading_code, num_inference_steps=4, guidance_scale=1.0):
    """``loading_code`` (a model card's, `outputs.hub.how_to_load`) with the pipeline's scheduler replaced by an
    LCMScheduler after loading, and the call rendering in ``num_inference_steps`` steps at ``guidance_scale`` (1: no
    classifier-free guidance, as an LCM-LoRA renders; a distilled UNet takes the scale as its w embedding)."""
    code = loading_code.replace("from diffusers import ", "from diffusers import LCMScheduler, ", 1)
    code = re.sub(r"^(pipe = .*)$", r"\1\npipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)", code,
                  count=1, flags=re.M)
    call = rf"pipe(\1, num_inference_steps={num_inference_steps}, guidance_scale={guidance_scale})"
    return re.sub(r"pipe\((\"[^\n]*?\")\)", call, code, count=1)
