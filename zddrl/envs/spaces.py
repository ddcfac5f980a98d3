"""What a policy needs to know of an env (``EnvSpec``), read from its spaces, and a policy's action as the env
takes it (``env_action``). Observations must be a Box, actions Discrete or a 1-D Box; anything else is a clear
error at start-up (``EnvError``). The base of zddrl.envs: it imports nothing else of the package."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np


class EnvError(ValueError):
    """An env that cannot be built or whose spaces zddrl cannot handle."""


@dataclass(frozen=True)
class EnvSpec:
    """What the policy network needs to know about an env."""

    obs_shape: tuple[int, ...]
    discrete: bool
    action_dim: int
    """Number of actions (Discrete) or the action vector length (Box)."""
    action_low: tuple[float, ...] = ()
    action_high: tuple[float, ...] = ()
    obs_dtype: str = "float32"
    """``float32`` or ``uint8`` (pixels): observations keep this dtype in the actor's buffer, on the wire and in
    the learner's batches; a model scales ``uint8`` inside its forward pass (zddrl.algos.cnn)."""
    reward_low: float = -math.inf
    reward_high: float = math.inf
    """The reward range the env declares (``reward_range``, see ``declared_reward_range``); infinite where it declares
    none. The learner refuses a rollout with a reward outside it (``algos.rollout.mismatch``)."""


OBS_DTYPES = ("float32", "uint8")


def declared_reward_range(env: gym.Env) -> tuple[float, float]:
    """The ``(low, high)`` per-step reward range ``env`` declares, ``(-inf, inf)`` where it declares none.

    gymnasium 1.x dropped ``Env.reward_range``; an env (or a wrapper of it) that still sets the attribute declares
    one, read through the wrapper chain (``get_wrapper_attr``: the outermost that has it). Anything but two numbers
    with ``low <= high`` declares nothing (gymnasium 0.x's default ``(-inf, inf)`` included)."""
    try:
        declared = env.get_wrapper_attr("reward_range")
        low, high = (float(x) for x in declared)
    except (AttributeError, TypeError, ValueError):
        return -math.inf, math.inf
    if math.isnan(low) or math.isnan(high) or low > high:
        return -math.inf, math.inf
    return low, high


def env_spec(env: gym.Env) -> EnvSpec:
    obs, act = env.observation_space, env.action_space
    if not isinstance(obs, gym.spaces.Box):
        raise EnvError(f"observation space {obs} is not supported (Box only)")
    # uint8 observations (pixels, 4x smaller) stay uint8; every other dtype travels as float32
    obs_dtype = "uint8" if obs.dtype == np.uint8 else "float32"
    low, high = declared_reward_range(env)
    if isinstance(act, gym.spaces.Discrete):
        return EnvSpec(
            obs_shape=tuple(obs.shape),
            discrete=True,
            action_dim=int(act.n),
            obs_dtype=obs_dtype,
            reward_low=low,
            reward_high=high,
        )
    if isinstance(act, gym.spaces.Box) and len(act.shape) == 1:
        return EnvSpec(
            obs_shape=tuple(obs.shape),
            discrete=False,
            action_dim=int(act.shape[0]),
            action_low=tuple(float(x) for x in act.low),
            action_high=tuple(float(x) for x in act.high),
            obs_dtype=obs_dtype,
            reward_low=low,
            reward_high=high,
        )
    raise EnvError(f"action space {act} is not supported (Discrete or 1-D Box only)")


def spec_of(make: Callable[[], gym.Env]) -> EnvSpec:
    """The spec of the env ``make`` builds (one built and closed)."""
    env = make()
    try:
        return env_spec(env)
    finally:
        env.close()


def env_action(spec: EnvSpec) -> Callable[[Any], Any]:
    """One policy action as the env takes it: an ``int`` (Discrete), or clipped to the bounds (Box)."""
    if spec.discrete:
        return int
    low, high = np.asarray(spec.action_low), np.asarray(spec.action_high)
    return lambda a: np.clip(a, low, high)
