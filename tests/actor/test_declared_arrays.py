"""An algorithm's declared arrays on the actor (zddrl/actor/rollout.py): per-step rows from ``ActOutput.extras``,
per-rollout rows from ``begin_rollout``, any of them from ``finish_rollout``; the ones declared ``sent=False`` stay
on the actor; a policy that breaks its declaration fails on the actor, before anything is sent; what is sent passes
the run's declaration as every broker checks it (docs/protocol.md section 7.1)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from zddrl import protocol as P
from zddrl.actor.rollout import collect
from zddrl.algos.policy import ActOutput
from zddrl.algos.spec import DeclaredArray
from zddrl.envs import VecEnv

DECLARED = (
    DeclaredArray("step_id", "int64"),  # per step, from extras
    DeclaredArray("obs_sum", "float32", (2,)),  # per step, [N, 2] rows
    DeclaredArray("start", "float32", (3,), per="rollout"),  # per rollout, from begin_rollout
    DeclaredArray("scratch", "float32", sent=False),  # per step, kept on the actor
    DeclaredArray("scratch_total", "float32", per="rollout"),  # made of scratch by finish_rollout
)


class Recording:
    """A policy that records what its algorithm declares, and counts its steps."""

    def __init__(self, extras: bool = True) -> None:
        self.t, self.rollouts, self.extras = 0, 0, extras

    def begin_rollout(self) -> dict[str, np.ndarray]:
        self.rollouts += 1
        return {"start": np.full((3, 3), self.rollouts, np.float32)}

    def act(self, obs: np.ndarray, rng: np.random.Generator, deterministic: bool = False) -> ActOutput:
        n = len(obs)
        self.t += 1
        extras = {
            "step_id": np.full(n, self.t, np.int64),
            "obs_sum": np.stack([obs.sum(axis=1)] * 2, axis=1).astype(np.float32),
            "scratch": np.ones(n, np.float32),
        }
        zeros = np.zeros(n, np.float32)
        return ActOutput(np.zeros(n, np.int64), zeros, zeros, extras if self.extras else None)

    def value(self, obs: np.ndarray) -> np.ndarray:
        return np.zeros(len(obs), np.float32)

    def finish_rollout(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"scratch_total": arrays["scratch"].sum(axis=0)}


@pytest.fixture
def vec():
    v = VecEnv(lambda: gym.make("CartPole-v1"), [1, 2, 3])
    yield v
    v.close()


def test_declared_arrays_are_recorded_sent_or_kept_as_declared(vec: VecEnv) -> None:
    policy = Recording()
    a = collect(vec, policy, np.random.default_rng(0), 5, DECLARED).arrays
    assert "scratch" not in a, "sent=False stays on the actor"
    np.testing.assert_array_equal(a["step_id"], np.repeat(np.arange(1, 6), 3).reshape(5, 3))
    np.testing.assert_allclose(a["obs_sum"][..., 0], a["obs"].sum(axis=2))
    np.testing.assert_array_equal(a["start"], np.ones((3, 3), np.float32))
    np.testing.assert_array_equal(a["scratch_total"], np.full(3, 5, np.float32))
    again = collect(vec, policy, np.random.default_rng(0), 5, DECLARED).arrays
    assert again["start"][0, 0] == 2 and again["step_id"][0, 0] == 6  # each rollout begins afresh
    msg = P.Trajectory(run_id="r", peer_id="a", seq=0, policy_version=0, param_hash="", env_steps=15, arrays=a)
    specs = P.validate_trajectory(P.encode(msg), 1 << 20)["arrays"]
    declared = P.declaration_of([d.to_wire() for d in DECLARED if d.sent])
    assert declared.refusal(specs) == "" and "neither" in P.DeclaredLayout().refusal(specs)


def test_a_policy_that_breaks_its_declaration_fails_on_the_actor(vec: VecEnv) -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="declared array 'step_id' as nothing, not int64 \\[4, 3\\]"):
        collect(vec, Recording(extras=False), rng, 4, DECLARED)
    with pytest.raises(ValueError, match="policy output 'step_id' is not a per-step array its algorithm declares"):
        collect(vec, Recording(), rng, 4, DECLARED[2:])
    bad = Recording()
    bad.finish_rollout = lambda arrays: {"scratch_total": arrays["scratch"].sum(axis=1)}  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="declared array 'scratch_total' as float32 \\[4\\], not float32 \\[3\\]"):
        collect(vec, bad, rng, 4, DECLARED)
