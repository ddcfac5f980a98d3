"""Actor-side sampling: seed streams, reproducibility, trajectory arrays, env errors."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from zddrl import protocol as P
from zddrl.actor.host import action_rng, encode_rollout, env_seeds
from zddrl.actor.rollout import collect
from zddrl.algos.model import ActorCritic, flatten_params
from zddrl.algos.policy import NumpyPolicy
from zddrl.config import ModelConfig
from zddrl.envs import EnvError, VecEnv, env_factory, probe_spec


def _policy(env_id: str = "CartPole-v1") -> NumpyPolicy:
    spec = probe_spec(env_id)
    torch.manual_seed(0)  # same weights for every rollout of a test
    flat, layout = flatten_params(ActorCritic(spec, ModelConfig()))
    return NumpyPolicy(flat, layout, "tanh", spec.discrete)


def _rollout(seed: int, actor_id: int, T: int = 64, env_id: str = "CartPole-v1", max_steps: int = 0):
    vec = VecEnv(env_factory(env_id, max_steps), env_seeds(seed, actor_id, 3))
    return collect(vec, _policy(env_id), action_rng(seed, actor_id), T)


def test_seed_streams_follow_the_documented_formula() -> None:
    assert env_seeds(7, 2, 3) == [2007, 2008, 2009]


def test_same_seed_same_actor_reproduces_exactly() -> None:
    a, b = _rollout(1, 0), _rollout(1, 0)
    assert a.arrays.keys() == b.arrays.keys() and (a.ep_returns, a.ep_lengths) == (b.ep_returns, b.ep_lengths)
    for key in a.arrays:
        np.testing.assert_array_equal(a.arrays[key], b.arrays[key], err_msg=key)


def test_distinct_actors_and_envs_get_distinct_initial_states() -> None:
    a, b = _rollout(1, 0, T=1).arrays, _rollout(1, 1, T=1).arrays
    firsts = np.concatenate([a["obs"][0], b["obs"][0]])
    assert len({tuple(row) for row in firsts.round(6)}) == 6
    # each is the initial state of its own documented seed stream: env i of actor k reset with seed 1 + k * 1000 + i
    for actor_id, arrays in ((0, a), (1, b)):
        for i, seed in enumerate(env_seeds(1, actor_id, 3)):
            env = gym.make("CartPole-v1")
            np.testing.assert_array_equal(arrays["obs"][0][i], env.reset(seed=seed)[0].astype(np.float32))
            env.close()


def test_trajectory_arrays_are_time_major_and_truncation_is_recorded() -> None:
    T, N = 30, 3
    rollout = _rollout(3, 0, T=T, max_steps=10)  # every episode is truncated after 10 steps (or ends earlier)
    out = rollout.arrays
    assert out["obs"].shape == (T, N, 4) and out["actions"].shape == (T, N) and out["rewards"].shape == (T, N)
    assert out["next_obs"].shape == (N, 4) and out["next_value"].shape == (N,)
    trunc = out["truncated"] & ~out["terminated"]
    assert trunc.sum() == len(out["trunc_idx"]) == len(out["trunc_obs"]) == len(out["trunc_value"]) > 0
    flat = np.flatnonzero(trunc.reshape(-1))
    np.testing.assert_array_equal(np.sort(out["trunc_idx"]), flat)
    assert len(rollout.ep_returns) == len(rollout.ep_lengths) == (out["terminated"] | out["truncated"]).sum()
    assert all(1 <= n <= 10 for n in rollout.ep_lengths)
    msg = P.Trajectory(
        run_id="r",
        peer_id="a",
        seq=0,
        policy_version=0,
        param_hash="",
        env_steps=T * N,
        arrays=out,
        ep_returns=rollout.ep_returns,
        ep_lengths=rollout.ep_lengths,
    )
    P.decode(P.encode(msg))  # follows the protocol's trajectory rules


def test_an_actor_refuses_to_send_what_the_broker_would_drop() -> None:
    rollout = _rollout(1, 0, T=4)
    msg = P.Trajectory(
        run_id="r",
        peer_id="a",
        seq=0,
        policy_version=0,
        param_hash="",
        env_steps=12,
        arrays=rollout.arrays,
        ep_returns=rollout.ep_returns,
        ep_lengths=rollout.ep_lengths,
    )
    assert P.decode(encode_rollout(msg)).env_steps == 12
    with pytest.raises(ValueError, match="exceeds the broker's max_message_bytes 100"):
        encode_rollout(msg, limit=100)
    broken = P.Trajectory(**{**vars(msg), "arrays": {**msg.arrays, "values": msg.arrays["values"][:, :1]}})
    with pytest.raises(P.ProtocolError, match="'values' must be float32 \\[4, 3\\]"):
        encode_rollout(broken)
    with pytest.raises(P.ProtocolError, match="env_steps 11 must be T \\* N = 12"):
        encode_rollout(P.Trajectory(**{**vars(msg), "env_steps": 11}))


def test_truncation_arrays_travel_only_when_an_episode_was_truncated() -> None:
    rollout = _rollout(3, 0, T=5)  # CartPole's limit is 500 steps: nothing is truncated in 5
    assert not set(P.TRUNCATION_ARRAYS) & rollout.arrays.keys()
    assert set(P.TRAJECTORY_ARRAYS) == rollout.arrays.keys()


def test_continuous_actions_have_the_action_shape() -> None:
    out = _rollout(1, 0, T=5, env_id="Pendulum-v1").arrays
    assert out["actions"].shape == (5, 3, 1) and out["actions"].dtype == np.float32


def test_unknown_env_and_unsupported_spaces_are_clear_errors() -> None:
    with pytest.raises(EnvError, match="unknown gymnasium env id"):
        env_factory("NoSuchEnv-v9")
    with pytest.raises(EnvError, match="cannot be imported"):
        env_factory("no_such_module:make")
    with pytest.raises(EnvError, match="not supported"):
        probe_spec("tests.actor.test_actor:dict_obs_env")


def dict_obs_env() -> gym.Env:
    class DictObs(gym.Env):
        observation_space = gym.spaces.Dict({"x": gym.spaces.Discrete(2)})
        action_space = gym.spaces.Discrete(2)

    return DictObs()


@pytest.mark.slow
def test_actor_and_broker_processes_do_not_import_torch() -> None:
    """Actor hosts and the broker start in a fraction of a second and stay small without torch."""
    import subprocess
    import sys

    code = (
        "import sys, zddrl.actor.host, zddrl.broker.broker, zddrl.cli, zddrl.ops.status, zddrl.ops.train, "
        "zddrl.learner.runlog; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_a_non_finite_episode_return_is_left_out_and_the_rollout_still_encodes() -> None:
    """An env's NaN reward must not kill the actor with a malformed message (the protocol wants finite
    episode figures): the episode is counted and left out of the header, the rewards frame keeps the NaN,
    and the learner's check drops the rollout as invalid."""
    from zddrl.algos.rollout import mismatch

    def make() -> gym.Env:
        env = gym.make("CartPole-v1", max_episode_steps=5)
        return gym.wrappers.TransformReward(env, lambda r: float("nan"))

    vec = VecEnv(make, env_seeds(0, 0, 2))
    rollout = collect(vec, _policy(), action_rng(0, 0), 12)
    assert rollout.nonfinite_episodes >= 4 and rollout.ep_returns == [] and rollout.ep_lengths == []
    msg = P.Trajectory(
        run_id="r",
        peer_id="a",
        seq=0,
        policy_version=0,
        param_hash="",
        env_steps=24,
        arrays=rollout.arrays,
        ep_returns=rollout.ep_returns,
        ep_lengths=rollout.ep_lengths,
    )
    frames = encode_rollout(msg)  # valid on the wire: the broker forwards it and returns the credit
    decoded = P.decode(frames)
    assert np.isnan(decoded.arrays["rewards"]).all()
    assert "non-finite" in mismatch(decoded.arrays, probe_spec("CartPole-v1"))
