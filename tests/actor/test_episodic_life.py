"""`env.episodic_life`: a lost life is a terminal for the learner's returns and FIRE follows it, while episodes,
their returns and their lengths run to game over (LifeLoss, the `life_lost` array, algos.rollout.terminal)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from samples import cartpole_trajectory
from zddrl import protocol as P
from zddrl.actor.host import action_rng, encode_rollout
from zddrl.actor.rollout import collect
from zddrl.algos.checks import spec_refusal
from zddrl.algos.impala.learner import stack_time_major
from zddrl.algos.ppo.learner import PPOLearner
from zddrl.config import Config, ConfigError, EnvConfig
from zddrl.envs import EnvSpec, LifeLoss, VecEnv, make_factory

LIFE_STEPS = 3
"""The fake game takes a life every LIFE_STEPS steps (FIRE presses do not count); 3 lives, so game over at 9."""


class LivesEnv(gym.Env):
    """A game of 3 lives with ALE's ``info["lives"]``; reward 1 per step; counts the FIRE (action 1) presses."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(3)

    def __init__(self) -> None:
        self.fires = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.lives = 0, 3
        return np.zeros(2, np.float32), {"lives": self.lives}

    def step(self, action):
        if action == 1:
            self.fires += 1
            return np.zeros(2, np.float32), 0.5, False, False, {"lives": self.lives}
        self.t += 1
        if self.t % LIFE_STEPS == 0:
            self.lives -= 1
        return np.full(2, self.t, np.float32), 1.0, self.lives == 0, False, {"lives": self.lives}


class Walk:
    """A policy that never presses FIRE itself (action 0), with the fields collect() reads."""

    def act(self, obs, rng):
        n = len(obs)

        class Out:
            actions = np.zeros(n, np.int64)
            logp = np.zeros(n, np.float32)
            values = np.zeros(n, np.float32)
            extras = None

        return Out()

    def value(self, obs):
        return np.zeros(len(obs), np.float32)


def test_a_lost_life_is_marked_and_followed_by_fire_while_the_game_goes_on() -> None:
    env = LifeLoss(LivesEnv(), fire=True)
    env.reset(seed=1)
    steps = [env.step(0) for _ in range(9)]
    lost = [bool(info.get("life_lost")) for *_, info in steps]
    assert lost == [False, False, True, False, False, True, False, False, False], "the 3rd life ends the game"
    assert [s[2] for s in steps] == [False] * 8 + [True]
    assert env.unwrapped.fires == 2, "FIRE after each life lost, not after game over"
    assert steps[2][1] == 1.5, "the FIRE step's reward is added to the step that lost the life"
    no_fire = LifeLoss(LivesEnv(), fire=False)
    no_fire.reset(seed=1)
    [no_fire.step(0) for _ in range(9)]
    assert no_fire.unwrapped.fires == 0


def test_rollouts_carry_life_lost_and_metrics_count_whole_games() -> None:
    vec = VecEnv(lambda: LifeLoss(LivesEnv(), fire=True), [1, 2], episodic_life=True)
    rollout = collect(vec, Walk(), action_rng(1, 0), T=12)
    lost, terminated = rollout.arrays["life_lost"], rollout.arrays["terminated"]
    assert lost.dtype == bool and lost.shape == (12, 2)
    assert lost[:, 0].nonzero()[0].tolist() == [2, 5, 11], "lives lost at steps 3 and 6 of each 9-step game"
    assert terminated[:, 0].nonzero()[0].tolist() == [8]
    assert not (lost & terminated).any()
    assert rollout.ep_lengths == [9, 9] and rollout.ep_returns == [10.0, 10.0], "whole games: 9 steps + 2 FIREs"
    decoded = P.decode(encode_rollout(P.Trajectory("r", "a", 0, 0, "0" * 16, 24, rollout.arrays)))
    assert np.array_equal(decoded.arrays["life_lost"], lost)
    plain = collect(VecEnv(lambda: LifeLoss(LivesEnv(), fire=True), [1]), Walk(), action_rng(1, 0), T=4)
    assert "life_lost" not in plain.arrays, "only a run with env.episodic_life sends it"


def test_the_wire_refuses_a_life_lost_of_another_dtype_or_shape() -> None:
    base = cartpole_trajectory(4, 2)
    for bad in (np.zeros((4, 2), np.float32), np.zeros((4, 3), bool)):
        msg = P.Trajectory(**{**base.__dict__, "arrays": {**base.arrays, "life_lost": bad}})
        with pytest.raises(P.ProtocolError, match="'life_lost' must be bool"):
            P.decode(P.encode(msg))


def test_the_returns_stop_at_a_lost_life_as_at_a_termination() -> None:
    core = PPOLearner(Config().replace({"algo.gamma": 0.5, "algo.gae_lambda": 1.0}), EnvSpec((4,), True, 2))
    traj = cartpole_trajectory(4, 2)
    lost = np.zeros((4, 2), bool)
    lost[1, 1] = True
    with_life = P.Trajectory(**{**traj.__dict__, "arrays": {**traj.arrays, "life_lost": lost}})
    terminated = P.Trajectory(
        **{**traj.__dict__, "arrays": {**traj.arrays, "terminated": traj.arrays["terminated"] | lost}}
    )
    a, b = core.make_batch([with_life]), core.make_batch([terminated])
    assert np.allclose(a.returns.numpy(), b.returns.numpy()) and np.allclose(a.advantages, b.advantages)
    assert not np.allclose(a.returns.numpy(), core.make_batch([traj]).returns.numpy())
    tm = stack_time_major([with_life, traj], [with_life.arrays["rewards"], traj.arrays["rewards"]])
    assert tm.terminated[1, 1] and not tm.terminated[1, 3], "IMPALA's time-major batch: the same terminal"


def test_episodic_life_needs_atari_and_an_on_policy_mode() -> None:
    with pytest.raises(ConfigError, match="episodic_life needs env.atari"):
        EnvConfig(id="CartPole-v1", episodic_life=True)
    config = Config().replace(
        {
            "env.id": "ALE/Breakout-v5",
            "env.atari": True,
            "env.episodic_life": True,
            "algo.name": "apex",
            "algo.schedule": "async",
        }
    )
    assert "episodic_life" in spec_refusal(config, EnvSpec((4,), True, 2))


@pytest.mark.slow
def test_breakout_reports_its_lost_lives() -> None:
    pytest.importorskip("ale_py")
    vec = VecEnv(make_factory(EnvConfig(id="ALE/Breakout-v5", atari=True, episodic_life=True)), [1], True)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        vec.step(rng.integers(0, 4, 1))
        if vec.life_lost[0]:
            break
    assert vec.life_lost[0], "a random Breakout player loses a life within 2,000 steps"
    assert not vec.finished, "and the game goes on"


def test_a_learner_refuses_life_lost_that_does_not_match_its_run() -> None:
    traj = cartpole_trajectory(4, 2)
    with_life = {**traj.arrays, "life_lost": np.zeros((4, 2), bool)}
    plain = PPOLearner(Config(), EnvSpec((4,), True, 2))
    assert plain.refusal(traj.arrays) == "" and "without env.episodic_life" in plain.refusal(with_life)
    episodic = Config().replace({"env.id": "ALE/Breakout-v5", "env.atari": True, "env.episodic_life": True})
    core = PPOLearner(episodic, EnvSpec((4,), True, 2))
    assert core.refusal(with_life) == "" and "missing in a run with" in core.refusal(traj.arrays)
