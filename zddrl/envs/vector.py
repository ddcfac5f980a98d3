"""What an actor host steps (``ActorEnvs``): ``VecEnv``, gymnasium envs one after the other, or ``AleVecEnv``
(zddrl.envs.atari), as ``actor_envs`` picks by ``env.backend``; and the ``EnvLatency`` benchmark knob. The top of
zddrl.envs: it imports the package's other modules, none of them imports it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from zddrl.config import EnvConfig
from zddrl.envs.atari import ALE_VECTOR_KWARGS, AleVecEnv
from zddrl.envs.make import make_factory
from zddrl.envs.spaces import EnvError, EnvSpec, env_action, env_spec


class EnvLatency(gym.Wrapper):
    """Benchmark knob (``train.env_latency_ms``): every ``step`` sleeps ``latency_ms`` first, as a remote or slow
    simulator would take that long to answer. Sleeping, not spinning, so that on a small host the latency of many
    actors overlaps as a remote simulator's would, and the CPU stays free for the rest of the system."""

    def __init__(self, env: gym.Env, latency_ms: float) -> None:
        super().__init__(env)
        self.latency_s = latency_ms / 1000.0

    def step(self, action: Any) -> Any:
        time.sleep(self.latency_s)
        return self.env.step(action)


def with_latency(make: Callable[[], gym.Env], latency_ms: float) -> Callable[[], gym.Env]:
    """``make`` with every env wrapped in ``EnvLatency`` (``make`` itself when ``latency_ms`` is 0)."""
    if latency_ms <= 0:
        return make
    return lambda: EnvLatency(make(), latency_ms)


class ActorEnvs(Protocol):
    """What an actor host steps: ``VecEnv`` (gymnasium envs, one at a time) or ``AleVecEnv`` (ALE's C++ vector env).
    ``obs`` is the current observation of every env; ``step`` resets an env whose episode ended in the same step
    and hands back its final observation; ``finished`` collects ``(return, length)`` of the episodes that ended."""

    num_envs: int
    spec: EnvSpec
    dtype: np.dtype
    obs: np.ndarray
    life_lost: np.ndarray
    episodic_life: bool
    finished: list[tuple[float, int]]

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]: ...

    def close(self) -> None: ...


def actor_envs(
    env: EnvConfig, seeds: list[int], allowed: frozenset[str] | None = None, latency_ms: float = 0.0
) -> ActorEnvs:
    """An actor host's envs of a run's ``[env]`` section (``env.backend``), env ``i`` seeded with ``seeds[i]``."""
    if env.backend == "ale_vector":
        if latency_ms > 0:
            raise EnvError("env latency (a benchmark knob) wraps gymnasium envs: not with env.backend 'ale_vector'")
        if env.kwargs:
            raise EnvError(ALE_VECTOR_KWARGS)
        return AleVecEnv(env, seeds)
    return VecEnv(with_latency(make_factory(env, allowed), latency_ms), seeds, env.episodic_life)


class VecEnv:
    """N envs stepped in one process with same-step auto-reset.

    ``step`` returns the next observations (already reset where an episode ended), rewards,
    terminated and truncated flags, and for each env whose episode ended the *final* observation of
    that episode (needed to bootstrap at truncation). Finished episodes' returns and lengths are
    collected in ``finished``. Env ``i`` is seeded with ``seeds[i]`` on its first reset; later
    resets continue that env's own generator, so each env has its own seed stream.
    """

    def __init__(self, make: Callable[[], gym.Env], seeds: list[int], episodic_life: bool = False) -> None:
        self.envs = [make() for _ in seeds]
        self.episodic_life = episodic_life
        """Whether rollouts carry ``life_lost`` (the envs are wrapped in ``LifeLoss``)."""
        self.life_lost = np.zeros(len(seeds), dtype=bool)
        """Of the last step: the envs whose game took a life and went on (``LifeLoss``)."""
        self.spec = env_spec(self.envs[0])
        self.num_envs = len(self.envs)
        self.dtype = np.dtype(self.spec.obs_dtype)
        """Observations keep the env's uint8 (pixels) from env to wire; anything else is float32."""
        self.obs = np.stack([np.asarray(env.reset(seed=s)[0], dtype=self.dtype) for env, s in zip(self.envs, seeds)])
        self.ep_return = np.zeros(self.num_envs, dtype=np.float64)
        self.ep_length = np.zeros(self.num_envs, dtype=np.int64)
        self.finished: list[tuple[float, int]] = []
        self.to_env = env_action(self.spec)

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        n = self.num_envs
        rewards = np.empty(n, dtype=np.float32)
        terminated = np.empty(n, dtype=bool)
        truncated = np.empty(n, dtype=bool)
        final_obs: dict[int, np.ndarray] = {}
        next_obs = self.obs.copy()
        for i, env in enumerate(self.envs):
            obs, r, term, trunc, info = env.step(self.to_env(actions[i]))
            rewards[i], terminated[i], truncated[i] = r, term, trunc
            self.life_lost[i] = info.get("life_lost", False)
            self.ep_return[i] += r
            self.ep_length[i] += 1
            if term or trunc:
                final_obs[i] = np.asarray(obs, dtype=self.dtype)
                self.finished.append((float(self.ep_return[i]), int(self.ep_length[i])))
                self.ep_return[i], self.ep_length[i] = 0.0, 0
                obs, _ = env.reset()
            next_obs[i] = obs
        self.obs = next_obs
        return next_obs, rewards, terminated, truncated, final_obs

    def close(self) -> None:
        for env in self.envs:
            env.close()
