"""What a learner core reads of a rollout: the ``Rollout`` interface, its truncation arrays, and
whether a run can train on its arrays beyond the protocol's checks.

``zddrl.protocol.decode`` guarantees the shape of a trajectory (docs/protocol.md section 7): every
array present, dtypes, and shapes that agree on ``T``, ``N`` and the observation shape. Whether the
data fits *this run* (its environment's observation and action spaces, its rollout length) and is
trainable (finite numbers, rewards within the env's declared range, indices in range) depends on the run, so
the learner asks ``mismatch`` before a trajectory goes anywhere near a batch. ``truncations`` reads the optional
truncation arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from zddrl.envs import EnvSpec


class Rollout(Protocol):
    """One actor's rollout as the cores read it (a received ``zddrl.protocol.Trajectory`` is one): its
    arrays (docs/protocol.md section 7) and its identity, which orders a batch and keys per-stream state."""

    @property
    def peer_id(self) -> str: ...

    @property
    def seq(self) -> int: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def arrays(self) -> Mapping[str, np.ndarray]: ...


_NO_INDEX = np.zeros(0, dtype=np.int64)
_NO_VALUE = np.zeros(0, dtype=np.float32)
LOGP_SLACK = 1e-3
"""A categorical log-probability is at most 0; float32 rounding may put it a hair above."""
LOGP_BOUND = 1e4
"""Behaviour log-probabilities must lie in ``[-LOGP_BOUND, LOGP_BOUND]`` (discrete: ``[-LOGP_BOUND, 0]``). An action
sampled with probability e^-10000 is never drawn (float32 cannot even hold e^-104), and a Gaussian's density
reaches e^10000 only with a standard deviation no policy has; a number out there is a bug or an attack, and
training on it would only be saved by the ratio bound (``returns.LOG_RATIO_BOUND``)."""
REWARD_BOUND = 1e9
"""Rewards must lie within ``+-REWARD_BOUND``: no env pays more per step, and sums of such numbers (returns, n-step
targets) overflow float32 (3.4e38) long before anything is learned from them."""
REWARD_RANGE_SLACK = 1e-6
"""Relative tolerance of the declared-reward-range check: a reward travels as float32, which may round the env's own
float64 a hair past a bound it met."""
BOUND_SLACK = 1e-4
"""Relative tolerance of the action-bounds check (float32 rounding of ``mid + half * tanh(u)``)."""


def terminal(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """``[T, N]``: where the returns must not bootstrap: ``terminated``, and with ``env.episodic_life`` every lost
    life (``life_lost``), which ends no episode: metrics still count whole games."""
    lost = arrays.get("life_lost")
    return arrays["terminated"] if lost is None else arrays["terminated"] | lost


def truncations(arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(trunc_idx [K], trunc_obs [K, *obs_shape], trunc_value [K])``; ``K = 0`` when the trajectory
    carries none (the arrays are on the wire only when some episode was truncated)."""
    if "trunc_idx" in arrays:
        return arrays["trunc_idx"], arrays["trunc_obs"], arrays["trunc_value"]
    next_obs = arrays["next_obs"]
    return _NO_INDEX, np.zeros((0, *next_obs.shape[1:]), dtype=next_obs.dtype), _NO_VALUE


def truncation_bootstrap(arrays: Mapping[str, np.ndarray], values: np.ndarray | None = None) -> np.ndarray:
    """``[T, N]`` float32: at each step where an episode was truncated (a time limit, not a termination), the value
    to bootstrap the return from; 0 elsewhere. The ``trunc_value`` argument of ``returns.gae``. The values are the
    ones the actors sent (``trunc_value``), or ``values`` (``[K]``: the current network's of ``trunc_obs``, for data
    acted with an older version)."""
    T, N = arrays["rewards"].shape
    index, _, sent = truncations(arrays)
    out = np.zeros((T, N), np.float32)
    out.reshape(-1)[index] = sent if values is None else values
    return out


def mismatch(
    arrays: Mapping[str, np.ndarray], spec: EnvSpec, rollout_len: int | None = None, bounded: bool = False
) -> str:
    """Why a decoded trajectory cannot be trained on in a run of ``spec``, or "" if it can.

    ``rollout_len``: the only ``T`` accepted (IMPALA stacks trajectories time-major, so all of a batch
    must share it); None accepts any. ``bounded``: continuous actions must lie within the env's bounds (SAC's
    actors send the squashed actions they executed; PPO's send unclipped Gaussian samples).
    """
    obs, actions = arrays["obs"], arrays["actions"]
    T, N = obs.shape[:2]
    if obs.shape[2:] != tuple(spec.obs_shape):
        return f"observations of shape {list(obs.shape[2:])}, the run's env has {list(spec.obs_shape)}"
    if obs.dtype != np.dtype(spec.obs_dtype):  # the protocol made next_obs and trunc_obs the same dtype
        return f"observations of dtype {obs.dtype}, the run's env has {spec.obs_dtype}"
    if rollout_len is not None and T != rollout_len:
        return f"a rollout of {T} steps, the run's rollouts have {rollout_len}"
    if spec.discrete:
        if actions.ndim != 2:
            return f"continuous actions {list(actions.shape)} for a discrete action space"
        if actions.min() < 0 or actions.max() >= spec.action_dim:
            return f"actions outside 0..{spec.action_dim - 1}"
        if arrays["logp"].max() > LOGP_SLACK:
            return "positive log-probabilities of discrete actions"
    elif actions.ndim != 3 or actions.shape[2] != spec.action_dim:
        return f"actions of shape {list(actions.shape)}, the run's env needs [T, N, {spec.action_dim}]"
    elif bounded and not _within_bounds(actions, spec):
        return "actions outside the env's action bounds"
    rewards = arrays["rewards"]
    if np.abs(rewards).max() > REWARD_BOUND:  # NaN passes here: the finiteness check below names it
        return f"rewards beyond +-{REWARD_BOUND:g}"
    if not _within_reward_range(rewards, spec):
        return (
            f"rewards outside the env's declared reward range [{spec.reward_low:g}, {spec.reward_high:g}] "
            f"({rewards.min():g} .. {rewards.max():g})"
        )
    logp = arrays["logp"]
    if logp.min() < -LOGP_BOUND or logp.max() > LOGP_BOUND:  # NaN passes here: the finiteness check below names it
        return f"implausible behaviour log-probabilities (outside +-{LOGP_BOUND:g}: {logp.min():g} .. {logp.max():g})"
    index = arrays.get("trunc_idx")
    if index is not None:
        if index.min() < 0 or index.max() >= T * N or len(np.unique(index)) != len(index):
            return f"truncation indices outside 0..{T * N - 1} or repeated"
        if not (arrays["truncated"].reshape(-1)[index] & ~arrays["terminated"].reshape(-1)[index]).all():
            return "truncation indices of steps that were not truncated (or were terminated)"
    for name, a in arrays.items():  # the algorithm's declared arrays too
        if a.size and a.dtype.kind == "f" and not np.isfinite(a).all():  # uint8 pixels always are
            return f"non-finite values in {name!r}"
    return ""


def _within_reward_range(rewards: np.ndarray, spec: EnvSpec) -> bool:
    """Whether every reward lies in the env's declared range (true where it declares none; NaN is left to the
    finiteness check)."""
    low, high = spec.reward_low, spec.reward_high
    if not rewards.size or (np.isinf(low) and np.isinf(high)):
        return True
    low -= REWARD_RANGE_SLACK * max(1.0, abs(low)) if np.isfinite(low) else 0.0
    high += REWARD_RANGE_SLACK * max(1.0, abs(high)) if np.isfinite(high) else 0.0
    return not (rewards.min() < low or rewards.max() > high)


def _within_bounds(actions: np.ndarray, spec: EnvSpec) -> bool:
    low, high = np.asarray(spec.action_low), np.asarray(spec.action_high)
    slack = BOUND_SLACK * (high - low) + 1e-6
    return bool(np.all(actions >= low - slack) and np.all(actions <= high + slack))  # False for NaN too
