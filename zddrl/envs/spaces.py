"""What a policy needs to know of an env (``EnvSpec``), read from its spaces, and a policy's action as the env
takes it (``env_action``). Only Box and Discrete observation/action spaces are supported; anything else is a clear
error at start-up (``EnvError``). The base of zddrl.envs: it imports nothing else of the package."""

from __future__ import annotations

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


OBS_DTYPES = ("float32", "uint8")


def env_spec(env: gym.Env) -> EnvSpec:
    obs, act = env.observation_space, env.action_space
    if not isinstance(obs, gym.spaces.Box):
        raise EnvError(f"observation space {obs} is not supported (Box only)")
    # uint8 observations (pixels, 4x smaller) stay uint8; every other dtype travels as float32
    obs_dtype = "uint8" if obs.dtype == np.uint8 else "float32"
    if isinstance(act, gym.spaces.Discrete):
        return EnvSpec(obs_shape=tuple(obs.shape), discrete=True, action_dim=int(act.n), obs_dtype=obs_dtype)
    if isinstance(act, gym.spaces.Box) and len(act.shape) == 1:
        return EnvSpec(
            obs_shape=tuple(obs.shape),
            discrete=False,
            action_dim=int(act.shape[0]),
            action_low=tuple(float(x) for x in act.low),
            action_high=tuple(float(x) for x in act.high),
            obs_dtype=obs_dtype,
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
