"""uint8 pixels end to end: the env's dtype in the spec, the actor's buffer and the wire; the CNNs scale them
inside the network; the torch actor policy matches the learner's network."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from zddrl import protocol as P
from zddrl.actor.host import action_rng, encode_rollout
from zddrl.actor.rollout import collect
from zddrl.algos.actor_critic import actor_critic_network, actor_critic_policy
from zddrl.algos.model import ActorCritic, flatten_params
from zddrl.algos.policy import NumpyPolicy
from zddrl.algos.ppo.learner import PPOLearner
from zddrl.algos.rollout import mismatch
from zddrl.algos.torch_policy import TorchPolicy
from zddrl.config import Config, ConfigError, ModelConfig
from zddrl.envs import EnvSpec, VecEnv, env_factory

PIXELS = (2, 12, 12)


class PixelEnv(gym.Env):
    """Random uint8 frames, 3 actions, episodes of 5 steps (truncated) with reward 1 per step."""

    observation_space = gym.spaces.Box(0, 255, PIXELS, np.uint8)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.integers(0, 256, PIXELS, dtype=np.uint8), {}

    def step(self, action):
        self.t += 1
        return self.np_random.integers(0, 256, PIXELS, dtype=np.uint8), 1.0, False, self.t >= 5, {}


def pixel_env() -> gym.Env:
    return PixelEnv()


ENV_ID = "tests.actor.test_pixels:pixel_env"
IMPALA = ModelConfig(kind="impala_cnn", hidden=(32,))


def _vec(n: int = 2) -> VecEnv:
    return VecEnv(env_factory(ENV_ID), [1 + i for i in range(n)])


def test_the_spec_and_the_actors_buffers_keep_uint8() -> None:
    vec = _vec()
    assert vec.spec.obs_dtype == "uint8" and vec.obs.dtype == np.uint8
    flat, layout = flatten_params(ActorCritic(vec.spec, IMPALA))
    rollout = collect(
        vec, TorchPolicy(actor_critic_network(vec.spec, IMPALA), flat, layout, vec.spec), action_rng(1, 0), T=7
    )
    for name in ("obs", "next_obs", "trunc_obs"):
        assert rollout.arrays[name].dtype == np.uint8, name
    decoded = P.decode(encode_rollout(_trajectory(rollout.arrays)))
    assert decoded.arrays["obs"].dtype == np.uint8 and decoded.arrays["trunc_obs"].dtype == np.uint8
    assert mismatch(decoded.arrays, vec.spec) == ""
    assert "dtype float32" in mismatch({**decoded.arrays, "obs": decoded.arrays["obs"].astype(np.float32)}, vec.spec)


def _trajectory(arrays: dict) -> P.Trajectory:
    T, N = arrays["rewards"].shape
    return P.Trajectory(
        run_id="r", peer_id="a", seq=0, policy_version=0, param_hash="0" * 16, env_steps=T * N, arrays=arrays
    )


def test_the_wire_refuses_observation_arrays_of_mixed_dtypes() -> None:
    vec = _vec()
    flat, layout = flatten_params(ActorCritic(vec.spec, IMPALA))
    arrays = collect(
        vec, TorchPolicy(actor_critic_network(vec.spec, IMPALA), flat, layout, vec.spec), action_rng(1, 0), T=3
    ).arrays
    arrays["next_obs"] = arrays["next_obs"].astype(np.float32)
    with pytest.raises(P.ProtocolError, match="'next_obs' must be uint8"):
        P.decode(P.encode(_trajectory(arrays)))


@pytest.mark.parametrize("kind,shape,width", [("nature_cnn", (4, 84, 84), 512), ("impala_cnn", (4, 84, 84), 256)])
def test_the_cnns_share_a_torso_and_scale_pixels_inside(kind: str, shape: tuple, width: int) -> None:
    spec = EnvSpec(obs_shape=shape, discrete=True, action_dim=4, obs_dtype="uint8")
    model = ActorCritic(spec, ModelConfig(kind=kind, hidden=(width,)))
    names = [name for name, _ in model.named_parameters()]
    assert all(n.startswith(("torso.", "pi.", "v.")) for n in names) and model.torso is not None
    assert model.torso.fc.out_features == width
    pixels = torch.randint(0, 256, (3, *shape), dtype=torch.uint8)
    with torch.no_grad():
        out_u8, value_u8 = model.heads(pixels)
        out_f, value_f = model.heads(pixels.float() / 255.0)
    assert out_u8.shape == (3, 4) and value_u8.shape == (3,)
    torch.testing.assert_close(out_u8, out_f)
    torch.testing.assert_close(value_u8, value_f)


def test_the_nature_cnn_has_the_papers_size() -> None:
    model = ActorCritic(EnvSpec((4, 84, 84), True, 4, obs_dtype="uint8"), ModelConfig(kind="nature_cnn", hidden=(512,)))
    torso = sum(p.numel() for p in model.torso.parameters())  # type: ignore[union-attr]
    # conv 4->32 8x8, 32->64 4x4, 64->64 3x3, fc 3136->512 (Mnih et al. 2015)
    assert torso == (4 * 64 * 32 + 32) + (32 * 16 * 64 + 64) + (64 * 9 * 64 + 64) + (3136 * 512 + 512)


def test_the_torch_actor_policy_is_the_learners_network() -> None:
    vec = _vec(3)
    model = ActorCritic(vec.spec, IMPALA)
    flat, layout = flatten_params(model)
    policy = actor_critic_policy(flat, layout, IMPALA, vec.spec)
    assert isinstance(policy, TorchPolicy) and policy.outputs == 3
    out = policy.act(vec.obs, np.random.default_rng(0))
    with torch.no_grad():
        logp, _, value = model.evaluate(torch.from_numpy(vec.obs), torch.from_numpy(out.actions))
    np.testing.assert_allclose(out.values, value.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.logp, logp.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(policy.value(vec.obs), value.numpy(), rtol=1e-5, atol=1e-5)


def test_an_mlp_run_gets_the_numpy_policy() -> None:
    vec = VecEnv(env_factory("CartPole-v1"), [1])
    flat, layout = flatten_params(ActorCritic(vec.spec, ModelConfig()))
    assert isinstance(actor_critic_policy(flat, layout, ModelConfig(), vec.spec), NumpyPolicy)


def test_a_layout_of_another_network_does_not_build_a_torch_policy() -> None:
    vec = _vec()
    flat, layout = flatten_params(ActorCritic(vec.spec, ModelConfig(kind="impala_cnn", hidden=(16,))))
    with pytest.raises(RuntimeError):
        TorchPolicy(actor_critic_network(vec.spec, IMPALA), flat, layout, vec.spec)


def test_the_learner_trains_on_uint8_and_clips_rewards_for_learning_only() -> None:
    config = Config().replace(
        {
            "env.id": ENV_ID,
            "env.clip_rewards": True,
            "model.kind": "impala_cnn",
            "model.hidden": [32],
            "algo.epochs": 1,
            "algo.minibatches": 2,
        }
    )
    vec = _vec()
    core = PPOLearner(config, vec.spec)
    flat, layout, _ = core.params()
    rollout = collect(
        vec, TorchPolicy(actor_critic_network(vec.spec, config.model), flat, layout, vec.spec), action_rng(1, 0), T=8
    )
    traj = P.decode(encode_rollout(_trajectory({**rollout.arrays, "rewards": rollout.arrays["rewards"] * 7})))
    assert (traj.arrays["rewards"] == 7).all()  # the wire keeps the env's rewards: the true returns
    assert [r.max() for r in core.learning_rewards([traj])] == [1.0]  # the loss sees their sign
    figures = core.update([traj])
    assert np.isfinite(figures["policy_loss"]) and core.model.torso is not None


def test_a_cnn_on_vector_observations_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"needs \[C, H, W\] observations"):
        ActorCritic(EnvSpec((4,), True, 2), ModelConfig(kind="nature_cnn"))
    with pytest.raises(ConfigError, match="model.kind"):
        ModelConfig(kind="resnet")
