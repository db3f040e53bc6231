"""The power-function EMA profiles of post-hoc EMA (EDM2, Karras et al. 2024), and how snapshots of some combine
into another.

A power EMA with exponent gamma has single-step decay ``(1 - 1/t) ** (gamma + 1)`` (t in optimizer steps, from 1).
Its shadow at step T averages the weights with the density ``p_T(tau) = (gamma + 1) tau**gamma / T**(gamma + 1)``
on [0, T] (exactly for the piecewise-constant weights the updates sample; see `ema.PowerEMA`). Its relative
standard deviation is ``sigma_rel = sqrt((gamma + 1) / ((gamma + 2)**2 (gamma + 3)))``: EMA length as a fraction
of training time (0.05 -> gamma ~ 16.97, 0.10 -> gamma ~ 6.94). Snapshots of profiles combine linearly into
another profile by least squares over tau (`solve_posthoc_coefficients`).
"""

import math
from typing import Sequence, Union

import numpy as np

MAX_SIGMA_REL = 1 / math.sqrt(12)  # sigma_rel of gamma = 0 (a uniform average over [0, T])


def gamma_to_sigma_rel(gamma: float) -> float:
    """Relative standard deviation of the power-function profile with exponent ``gamma`` (> 0)."""
    gamma = float(gamma)
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The exponent gamma > 0 whose profile has relative standard deviation ``sigma_rel``.

    ``sigma_rel**-2 = (gamma + 2)**2 (gamma + 3) / (gamma + 1)`` is the cubic
    ``gamma**3 + 7 gamma**2 + (16 - s) gamma + (12 - s) = 0`` with ``s = sigma_rel**-2``; gamma is
    its largest real root. Valid for ``0 < sigma_rel < 1/sqrt(12)`` (ValueError otherwise).
    """
    sigma_rel = float(sigma_rel)
    if not 0 < sigma_rel < MAX_SIGMA_REL:
        raise ValueError(f"sigma_rel must satisfy 0 < sigma_rel < 1/sqrt(12) ~ {MAX_SIGMA_REL:.4f}, got {sigma_rel}")
    s = sigma_rel ** -2
    roots = np.roots([1.0, 7.0, 16.0 - s, 12.0 - s])
    gamma = float(max(root.real for root in roots if abs(root.imag) <= 1e-9 * max(1.0, abs(root))))
    # one Newton step on the defining equation polishes the root to float64 precision
    f = ((gamma + 7) * gamma + 16 - s) * gamma + 12 - s
    df = (3 * gamma + 14) * gamma + 16 - s
    return gamma - f / df if df != 0 else gamma


def profile_dot(t_a, gamma_a, t_b, gamma_b):
    """Inner product over tau of the power-function profiles p_a = (g_a+1) tau^g_a / t_a^(g_a+1) on
    [0, t_a] and p_b likewise (numpy broadcasting, float64).

    int_0^m (g_a+1)(g_b+1) tau^(g_a+g_b) / (t_a^(g_a+1) t_b^(g_b+1)) d tau,  m = min(t_a, t_b)
      = (g_a+1)(g_b+1) / (g_a+g_b+1) * m^(g_a+g_b+1) / (t_a^(g_a+1) t_b^(g_b+1))
      = (g_a+1)(g_b+1) / (g_a+g_b+1) * (t_a/t_b)^g_b / t_b    if t_a <= t_b (symmetrically otherwise),
    the last form free of overflow for large steps and exponents.
    """
    t_a, gamma_a, t_b, gamma_b = (np.asarray(x, dtype=np.float64) for x in (t_a, gamma_a, t_b, gamma_b))
    # if t_a <= t_b: m = t_a, value = c * t_a^(g_a+g_b+1) / (t_a^(g_a+1) t_b^(g_b+1)) = c * (t_a/t_b)^g_b / t_b
    # else, symmetrically: c * (t_b/t_a)^g_a / t_a
    c = (gamma_a + 1) * (gamma_b + 1) / (gamma_a + gamma_b + 1)
    a_first = t_a <= t_b
    ratio = np.where(a_first, t_a / t_b, t_b / t_a)
    exponent = np.where(a_first, gamma_b, gamma_a)
    return c * ratio ** exponent / np.maximum(t_a, t_b)


def solve_posthoc_coefficients(steps: Sequence[float], gammas: Sequence[float], target_step: float,
                               target_gammas: Union[float, Sequence[float]]):
    """Least-squares combination of snapshot profiles that best matches target profiles (L2 over tau).

    Solves ``A x = b`` with ``A[i, j] = <p_i, p_j>`` and ``b[i] = <p_i, p_target>`` (float64), then
    normalises x to sum to 1 (each profile integrates to 1, so the combination is an average).

    Returns ``(coefficients, relative_errors)``: coefficients of shape (len(steps), len(targets)),
    and for each target ``||sum_i x_i p_i - p_target|| / ||p_target||`` with the normalised x.
    """
    steps = np.asarray(steps, dtype=np.float64).reshape(-1)
    gammas = np.asarray(gammas, dtype=np.float64).reshape(-1)
    target_gammas = np.atleast_1d(np.asarray(target_gammas, dtype=np.float64))
    if steps.size == 0 or steps.shape != gammas.shape:
        raise ValueError("need one gamma per snapshot step, and at least one snapshot")
    if np.any(steps <= 0) or target_step <= 0:
        raise ValueError("snapshot and target steps must be > 0")
    target_steps = np.full_like(target_gammas, float(target_step))

    a = profile_dot(steps[:, None], gammas[:, None], steps[None, :], gammas[None, :])
    b = profile_dot(steps[:, None], gammas[:, None], target_steps[None, :], target_gammas[None, :])
    try:
        x = np.linalg.solve(a, b)
    except np.linalg.LinAlgError:  # duplicate profiles: any least-squares solution will do
        x = np.linalg.lstsq(a, b, rcond=None)[0]
    x = x / np.sum(x, axis=0, keepdims=True)

    target_norm2 = profile_dot(target_steps, target_gammas, target_steps, target_gammas)
    error2 = np.einsum("it,ij,jt->t", x, a, x) - 2 * np.einsum("it,it->t", x, b) + target_norm2
    errors = np.sqrt(np.maximum(error2, 0.0) / target_norm2)
    return x, errors
