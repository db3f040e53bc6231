"""Flow matching (rectified flow), as the diffusers SD3 and FLUX scripts train: shared by every such script.

Latents move on a straight line to noise, ``x_t = (1 - sigma) x_0 + sigma noise`` (`add_noise`), and the model
predicts the velocity ``noise - x_0`` (`velocity`). The noise levels are drawn from the training scheduler's own
schedule (so any shift its configuration applies is the model's) with the density that ``--weighting_scheme``
names, which also gives the loss weights (SD3 paper, section 3.1; `flow_matching_loss`). With
``--precondition_outputs`` the loss compares the clean latents the predicted velocity implies with the latents
(EDM-style preconditioning, upstream's SD3 default) instead of the velocities.
"""

from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from .errors import require

WEIGHTING_SCHEMES = ["sigma_sqrt", "logit_normal", "mode", "cosmap", "none"]


def add_flow_matching_args(parser, weighting_scheme="logit_normal", precondition_outputs=0, logit_std=1.0):
    """The timestep-density and loss flags of the diffusers flow-matching scripts, with their names and meanings;
    ``weighting_scheme``, ``precondition_outputs`` and ``logit_std`` are the script's defaults (the upstream SD3
    scripts use logit_normal and 1, the FLUX.2 ones none and, having no such flag, 0; Ideogram 4's spread is 1.5)."""
    group = parser.add_argument_group("flow matching")
    group.add_argument("--weighting_scheme", default=weighting_scheme, choices=WEIGHTING_SCHEMES,
                       help="density of the training timesteps and the matching loss weights (SD3 paper, section 3.1)")
    group.add_argument("--logit_mean", type=float, default=0.0, help="mean of the logit_normal scheme")
    group.add_argument("--logit_std", type=float, default=logit_std,
                       help="standard deviation of the logit_normal scheme")
    group.add_argument("--mode_scale", type=float, default=1.29, help="scale of the mode scheme")
    group.add_argument("--precondition_outputs", type=int, default=precondition_outputs, choices=[0, 1],
                       help="1: turn the predicted velocity into a clean-latent estimate and regress that (EDM-style); "
                            "0: regress the velocity noise - latents")


def check_flow_matching_args(args):
    require(args.logit_std > 0, "--logit_std", args.logit_std, "a positive number")


def sample_flow_matching_timesteps(noise_scheduler, args, latents):
    """``(timesteps, sigmas)`` for a batch of ``latents``: indices into the scheduler's training schedule drawn with
    ``--weighting_scheme``'s density (from the global RNG); ``sigmas`` in the latents' dtype, on their device, with
    as many dims, to broadcast over them. The schedule's sigma at an index is its timestep /
    ``num_train_timesteps``."""
    batch_size = latents.shape[0]
    density = compute_density_for_timestep_sampling(args.weighting_scheme, batch_size, logit_mean=args.logit_mean,
                                                    logit_std=args.logit_std, mode_scale=args.mode_scale)
    num_train_timesteps = noise_scheduler.config.num_train_timesteps
    # A density value of exactly 1 (possible for "mode") would index one past the schedule.
    indices = (density * num_train_timesteps).long().clamp(0, num_train_timesteps - 1)
    timesteps = noise_scheduler.timesteps[indices].to(latents.device)
    sigmas = noise_scheduler.sigmas[indices].to(device=latents.device, dtype=latents.dtype)
    return timesteps, sigmas.reshape(batch_size, *[1] * (latents.ndim - 1))


def add_noise(latents, noise, sigmas):
    """The latents at noise level ``sigmas``: the point ``sigmas`` of the way along the straight line to ``noise``."""
    return (1.0 - sigmas) * latents + sigmas * noise


def velocity(latents, noise):
    """What the model learns to predict: the direction of the straight line from ``latents`` to ``noise``."""
    return noise - latents


def weighted_mse(prediction, target, weighting):
    """The mean over samples of each sample's ``weighting``-weighted squared error, computed in fp32."""
    per_sample = (weighting.float() * (prediction.float() - target.float()) ** 2).flatten(1).mean(1)
    return per_sample.mean()


def flow_matching_loss(prediction, latents, noise, sigmas, args):
    """The loss of a predicted velocity for ``latents`` noised with ``noise`` at ``sigmas``, as the flags say:
    `weighted_mse` with ``--weighting_scheme``'s weights at ``sigmas``, of the velocities, or with
    ``--precondition_outputs`` of the clean latents the prediction implies. With ``--with_prior_preservation`` the
    batch is the instance half, then the class half: the loss is the instance half's plus ``--prior_loss_weight``
    times the class half's."""
    if args.precondition_outputs:
        prediction, target = add_noise(latents, noise, sigmas) - sigmas * prediction, latents
    else:
        target = velocity(latents, noise)
    weighting = compute_loss_weighting_for_sd3(args.weighting_scheme, sigmas)
    if not getattr(args, "with_prior_preservation", False):
        return weighted_mse(prediction, target, weighting)
    (prediction, prior_prediction), (target, prior_target), (weighting, prior_weighting) = (
        tensor.chunk(2) for tensor in (prediction, target, weighting))
    return (weighted_mse(prediction, target, weighting)
            + args.prior_loss_weight * weighted_mse(prior_prediction, prior_target, prior_weighting))
