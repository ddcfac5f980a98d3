"""The actors' numpy Q and SAC policies against the learner's torch networks, Ape-X's epsilons, and a rollout."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from zddrl.actor.host import build_policy, policy_of
from zddrl.actor.rollout import collect
from zddrl.algos.apex.policy import QPolicy, actor_td, apex_epsilons
from zddrl.algos.model import flatten_params
from zddrl.algos.offpolicy_nets import DuelingQ, SquashedGaussian
from zddrl.algos.offpolicy_policy import NumpyDuelingQ, NumpyGaussian, SACPolicy
from zddrl.algos.spec import algorithm_of, declared_arrays
from zddrl.config import Config
from zddrl.envs import EnvSpec, VecEnv
from zddrl.protocol import Parameters

DISCRETE = EnvSpec((4,), True, 2)
BOX = EnvSpec((3,), False, 1, (-2.0,), (2.0,))


def model_config() -> Config:
    return Config().replace({"model.hidden": [32, 32], "model.activation": "relu"})


def test_numpy_q_values_match_the_torch_dueling_network() -> None:
    torch.manual_seed(0)
    net = DuelingQ(DISCRETE, model_config().model)
    flat, layout = flatten_params(net)
    policy = QPolicy(NumpyDuelingQ(flat, layout, "relu"), 2, np.zeros(5, np.float32), 0.99, 3)
    obs = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(policy.q(obs), net(torch.as_tensor(obs)).detach().numpy(), atol=1e-5)
    out = policy.act(obs, np.random.default_rng(0))  # eps 0: greedy
    np.testing.assert_array_equal(out.actions, policy.q(obs).argmax(axis=1))
    np.testing.assert_allclose(out.logp, 0.0, atol=1e-6)
    np.testing.assert_allclose(out.extras["q_taken"], out.values)


def test_epsilon_greedy_explores_at_each_envs_own_rate() -> None:
    torch.manual_seed(0)
    flat, layout = flatten_params(DuelingQ(DISCRETE, model_config().model))
    eps = np.array([0.0, 0.5, 1.0], np.float32)
    policy = QPolicy(NumpyDuelingQ(flat, layout, "relu"), 2, eps, 0.99, 3)
    obs = np.zeros((3, 4), np.float32)
    greedy = policy.q(obs).argmax(axis=1)
    rng = np.random.default_rng(1)
    off = np.mean([policy.act(obs, rng).actions != greedy for _ in range(4000)], axis=0)
    # a random action is the greedy one half the time with 2 actions: off-greedy rate eps / 2
    np.testing.assert_allclose(off, eps / 2, atol=0.03)


def test_apex_epsilons_follow_the_paper() -> None:
    eps = apex_epsilons(0.4, 7.0, 0, 8, 8)
    assert eps[0] == pytest.approx(0.4) and eps[-1] == pytest.approx(0.4**8)
    np.testing.assert_allclose(apex_epsilons(0.4, 7.0, 4, 4, 8), eps[4:])
    assert apex_epsilons(0.4, 7.0, 0, 1, 1)[0] == pytest.approx(0.4)
    np.testing.assert_allclose(apex_epsilons(0.4, 7.0, 8, 8, 8), eps)  # past the planned fleet: the schedule again


def test_numpy_sac_policy_matches_the_torch_squashed_gaussian() -> None:
    torch.manual_seed(0)
    net = SquashedGaussian(BOX, model_config().model)
    flat, layout = flatten_params(net)
    policy = SACPolicy(NumpyGaussian(flat, layout, "relu"), 1, BOX.action_low, BOX.action_high)
    obs = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    greedy = policy.act(obs, np.random.default_rng(0), deterministic=True).actions
    np.testing.assert_allclose(greedy, 2.0 * net.greedy(torch.as_tensor(obs)).detach().numpy(), atol=1e-5)
    out = policy.act(obs, np.random.default_rng(3))
    assert np.all(np.abs(out.actions) <= 2.0)
    mu, log_std = (t.detach().numpy() for t in net(torch.as_tensor(obs)))
    u = np.arctanh(np.clip(out.actions / 2.0, -1 + 1e-7, 1 - 1e-7))
    base = (-0.5 * ((u - mu) / np.exp(log_std)) ** 2 - log_std - 0.5 * np.log(2 * np.pi)).sum(axis=1)
    np.testing.assert_allclose(out.logp, base - np.log1p(-((out.actions / 2) ** 2) + 1e-6).sum(axis=1), atol=2e-3)


def params_of(net: torch.nn.Module) -> Parameters:
    flat, layout = flatten_params(net)
    return Parameters(
        run_id="r", peer_id="l", policy_version=1, param_hash="0" * 16, layout=layout, arrays={"flat": flat}
    )


def test_an_apex_rollout_carries_the_actors_td() -> None:
    cfg = model_config().replace({"algo.name": "apex", "train.actors": 2, "env.num_envs": 2, "replay.n_step": 3})
    vec = VecEnv(lambda: gym.make("CartPole-v1"), [1, 2])
    torch.manual_seed(0)
    policy, why = policy_of(params_of(DuelingQ(vec.spec, cfg.model)), cfg, vec, 1 << 20, actor_id=1)
    assert why == "" and isinstance(policy, QPolicy)
    np.testing.assert_allclose(policy.eps, apex_epsilons(0.4, 7.0, 2, 2, 4))
    rollout = collect(vec, policy, np.random.default_rng(0), 40, declared_arrays(algorithm_of(cfg), cfg, vec.spec))
    a = rollout.arrays
    assert "q_taken" not in a  # declared, kept on the actor
    q_taken = policy.q(a["obs"].reshape(-1, 4))[np.arange(80), a["actions"].reshape(-1)].reshape(40, 2)
    np.testing.assert_allclose(a["actor_td"], actor_td(a, q_taken, 0.99, 3), atol=1e-5)
    vec.close()


def test_a_version_whose_layout_is_not_the_modes_network_is_refused() -> None:
    cfg = model_config().replace({"algo.name": "sac"})
    vec = VecEnv(lambda: gym.make("Pendulum-v1"), [1])
    torch.manual_seed(0)
    policy, why = policy_of(params_of(DuelingQ(DISCRETE, cfg.model)), cfg, vec, 1 << 20)
    assert policy is None and "does not build" in why
    params = params_of(SquashedGaussian(vec.spec, cfg.model))
    assert isinstance(build_policy(params.arrays["flat"], params.layout, {}, cfg, vec.spec), SACPolicy)
    vec.close()
