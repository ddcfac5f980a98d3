"""Advantage and return estimators: GAE, V-trace, truncated importance weights.

Conventions (all functions):

* **Time-major.** Per-step inputs are ``[T, B]`` (T steps of B parallel envs); per-env bootstrap
  values are ``[B]``. Row ``t`` describes one ``env.step``: the reward it returned, the value of
  the observation it acted on, and whether the episode ended *after* it.
* **Gymnasium episode ends.** ``terminated[t]`` means the MDP ended: the next state has value 0.
  ``truncated[t]`` (time limit etc.) means the episode was cut: the next state still has a value,
  namely V(final observation) returned by step ``t`` before the auto-reset, and row ``t + 1``
  belongs to a new episode. If both are set, termination wins.
* **Pure and detached.** Inputs may be numpy arrays or torch tensors (bool masks allowed); outputs
  are tensors on the device of ``rewards``, computed under ``torch.no_grad()``. Bad shapes or
  arguments raise :class:`ValueError` naming the offending argument.
* **The caller's dtype** (as rlax does): the float inputs (rewards, values, log-probs, discounts,
  bootstrap and truncation values; not the ``terminated``/``truncated`` masks, which may be bool,
  int or float) must share one floating dtype, and the computation and the outputs keep it:
  float64 in, float64 out; float32 in, float32 out. Inputs without a dtype of their own (Python
  numbers and lists) take that dtype on; when no input has one, torch's default dtype (float32) is
  used. Mixed float dtypes (float32 values with float64 rewards, say) raise :class:`ValueError`
  naming each argument's dtype: a silent cast would lose precision one way or hide the caller's bug
  the other.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "LOG_RATIO_BOUND",
    "GAEReturns",
    "VTraceReturns",
    "gae",
    "vtrace",
    "vtrace_discounts_and_rewards",
    "truncated_importance_weights",
    "bounded_ratio",
]

LOG_RATIO_BOUND = 20.0
"""Every importance ratio pi/mu is formed as ``exp(clamp(log pi - log mu, -20, 20))``: e^20 ~ 4.9e8 is far past
every clip a ratio meets (PPO's 1 + clip, rho_bar, c_bar), so no real ratio changes, while a behaviour
log-probability of -3e38 from a buggy or hostile actor can no longer overflow the ratio to inf (and the loss to
NaN, skipping every optimizer step). Beyond the bound the ratio is constant: such a sample passes no gradient
through it."""


class GAEReturns(NamedTuple):
    advantages: torch.Tensor  # [T, B]
    returns: torch.Tensor  # [T, B], advantages + values (the value-function target)


class VTraceReturns(NamedTuple):
    vs: torch.Tensor  # [T, B], V-trace value targets
    pg_advantages: torch.Tensor  # [T, B], rho_t * (r_t + discount_t * vs_{t+1} - V(x_t))
    rhos: torch.Tensor  # [T, B], clipped importance weights min(rho_bar, pi/mu), for logging


def _float_dtype(x) -> torch.dtype | None:
    """The floating dtype ``x`` carries (a tensor's or a numpy array's), else None (numbers, lists, ints)."""
    if isinstance(x, torch.Tensor):
        return x.dtype if x.dtype.is_floating_point else None
    dtype = getattr(x, "dtype", None)
    if not isinstance(dtype, np.dtype) or dtype.kind != "f":
        return None
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except TypeError:  # float128 and the like: torch has no such dtype
        return None


def _common_dtype(floats: dict) -> torch.dtype:
    """The one floating dtype of the float inputs ``{name: value}`` (see the module docstring)."""
    found = {name: dt for name, x in floats.items() if x is not None and (dt := _float_dtype(x)) is not None}
    if len(set(found.values())) > 1:
        listing = ", ".join(f"{name} {str(dt).removeprefix('torch.')}" for name, dt in found.items())
        raise ValueError(
            f"mixed float dtypes ({listing}): pass every float input in one dtype, which the computation keeps"
        )
    return next(iter(found.values()), torch.get_default_dtype())


def _tensor(x, name: str, dtype: torch.dtype | None, device=None) -> torch.Tensor:
    """``x`` as a tensor on ``device``, in ``dtype`` (None: its own, for masks)."""
    try:
        t = torch.as_tensor(x, device=device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{name}: cannot convert to a tensor ({e})") from None
    return t.to(device=device) if dtype is None else t.to(dtype=dtype, device=device)


def _time_major(
    names_values: dict, dtype: torch.dtype, device=None, masks: tuple[str, ...] = ()
) -> tuple[list[torch.Tensor], int, int]:
    """Converts ``[T, B]`` inputs to ``dtype`` (``masks`` keep theirs) and checks that they all share one
    shape, T >= 1."""
    out: list[torch.Tensor] = []
    shape: torch.Size | None = None
    for name, x in names_values.items():
        t = _tensor(x, name, None if name in masks else dtype, device)
        if t.dim() != 2:
            raise ValueError(f"{name} must be time-major [T, B], got shape {tuple(t.shape)}")
        if shape is None:
            shape = t.shape
            if shape[0] < 1:
                raise ValueError(f"{name} has T = 0 steps; need at least one")
        elif t.shape != shape:
            first = next(iter(names_values))
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} (the shape of {first})")
        out.append(t)
    if shape is None:
        raise ValueError("no inputs")
    return out, shape[0], shape[1]


def _device(x) -> torch.device:
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


def _per_env(x, name: str, B: int, dtype: torch.dtype, device) -> torch.Tensor:
    t = _tensor(x, name, dtype, device)
    if t.shape != (B,):
        raise ValueError(f"{name} must have shape [B] = ({B},), got {tuple(t.shape)}")
    return t


def _check_unit(x: float, name: str) -> None:
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {x}")


def gae(
    rewards,
    values,
    terminated,
    truncated,
    bootstrap_value,
    truncation_value=None,
    gamma: float = 0.99,
    gae_lambda: float = 0.95,
) -> GAEReturns:
    """Generalized Advantage Estimation (Schulman et al. 2016) with gymnasium episode ends.

    Args: ``rewards, values, terminated, truncated`` are ``[T, B]``; ``values[t]`` = V(s_t).
    ``bootstrap_value`` ``[B]`` is V(s_T), the value of the observation after the last step (used
    where the rollout cuts an episode). ``truncation_value`` ``[T, B]`` or None (= zeros) holds, at
    rows where ``truncated`` is set, V(final observation of the truncated episode); it is ignored
    (even if NaN) elsewhere.

    With next value ``nv_t`` = 0 if terminated[t], truncation_value[t] if truncated[t], else
    values[t+1] (bootstrap_value at t = T-1), and ``continue_t = 1 - (terminated_t or truncated_t)``::

        delta_t = r_t + gamma * nv_t - V_t
        A_t     = delta_t + gamma * lambda * continue_t * A_{t+1},   A_T = 0
        returns = A + values

    ``gae_lambda = 1`` gives bootstrapped Monte-Carlo returns; ``gae_lambda = 0`` one-step TD.

    Dtype: ``rewards, values, bootstrap_value, truncation_value`` share one float dtype, which the
    computation and both outputs keep (float64 in, float64 out); mixed dtypes raise ValueError.
    The masks may be bool, int or float.
    """
    _check_unit(gamma, "gamma")
    _check_unit(gae_lambda, "gae_lambda")
    device = _device(rewards)
    dtype = _common_dtype(
        {"rewards": rewards, "values": values, "bootstrap_value": bootstrap_value, "truncation_value": truncation_value}
    )
    with torch.no_grad():
        args = {"rewards": rewards, "values": values, "terminated": terminated, "truncated": truncated}
        if truncation_value is not None:
            args["truncation_value"] = truncation_value
        ts, T, B = _time_major(args, dtype, device, masks=("terminated", "truncated"))
        r, v, term, trunc = ts[:4]
        tv = ts[4] if truncation_value is not None else torch.zeros_like(r)
        boot = _per_env(bootstrap_value, "bootstrap_value", B, dtype, device)
        is_term, is_trunc = term != 0, trunc != 0
        next_values = torch.cat([v[1:], boot[None]], dim=0)
        nv = torch.where(is_trunc, tv, next_values)  # where(): a NaN elsewhere never leaks in
        nv = torch.where(is_term, torch.zeros_like(nv), nv)
        cont = (~(is_term | is_trunc)).to(dtype)
        deltas = r + gamma * nv - v
        adv = torch.empty_like(r)
        last = torch.zeros(B, dtype=dtype, device=device)
        for t in range(T - 1, -1, -1):
            last = deltas[t] + gamma * gae_lambda * cont[t] * last
            adv[t] = last
        return GAEReturns(adv, adv + v)


def vtrace(
    behaviour_logp, target_logp, rewards, discounts, values, bootstrap_value, rho_bar: float = 1.0, c_bar: float = 1.0
) -> VTraceReturns:
    """V-trace targets and policy-gradient advantages (Espeholt et al. 2018, IMPALA, eq. 1).

    Inputs are ``[T, B]``; ``bootstrap_value`` ``[B]`` is V(x_T). ``discounts[t]`` is the discount
    applied after step t: ``gamma`` normally, ``0`` once the episode has ended (so nothing from the
    next episode leaks back). With ``rho_t = min(rho_bar, pi/mu)``, ``c_t = min(c_bar, pi/mu)``::

        delta_t = rho_t * (r_t + discount_t * V(x_{t+1}) - V(x_t))
        vs_t    = V(x_t) + delta_t + discount_t * c_t * (vs_{t+1} - V(x_{t+1})),  vs_T = V(x_T)
        pg_advantages_t = rho_t * (r_t + discount_t * vs_{t+1} - V(x_t))

    Note the policy-gradient weight is clipped at ``rho_bar`` too (the paper allows a separate
    clip there; we use the same one).

    Truncation (time limits) is the caller's job, done by :func:`vtrace_discounts_and_rewards`:
    at a truncated step t it adds ``gamma * V(final obs)`` to ``r_t`` and sets ``discount_t = 0``.
    This is exact for the bootstrap term: the target becomes ``r_t + gamma * V(final obs)``, which
    is precisely what V-trace does when a rollout ends at a state (vs_T = V(x_T)), and the trace is
    cut so the next episode does not leak back.

    Dtype (as rlax): every input shares one float dtype, which the computation and all outputs keep
    (float64 in, float64 out: errors ~1e-12 against a float64 reference, not float32's ~1e-6);
    mixed dtypes raise ValueError naming each argument's.
    """
    if not (rho_bar > 0 and c_bar > 0):
        raise ValueError(f"rho_bar and c_bar must be > 0, got rho_bar={rho_bar}, c_bar={c_bar}")
    device = _device(rewards)
    floats = {
        "behaviour_logp": behaviour_logp,
        "target_logp": target_logp,
        "rewards": rewards,
        "discounts": discounts,
        "values": values,
    }
    dtype = _common_dtype({**floats, "bootstrap_value": bootstrap_value})
    with torch.no_grad():
        (mu, pi, r, d, v), T, B = _time_major(floats, dtype, device)
        boot = _per_env(bootstrap_value, "bootstrap_value", B, dtype, device)
        ratios = bounded_ratio(pi, mu)
        rhos = torch.clamp(ratios, max=rho_bar)
        cs = torch.clamp(ratios, max=c_bar)
        values_tp1 = torch.cat([v[1:], boot[None]], dim=0)
        deltas = rhos * (r + d * values_tp1 - v)
        vs_minus_v = torch.empty_like(v)
        acc = torch.zeros(B, dtype=dtype, device=device)
        for t in range(T - 1, -1, -1):
            acc = deltas[t] + d[t] * cs[t] * acc
            vs_minus_v[t] = acc
        vs = vs_minus_v + v
        vs_tp1 = torch.cat([vs[1:], boot[None]], dim=0)
        pg_advantages = rhos * (r + d * vs_tp1 - v)
        return VTraceReturns(vs, pg_advantages, rhos)


def vtrace_discounts_and_rewards(
    rewards, terminated, truncated, truncation_value, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Folds gymnasium episode ends into the ``(rewards, discounts)`` that :func:`vtrace` takes.

    ``discounts = gamma * (1 - (terminated or truncated))``; at truncated-but-not-terminated steps
    ``rewards' = rewards + gamma * truncation_value`` (V of the final observation, ``[T, B]``; None
    means zeros; ignored elsewhere). Terminated steps get no bootstrap. Returns ``(rewards',
    discounts)``, both ``[T, B]`` in the dtype of ``rewards`` and ``truncation_value`` (which must agree).
    """
    _check_unit(gamma, "gamma")
    device = _device(rewards)
    dtype = _common_dtype({"rewards": rewards, "truncation_value": truncation_value})
    with torch.no_grad():
        args = {"rewards": rewards, "terminated": terminated, "truncated": truncated}
        if truncation_value is not None:
            args["truncation_value"] = truncation_value
        ts, _, _ = _time_major(args, dtype, device, masks=("terminated", "truncated"))
        r, term, trunc = ts[:3]
        tv = ts[3] if truncation_value is not None else torch.zeros_like(r)
        is_term, is_trunc = term != 0, trunc != 0
        bootstrap = torch.where(is_trunc & ~is_term, tv, torch.zeros_like(tv))
        discounts = gamma * (~(is_term | is_trunc)).to(dtype)
        return r + gamma * bootstrap, discounts


def truncated_importance_weights(target_logp, behaviour_logp, clip: float) -> torch.Tensor:
    """``min(clip, exp(target_logp - behaviour_logp))``, elementwise, as a detached weight (the log-ratio bounded
    by LOG_RATIO_BOUND).

    Computed under ``torch.no_grad()``: gradients never flow through the weight, only through
    whatever it multiplies. Both inputs must have the same shape and float dtype, which the weight
    keeps; ``clip`` must be > 0.
    """
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    device = _device(target_logp)
    dtype = _common_dtype({"target_logp": target_logp, "behaviour_logp": behaviour_logp})
    with torch.no_grad():
        pi = _tensor(target_logp, "target_logp", dtype, device)
        mu = _tensor(behaviour_logp, "behaviour_logp", dtype, device)
        if pi.shape != mu.shape:
            raise ValueError(f"target_logp shape {tuple(pi.shape)} != behaviour_logp shape {tuple(mu.shape)}")
        return torch.clamp(bounded_ratio(pi, mu), max=clip)


def bounded_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """``exp(clamp(logp - old_logp, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))``: the ratio of two probabilities from
    their logs, finite whatever the logs (see LOG_RATIO_BOUND). Differentiable inside the bound."""
    return (logp - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
