"""What a run's config asks of its env and of this machine, checked before anything starts.

Numpy only (no torch): `zddrl train` and `zddrl learner` run these in the command's own process, whose start-up
must not pay for importing torch; the learner cores run the same checks again when they are built. The exception is a
network of the user's own (``model.kind = "module:make"``), built once here so that a factory that breaks its
interface (a recurrent one among them) is one line before any process starts, not a learner that dies in its log.
"""

from __future__ import annotations

import numpy as np

from zddrl.algos.replay_buffer.memory import ReplayMemoryError, check_fits, replay_nbytes
from zddrl.algos.spec import algorithm_of, declared_arrays
from zddrl.config import Config, ConfigError
from zddrl.envs import EnvSpec


def spec_refusal(config: Config, spec: EnvSpec) -> str:
    """Why ``config``'s algorithm cannot learn in an env of ``spec``, or "" (the algorithm's own ``check``, and its
    declared arrays: the learner's hello states them, and a declaration the brokers refuse ends the run at once)."""
    algorithm = algorithm_of(config)
    try:
        declared_arrays(algorithm, config, spec)
    except ValueError as exc:
        return str(exc)
    why = algorithm.check(config, spec)
    if why or not config.model.is_custom:
        return why
    try:  # a network of the user's own is checked where it is built (zddrl.algos.custom_model)
        algorithm.acting_model(config, spec)
    except ConfigError as exc:
        return str(exc)
    return ""


def replay_refusal(config: Config, spec: EnvSpec) -> str:
    """Why the replay buffer ``config`` asks for cannot be built here (it would not fit in memory), or ""."""
    if not algorithm_of(config).replay:
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
