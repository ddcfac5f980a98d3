"""What an actor host steps (``ActorEnvs``): ``VecEnv``, gymnasium envs one after the other, or ``AleVecEnv``
(zddrl.envs.atari), as ``actor_envs`` picks by ``env.backend``; and envs slower than their own speed (``SlowEnvs``:
``EnvLatency``, ``Slowdown``), the testing and benchmark knobs. The top of zddrl.envs: it imports the package's
other modules, none of them imports it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from zddrl.config import EnvConfig
from zddrl.envs.atari import ALE_VECTOR_KWARGS, AleVecEnv
from zddrl.envs.make import make_factory
from zddrl.envs.spaces import EnvError, EnvSpec, env_action, env_spec


class ActorEnvs(Protocol):
    """What an actor host steps: ``VecEnv`` (gymnasium envs, one at a time) or ``AleVecEnv`` (ALE's C++ vector env),
    either of them in ``Slowdown`` for a slow host.
    ``obs`` is the current observation of every env; ``step`` resets an env whose episode ended in the same step
    and hands back its final observation; ``finished`` collects ``(return, length)`` of the episodes that ended."""

    num_envs: int
    spec: EnvSpec
    dtype: np.dtype
    episodic_life: bool

    @property
    def obs(self) -> np.ndarray: ...

    @property
    def life_lost(self) -> np.ndarray: ...

    @property
    def finished(self) -> list[tuple[float, int]]: ...

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]: ...

    def close(self) -> None: ...


ActorEnvsFactory = Callable[[EnvConfig, list[int], frozenset[str]], ActorEnvs]
"""How an actor host builds its envs from a run's ``[env]``, the seeds and the code it allows: ``actor_envs``, or
``SlowEnvs`` for envs slower than their own speed."""


def actor_envs(
    env: EnvConfig,
    seeds: list[int],
    allowed: frozenset[str] | None = None,
    wrapper: Callable[[gym.Env], gym.Env] | None = None,
) -> ActorEnvs:
    """An actor host's envs of a run's ``[env]`` section (``env.backend``), env ``i`` seeded with ``seeds[i]``, each
    gymnasium env in ``wrapper`` if one is given."""
    if env.backend == "ale_vector":
        if wrapper is not None:
            raise EnvError("a per-env wrapper (an env latency) needs gymnasium envs: not env.backend 'ale_vector'")
        if env.kwargs:
            raise EnvError(ALE_VECTOR_KWARGS)
        return AleVecEnv(env, seeds)
    make = make_factory(env, allowed)
    return VecEnv(make if wrapper is None else lambda: wrapper(make()), seeds, env.episodic_life)


@dataclass(frozen=True)
class SlowEnvs:
    """``actor_envs`` for a host whose envs run slower than their own speed: testing and benchmark knobs
    (``zddrl actor --slowdown --env-latency-ms``, ``train.slowdowns``, ``train.env_latency_ms``). ``SlowEnvs()``
    builds what ``actor_envs`` builds::

        ActorHost(connect, actor_id, make_envs=SlowEnvs(slowdown=4.0))
    """

    slowdown: float = 1.0
    """Every step of the host's envs takes this many times as long (``Slowdown``); 1 or less: their own speed."""
    latency_ms: float = 0.0
    """Every env step sleeps this long first (``EnvLatency``); 0: none. Gymnasium envs only (not ``ale_vector``)."""

    def __call__(self, env: EnvConfig, seeds: list[int], allowed: frozenset[str] | None = None) -> ActorEnvs:
        wrapper = partial(EnvLatency, latency_ms=self.latency_ms) if self.latency_ms > 0 else None
        envs = actor_envs(env, seeds, allowed, wrapper)
        return Slowdown(envs, self.slowdown) if self.slowdown > 1.0 else envs


class EnvLatency(gym.Wrapper):
    """An env that answers late (``SlowEnvs.latency_ms``): every ``step`` sleeps ``latency_ms`` first, as a remote
    or slow simulator would take that long to answer. Sleeping, not spinning, so that on a small host the latency of
    many actors overlaps as a remote simulator's would, and the CPU stays free for the rest of the system."""

    def __init__(self, env: gym.Env, latency_ms: float) -> None:
        super().__init__(env)
        self.latency_s = latency_ms / 1000.0

    def step(self, action: Any) -> Any:
        time.sleep(self.latency_s)
        return self.env.step(action)


class Slowdown:
    """``envs``, ``factor`` times slower per step (``SlowEnvs.slowdown``), as on a slower host. Each ``step`` sleeps
    ``factor - 1`` times what the actor spent on that step: from its reading ``obs`` (the observation it acts on,
    so its policy's time counts too) until the envs have stepped. Measured step by step, so a slow step stays
    slow in proportion; the time between rollouts (sending, waiting for parameters) is not slowed."""

    def __init__(self, envs: ActorEnvs, factor: float) -> None:
        self.envs, self.factor = envs, factor
        self.num_envs, self.spec, self.dtype = envs.num_envs, envs.spec, envs.dtype
        self.episodic_life = envs.episodic_life
        self._read_at = time.perf_counter()
        """When the actor last read ``obs``: where the step it is taking began."""

    @property
    def obs(self) -> np.ndarray:
        self._read_at = time.perf_counter()
        return self.envs.obs

    @property
    def life_lost(self) -> np.ndarray:
        return self.envs.life_lost

    @property
    def finished(self) -> list[tuple[float, int]]:
        return self.envs.finished

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        out = self.envs.step(actions)
        time.sleep((self.factor - 1.0) * (time.perf_counter() - self._read_at))
        return out

    def close(self) -> None:
        self.envs.close()


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
