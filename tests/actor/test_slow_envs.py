"""Envs slower than their own speed (``envs.SlowEnvs``: ``zddrl actor --slowdown --env-latency-ms``,
``train.slowdowns``, ``train.env_latency_ms``): the wrappers the actor's env factory applies."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from zddrl.config import ConfigError, EnvConfig, TrainConfig
from zddrl.envs import EnvLatency, Slowdown, SlowEnvs, VecEnv, actor_envs
from zddrl.envs import vector as V

CARTPOLE = EnvConfig(id="CartPole-v1")


class FakeClock:
    """``time`` for zddrl.envs.vector: ``perf_counter`` reads ``now``; ``sleep`` notes the wait and moves ``now``."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 9))
        self.now += seconds


class TimedEnvs:
    """An ``ActorEnvs`` whose every step takes ``step_s`` on ``clock``."""

    num_envs, spec, dtype, episodic_life = 1, None, np.dtype(np.float32), False

    def __init__(self, clock: FakeClock, step_s: float) -> None:
        self.clock, self.step_s = clock, step_s
        self.obs, self.life_lost, self.finished = np.zeros((1, 4), np.float32), np.zeros(1, bool), []

    def step(self, actions: np.ndarray) -> Any:
        self.clock.now += self.step_s
        return self.obs, np.zeros(1), np.zeros(1, bool), np.zeros(1, bool), {}

    def close(self) -> None:
        pass


def test_slowdown_stretches_each_step_from_the_policy_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the rollout's own sleep did: factor F sleeps (F - 1) x the step, measured from the actor's reading the
    observation (the policy's time counts) to the envs' answer; the time between rollouts is not stretched."""
    clock = FakeClock()
    monkeypatch.setattr(V, "time", clock)
    slow = Slowdown(TimedEnvs(clock, step_s=0.010), 3.0)
    clock.now += 5.0  # built long before its first rollout (the welcome, the first version)
    for gap_s in (0.0, 1.0):  # a step, then one after sending a rollout and waiting for parameters
        clock.now += gap_s
        obs = slow.obs
        clock.now += 0.002  # the policy acts on obs
        slow.step(np.zeros(len(obs), np.int64))
    assert clock.slept == [0.024, 0.024]  # (3 - 1) x (2 ms policy + 10 ms envs), each time
    assert slow.finished is slow.envs.finished and slow.life_lost is slow.envs.life_lost


def test_env_latency_sleeps_per_env_step() -> None:
    vec = SlowEnvs(latency_ms=20.0)(CARTPOLE, [1, 2])
    assert isinstance(vec, VecEnv) and isinstance(vec.envs[0], EnvLatency)
    t0 = time.perf_counter()
    for _ in range(3):
        vec.step(vec.obs[:, 0] * 0)  # action 0 for both envs
    elapsed = time.perf_counter() - t0
    assert elapsed >= 3 * 2 * 0.020, f"3 steps of 2 envs at 20 ms took only {elapsed * 1000:.0f} ms"
    vec.close()


def test_envs_at_their_own_speed_are_left_alone() -> None:
    for factory in (SlowEnvs(), SlowEnvs(slowdown=1.0, latency_ms=0.0), SlowEnvs(slowdown=0.5), actor_envs):
        vec = factory(CARTPOLE, [1], frozenset())
        assert isinstance(vec, VecEnv) and not isinstance(vec.envs[0], EnvLatency)
        vec.close()
    both = SlowEnvs(slowdown=2.0, latency_ms=1.0)(CARTPOLE, [1])
    assert isinstance(both, Slowdown) and isinstance(both.envs, VecEnv) and isinstance(both.envs.envs[0], EnvLatency)
    both.close()


def test_slow_env_config_is_checked() -> None:
    assert TrainConfig(env_latency_ms=2.5, slowdowns=[1, 4]).slowdowns == (1.0, 4.0)
    with pytest.raises(ConfigError, match="env_latency_ms"):
        TrainConfig(env_latency_ms=-1.0)
    with pytest.raises(ConfigError, match="slowdowns"):
        TrainConfig(slowdowns=(0.5,))
