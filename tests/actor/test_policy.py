"""The numpy actor policy must compute exactly what the torch learner model computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zddrl.algos.model import ActorCritic, flatten_params, load_flat, unflatten
from zddrl.algos.policy import NumpyPolicy
from zddrl.config import ModelConfig
from zddrl.envs import EnvSpec


@pytest.mark.parametrize("discrete", [True, False])
@pytest.mark.parametrize("activation", ["tanh", "relu", "silu", "gelu", "elu", "leaky_relu"])
def test_numpy_policy_matches_torch_model(discrete: bool, activation: str) -> None:
    torch.manual_seed(0)
    spec = EnvSpec(obs_shape=(5,), discrete=discrete, action_dim=3, action_low=(-1.0,) * 3, action_high=(1.0,) * 3)
    model = ActorCritic(spec, ModelConfig(hidden=(16, 8), activation=activation, log_std_init=-0.5))
    flat, layout = flatten_params(model)
    policy = NumpyPolicy(flat, layout, activation, discrete)
    obs = np.random.default_rng(0).standard_normal((7, 5)).astype(np.float32)
    out = policy.act(obs, np.random.default_rng(1))
    with torch.no_grad():
        logp, _, value = model.evaluate(torch.from_numpy(obs), torch.from_numpy(out.actions))
    np.testing.assert_allclose(out.logp, logp.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.values, value.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(policy.value(obs), value.numpy(), rtol=1e-5, atol=1e-5)


def test_discrete_sampling_follows_the_policy_distribution() -> None:
    torch.manual_seed(0)
    spec = EnvSpec(obs_shape=(2,), discrete=True, action_dim=3)
    model = ActorCritic(spec, ModelConfig(hidden=(4,)))
    with torch.no_grad():  # a fixed, known distribution: logits (0, ln 2, ln 3) -> probs 1/6, 2/6, 3/6
        model.pi[-1].weight.zero_()
        model.pi[-1].bias.copy_(torch.log(torch.tensor([1.0, 2.0, 3.0])))
    flat, layout = flatten_params(model)
    policy = NumpyPolicy(flat, layout, "tanh", True)
    out = policy.act(np.zeros((60_000, 2), dtype=np.float32), np.random.default_rng(0))
    freq = np.bincount(out.actions, minlength=3) / len(out.actions)
    np.testing.assert_allclose(freq, [1 / 6, 2 / 6, 3 / 6], atol=0.01)
    np.testing.assert_allclose(np.exp(out.logp[:3]), [[1 / 6, 2 / 6, 3 / 6][a] for a in out.actions[:3]], rtol=1e-5)


def test_observation_normalisation_is_applied_with_the_shipped_statistics() -> None:
    spec = EnvSpec(obs_shape=(2,), discrete=True, action_dim=2)
    model = ActorCritic(spec, ModelConfig(hidden=(4,)))
    flat, layout = flatten_params(model)
    mean, var = np.array([1.0, -2.0], dtype=np.float32), np.array([4.0, 0.25], dtype=np.float32)
    policy = NumpyPolicy(flat, layout, "tanh", True, mean, var)
    obs = np.array([[3.0, -1.0], [1.0, 100.0]], dtype=np.float32)
    np.testing.assert_allclose(policy.prepare(obs), [[1.0, 2.0], [0.0, 10.0]], atol=1e-4)  # clipped at 10


def test_flat_buffer_round_trip_and_bad_layout() -> None:
    spec = EnvSpec(obs_shape=(3,), discrete=False, action_dim=2, action_low=(-1, -1), action_high=(1, 1))
    a, b = ActorCritic(spec, ModelConfig()), ActorCritic(spec, ModelConfig())
    flat, layout = flatten_params(a)
    load_flat(b, flat, layout)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    with pytest.raises(ValueError, match="does not fit"):
        unflatten(flat[:-1], layout)


@pytest.mark.parametrize("activation", ["tanh", "relu", "silu", "gelu", "elu", "leaky_relu"])
def test_each_numpy_activation_is_torchs(activation: str) -> None:
    """zddrl.algos.policy's numpy activations against zddrl.algos.model's torch modules, far into both tails."""
    from zddrl.algos.model import ACTIVATIONS as TORCH
    from zddrl.algos.policy import ACTIVATIONS as NUMPY

    x = np.concatenate([np.linspace(-60, 60, 2001), np.random.default_rng(0).standard_normal(1000) * 3])
    x = x.astype(np.float32)
    with np.errstate(over="raise", invalid="raise"):  # no overflow on the way either
        got = NUMPY[activation](x)
    want = TORCH[activation]()(torch.from_numpy(x)).numpy()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
