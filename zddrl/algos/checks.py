"""What a run's config asks of its env and of this machine, checked before anything starts.

Numpy only (no torch): `zddrl train` and `zddrl learner` run these in the command's own process, whose start-up
must not pay for importing torch; the learner cores run the same checks again when they are built.
"""

from __future__ import annotations

import numpy as np

from zddrl.algos.replay_memory import ReplayMemoryError, check_fits, replay_nbytes
from zddrl.config import REPLAY_MODES, Config
from zddrl.envs import EnvSpec


def spec_refusal(config: Config, spec: EnvSpec) -> str:
    """Why ``config``'s mode cannot learn in an env of ``spec``, or ""."""
    mode = config.algo.mode
    if mode in REPLAY_MODES and config.model.kind != "mlp":
        return f"algo.mode {mode!r} runs with model.kind 'mlp' only (its CNN networks are not built yet)"
    if mode in REPLAY_MODES and config.learner.autocast != "off":
        return f"algo.mode {mode!r} does not take learner.autocast (PPO and IMPALA only)"
    if mode in REPLAY_MODES and config.env.episodic_life:
        return f"algo.mode {mode!r} does not take env.episodic_life (its n-step returns read no life_lost)"
    if mode == "apex" and not spec.discrete:
        return "algo.mode 'apex' needs a discrete (Discrete) action space"
    if mode == "sac" and spec.discrete:
        return "algo.mode 'sac' needs a continuous (1-D Box) action space"
    if mode == "sac" and not np.all(np.isfinite(spec.action_low + spec.action_high)):
        return "algo.mode 'sac' needs finite action bounds (it squashes actions into them)"
    return ""


def replay_refusal(config: Config, spec: EnvSpec) -> str:
    """Why the replay buffer ``config`` asks for cannot be built here (it would not fit in memory), or ""."""
    if config.algo.mode not in REPLAY_MODES:
        return ""
    rc = config.replay
    action_shape = () if spec.discrete else (spec.action_dim,)
    action_dtype = np.int64 if spec.discrete else np.float32
    need = replay_nbytes(rc.capacity, spec.obs_shape, np.dtype(spec.obs_dtype), action_shape, action_dtype)
    try:
        check_fits(rc.capacity, need, rc.memory_fraction)
    except ReplayMemoryError as exc:
        return f"replay.capacity: {exc}"
    return ""
