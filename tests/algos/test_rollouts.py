"""What a learner checks of a decoded trajectory before training on it (zddrl.algos.rollout), and the
optimizer step a poisoned batch can no longer take (LearnerCore.step_optimizer)."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from loguru import logger

from samples import traj, traj_arrays
from zddrl import protocol as P
from zddrl.algos.ppo.learner import PPOLearner
from zddrl.algos.rollout import mismatch, truncations
from zddrl.config import Config
from zddrl.envs import EnvSpec, env_spec, probe_spec

CARTPOLE = EnvSpec((3,), True, 2)  # traj_arrays' observations have 3 numbers, its actions are 0/1
BOX = EnvSpec((3,), False, 2, action_low=(-1.0, -1.0), action_high=(1.0, 1.0))


def with_(K: int = 0, discrete: bool = True, **changes: np.ndarray) -> dict:
    arrays = traj_arrays(K=K, discrete=discrete)
    arrays["logp"] = -np.abs(arrays["logp"])  # a categorical log-probability is <= 0
    if K:
        arrays["truncated"].reshape(-1)[arrays["trunc_idx"]] = True
        arrays["terminated"].reshape(-1)[arrays["trunc_idx"]] = False
    return {**arrays, **changes}


def test_valid_trajectories_fit() -> None:
    assert mismatch(with_(), CARTPOLE) == "" == mismatch(with_(K=2), CARTPOLE)
    assert mismatch(with_(discrete=False), BOX) == ""
    assert mismatch(with_(), CARTPOLE, rollout_len=2) == ""
    decoded = P.decode(P.encode(traj(arrays=with_(K=1)))).arrays  # read-only views off the wire work too
    assert mismatch(decoded, CARTPOLE) == ""


F32 = np.float32


@pytest.mark.parametrize(
    "arrays,spec,why",
    [
        (with_(obs=np.zeros((2, 2, 4), F32), next_obs=np.zeros((2, 4), F32)), CARTPOLE, "observations of shape [4]"),
        (with_(discrete=False), CARTPOLE, "continuous actions [2, 2, 2] for a discrete action space"),
        (with_(actions=np.array([[0, 1], [2, 0]])), CARTPOLE, "actions outside 0..1"),
        (with_(actions=np.array([[0, -1], [1, 0]])), CARTPOLE, "actions outside 0..1"),
        (with_(logp=np.full((2, 2), 0.5, F32)), CARTPOLE, "positive log-probabilities"),
        (with_(), BOX, "actions of shape [2, 2], the run's env needs [T, N, 2]"),
        (with_(discrete=False, actions=np.zeros((2, 2, 3), F32)), BOX, "needs [T, N, 2]"),
        (with_(rewards=np.array([[1, np.nan], [1, 1]], F32)), CARTPOLE, "non-finite values in 'rewards'"),
        (with_(obs=np.full((2, 2, 3), np.inf, F32)), CARTPOLE, "non-finite values in 'obs'"),
        (with_(discrete=False, actions=np.full((2, 2, 2), np.nan, F32)), BOX, "non-finite values in 'actions'"),
        (with_(K=1, trunc_value=np.array([np.nan], F32)), CARTPOLE, "non-finite values in 'trunc_value'"),
        (with_(K=1, trunc_idx=np.array([4])), CARTPOLE, "truncation indices outside 0..3"),
        (with_(K=1, trunc_idx=np.array([-1])), CARTPOLE, "truncation indices outside 0..3"),
        (with_(K=2, trunc_idx=np.array([1, 1])), CARTPOLE, "or repeated"),
        (with_(K=1, truncated=np.zeros((2, 2), bool)), CARTPOLE, "of steps that were not truncated"),
    ],
)
def test_what_a_run_cannot_train_on_is_named(arrays: dict, spec: EnvSpec, why: str) -> None:
    assert why in mismatch(arrays, spec)


RANGED = EnvSpec((3,), True, 2, reward_low=-1.0, reward_high=1.0)  # an env that declares rewards in [-1, 1]


def test_rewards_outside_the_envs_declared_range_are_refused() -> None:
    """Issue 28: the learner never bounded rewards by the env's own range, so one actor's 1e4-reward steps counted."""
    assert mismatch(with_(), RANGED) == "" == mismatch(with_(rewards=np.array([[-1, 1], [0, 0.5]], F32)), RANGED)
    assert "declared reward range [-1, 1] (1 .. 10000)" in mismatch(
        with_(rewards=np.array([[1, 1e4], [1, 1]], F32)), RANGED
    )
    assert "declared reward range" in mismatch(with_(rewards=np.array([[-1.01, 0], [0, 0]], F32)), RANGED)
    assert mismatch(with_(rewards=np.array([[1e4, 1], [1, 1]], F32)), CARTPOLE) == ""  # none declared: +-1e9 only
    assert "non-finite values in 'rewards'" in mismatch(with_(rewards=np.array([[np.nan, 0], [0, 0]], F32)), RANGED)
    one_sided = EnvSpec((3,), True, 2, reward_high=0.0)  # a cost env: rewards <= 0, no lower bound
    assert mismatch(with_(rewards=np.full((2, 2), -1e6, F32)), one_sided) == ""
    assert "declared reward range [-inf, 0]" in mismatch(with_(), one_sided)
    tenth = EnvSpec((3,), True, 2, reward_low=0.0, reward_high=0.1)  # float32(0.1) is a hair above 0.1: allowed
    assert mismatch(with_(rewards=np.full((2, 2), 0.1, F32)), tenth) == ""


class _Declares(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, reward_range: object = None) -> None:
        if reward_range is not None:
            self.reward_range = reward_range


@pytest.mark.parametrize(
    "declared,expected",
    [
        ((-1, 1), (-1.0, 1.0)),
        ((-math.inf, 0.0), (-math.inf, 0.0)),
        (None, (-math.inf, math.inf)),  # gymnasium 1.x envs declare none
        ((-math.inf, math.inf), (-math.inf, math.inf)),  # gymnasium 0.x's default: none either
        ((1, -1), (-math.inf, math.inf)),  # not a range
        ("bad", (-math.inf, math.inf)),
    ],
)
def test_the_spec_reads_the_reward_range_the_env_declares(declared: object, expected: tuple) -> None:
    spec = env_spec(gym.wrappers.TimeLimit(_Declares(declared), 10))  # read through the wrappers
    assert (spec.reward_low, spec.reward_high) == expected
    assert (probe_spec("CartPole-v1").reward_low, probe_spec("CartPole-v1").reward_high) == (-math.inf, math.inf)


def test_impala_needs_the_runs_rollout_length() -> None:
    assert mismatch(with_(), CARTPOLE, rollout_len=3) == "a rollout of 2 steps, the run's rollouts have 3"


def test_truncations_are_empty_when_the_trajectory_carries_none() -> None:
    idx, obs, value = truncations(with_())
    assert idx.dtype == np.int64 and idx.shape == (0,) and obs.shape == (0, 3) and value.shape == (0,)
    arrays = with_(K=2)
    idx, obs, value = truncations(arrays)
    assert idx is arrays["trunc_idx"] and obs is arrays["trunc_obs"] and value is arrays["trunc_value"]


def test_a_step_with_a_non_finite_gradient_is_skipped_counted_and_logged_once_per_interval() -> None:
    """Whatever makes a gradient non-finite (here a weight poisoned to NaN), the step is skipped and counted, the
    weights stay as they were, and the warning is one line per interval with a count, not one per step."""
    config = Config().replace({"algo.name": "ppo", "algo.schedule": "sync", "algo.epochs": 4, "algo.minibatches": 2})
    core = PPOLearner(config, EnvSpec((3,), True, 2))
    with torch.no_grad():
        next(core.model.parameters())[0, 0] = float("nan")
    before = [p.detach().clone() for p in core.model.parameters()]
    lines: list[str] = []
    sink = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        core.update([traj(arrays=with_())])
    finally:
        logger.remove(sink)
    assert core.skipped_steps == 8 and core.optimizer.steps == 0
    assert len([line for line in lines if "skipped an optimizer step" in line]) == 1, lines
    for old, new in zip(before, core.model.parameters()):
        torch.testing.assert_close(old, new, equal_nan=True)  # no step was taken
    fresh = PPOLearner(config, EnvSpec((3,), True, 2))
    fresh.load_state(core.state())  # the count survives a checkpoint (metrics.csv: skipped_steps)
    assert fresh.skipped_steps == core.skipped_steps
