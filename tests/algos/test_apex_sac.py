"""Ape-X DQN and SAC learner cores: targets and priorities against slow references, the replay ratio, checkpoints."""

from __future__ import annotations

import io
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zddrl.algos.apex.learner import ApexLearner
from zddrl.algos.apex.policy import actor_td
from zddrl.algos.checks import replay_refusal, spec_refusal
from zddrl.algos.rollout import mismatch
from zddrl.algos.sac.learner import SACLearner
from zddrl.config import Config, ConfigError, run_kind
from zddrl.envs import EnvSpec
from zddrl.shards.group import ShardGroup

DISCRETE = EnvSpec((3,), True, 2)
BOX = EnvSpec((3,), False, 1, (-2.0,), (2.0,))


def config(mode: str, **replay: object) -> Config:
    overrides = {
        **run_kind(mode),
        "model.hidden": [16, 16],
        "model.activation": "relu",
        "replay.capacity": 4096,
        "replay.batch_size": 8,
        "replay.learning_starts": 0,
        "replay.replay_ratio": 0.5,
        **{f"replay.{k}": v for k, v in replay.items()},
    }
    return Config().replace(overrides)


def rollout(spec: EnvSpec, T: int = 8, N: int = 2, version: int = 0, seed: int = 0, **extra) -> SimpleNamespace:
    rng = np.random.default_rng(seed)
    f32 = np.float32
    actions = (
        rng.integers(0, spec.action_dim, (T, N))
        if spec.discrete
        else rng.uniform(-2, 2, (T, N, spec.action_dim)).astype(f32)
    )
    terminated = np.zeros((T, N), bool)
    terminated[T // 2, 0] = True
    arrays = {
        "obs": rng.standard_normal((T, N, 3)).astype(f32),
        "actions": actions,
        "logp": np.zeros((T, N), f32),
        "values": rng.standard_normal((T, N)).astype(f32),
        "rewards": rng.standard_normal((T, N)).astype(f32),
        "terminated": terminated,
        "truncated": np.zeros((T, N), bool),
        "next_obs": rng.standard_normal((N, 3)).astype(f32),
        "next_value": rng.standard_normal(N).astype(f32),
        **extra,
    }
    return SimpleNamespace(arrays=arrays, policy_version=version, peer_id="a", seq=version)


def test_apex_priorities_and_loss_match_a_per_sample_double_q_reference() -> None:
    core = ApexLearner(config("apex", n_step=2), DISCRETE)
    core.update([rollout(DISCRETE)])
    core.target.load_state_dict({k: v + 0.1 for k, v in core.model.state_dict().items()})  # target != online
    batch = core.replay.get(np.arange(6))
    expected, losses = [], []
    with torch.no_grad():
        for j in range(6):
            nxt = torch.as_tensor(batch.next_obs[j : j + 1])
            best = int(core.model(nxt).argmax())
            y = batch.returns[j] + batch.discounts[j] * float(core.target(nxt)[0, best])
            q = float(core.model(torch.as_tensor(batch.obs[j : j + 1]))[0, batch.actions[j]])
            expected.append(abs(q - y))
            d = abs(q - y)
            losses.append(0.5 * d * d if d < 1 else d - 0.5)
    figures = core._learn(batch)
    assert figures["loss"] == pytest.approx(float(np.mean(losses)), rel=1e-4)
    got = core.replay.tree.get(batch.ids % core.replay.capacity)
    want = (np.array(expected) + core.replay.eps) ** core.replay.alpha
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_apex_target_network_is_refreshed_every_k_gradient_steps() -> None:
    core = ApexLearner(config("apex").replace({"algo.target_update_every": 3}), DISCRETE)
    core.update([rollout(DISCRETE, T=8)])  # 16 steps x 0.5: 8 gradient steps; copies after steps 3 and 6
    assert core.grad_steps == 8
    sample = torch.as_tensor(np.ones((1, 3), np.float32))
    assert not torch.equal(core.target(sample), core.model(sample))
    core.update([rollout(DISCRETE, T=1, N=1, seed=1)])  # 1 step x 0.5 + the carried 0: no step
    core.update([rollout(DISCRETE, T=1, N=1, seed=2)])  # the ninth gradient step: a copy
    assert core.grad_steps == 9
    assert torch.equal(core.target(sample), core.model(sample))


def test_the_replay_ratio_holds_over_updates_and_waits_for_learning_starts() -> None:
    core = ApexLearner(config("apex", replay_ratio=0.3, learning_starts=40), DISCRETE)
    taken = []
    for v in range(10):
        figures = core.update([rollout(DISCRETE, T=4, N=3, version=v, seed=v)])
        taken.append(figures["grad_steps"])
    # 12 steps per update: no step until 40 transitions are held (update 4), then 3.6 per update, fractions kept
    assert taken[:3] == [0, 0, 0]
    assert sum(taken[3:]) == math.floor(0.3 * 12 * 7)
    assert core.grad_steps == sum(taken)


def test_actor_td_errors_cannot_buy_more_than_the_largest_priority() -> None:
    core = ApexLearner(config("apex"), DISCRETE)
    hostile = np.full((8, 2), 1e30, np.float32)
    core.update([rollout(DISCRETE, actor_td=hostile)])
    assert core.replay.tree.get(np.arange(16)).max() <= core.replay.max_priority * (1 + 1e-9)


def test_actor_td_errors_match_a_slow_n_step_reference() -> None:
    gamma, n, T, N = 0.9, 3, 7, 2
    r = rollout(DISCRETE, T=T, N=N)
    a = r.arrays
    a["truncated"][2, 1] = True
    a.update(
        trunc_idx=np.array([2 * N + 1]), trunc_obs=np.zeros((1, 3), np.float32), trunc_value=np.array([5.0], np.float32)
    )
    q_taken = np.random.default_rng(3).standard_normal((T, N)).astype(np.float32)
    got = actor_td(a, q_taken, gamma, n)
    for i in range(N):
        for t in range(T):
            g, k, ended = 0.0, 0, None
            while k < n and t + k < T:
                g += gamma**k * a["rewards"][t + k, i]
                k += 1
                if a["terminated"][t + k - 1, i] or a["truncated"][t + k - 1, i]:
                    ended = "terminated" if a["terminated"][t + k - 1, i] else "truncated"
                    break
            if ended == "terminated":
                boot = 0.0
            elif ended == "truncated":
                boot = 5.0
            else:
                boot = a["next_value"][i] if t + k == T else a["values"][t + k, i]
            want = g + (0.0 if ended == "terminated" else gamma**k * boot) - q_taken[t, i]
            assert got[t, i] == pytest.approx(want, abs=1e-4), (t, i)


def test_sac_critic_target_matches_the_soft_bellman_reference() -> None:
    core = SACLearner(config("sac", alpha=0.0, n_step=1), BOX)
    core.update([rollout(BOX)])
    batch = core.replay.get(np.arange(4))
    torch.manual_seed(5)
    with torch.no_grad():
        nxt = torch.as_tensor(batch.next_obs)
        next_a, next_logp = core.model.sample(nxt)
        q1, q2 = core.critic_target(nxt, next_a)
        alpha = core.log_alpha.exp()
        y = torch.as_tensor(batch.returns) + torch.as_tensor(batch.discounts) * (
            torch.minimum(q1, q2) - alpha * next_logp
        )
        a = torch.as_tensor(batch.actions) / 2.0  # bounds [-2, 2] -> [-1, 1]
        c1, c2 = core.critic(torch.as_tensor(batch.obs), a)
        want = 0.5 * (((c1 - y) ** 2).mean() + ((c2 - y) ** 2).mean())
    torch.manual_seed(5)
    figures = core._learn(batch)
    assert figures["critic_loss"] == pytest.approx(float(want), rel=1e-5)


def test_sac_temperature_moves_towards_the_target_entropy_and_critics_track_slowly() -> None:
    core = SACLearner(config("sac", alpha=0.0, n_step=1, replay_ratio=1.0), BOX)
    before = [p.clone() for p in core.critic_target.parameters()]
    alpha0 = float(core.log_alpha.detach().exp())
    core.update([rollout(BOX, T=16)])
    assert core.grad_steps == 32
    moved = max(float((p - q).abs().max()) for p, q in zip(core.critic_target.parameters(), before))
    assert 0 < moved < 0.05  # Polyak with tau 0.005, not a copy
    assert float(core.log_alpha.detach().exp()) != alpha0


def test_squashed_gaussian_log_density_matches_a_change_of_variables_reference() -> None:
    core = SACLearner(config("sac"), BOX)
    obs = torch.randn(5, 3)
    torch.manual_seed(1)
    a, logp = core.model.sample(obs)
    torch.manual_seed(1)
    mu, log_std = core.model(obs)
    u = mu + log_std.exp() * torch.randn_like(mu)
    base = torch.distributions.Normal(mu, log_std.exp()).log_prob(u).sum(-1)
    np.testing.assert_allclose(a.detach(), torch.tanh(u).detach(), atol=1e-6)
    np.testing.assert_allclose(
        logp.detach(), (base - torch.log(1 - torch.tanh(u) ** 2 + 1e-6).sum(-1)).detach(), atol=1e-4
    )


@pytest.mark.parametrize("mode,spec", [("apex", DISCRETE), ("sac", BOX)])
def test_state_round_trips_through_a_weights_only_checkpoint_with_the_buffer(mode: str, spec: EnvSpec) -> None:
    cfg = config(mode).replace({"train.checkpoint_replay": True})
    core = (ApexLearner if mode == "apex" else SACLearner)(cfg, spec)
    for v in range(3):
        core.update([rollout(spec, version=v, seed=v)])
    buf = io.BytesIO()
    torch.save(core.state(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    again = (ApexLearner if mode == "apex" else SACLearner)(cfg, spec)
    again.load_state(state)
    assert len(again.replay) == len(core.replay) and again.grad_steps == core.grad_steps
    assert_same(again.state(), core.state())  # every network, optimizer, temperature, counter and the buffer
    a, b = core.replay.sample(8), again.replay.sample(8)
    np.testing.assert_array_equal(a.ids, b.ids)
    obs = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(core.greedy(obs), again.greedy(obs))
    other = (ApexLearner if mode == "apex" else SACLearner)(cfg, spec, ShardGroup(rank=1))
    other.load_state(state)  # another shard: the weights, not the main shard's buffer nor its sampling stream
    assert len(other.replay) == 0 and other.grad_steps == core.grad_steps


def assert_same(a, b, path: str = "state") -> None:
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            if k != "torch_rng":  # the generator moved on while the original sampled
                assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=path)
    else:
        assert a == b, path


def test_hostile_numbers_are_refused_or_bounded_never_fatal() -> None:
    huge = rollout(DISCRETE)
    huge.arrays["rewards"][0, 0] = 3e38  # finite, but its n-step return overflows float32
    assert "rewards beyond" in mismatch(huge.arrays, DISCRETE)
    wild = rollout(BOX)
    wild.arrays["actions"][0, 0, 0] = 1e30
    assert mismatch(wild.arrays, BOX, bounded=True) == "actions outside the env's action bounds"
    assert mismatch(wild.arrays, BOX) == ""  # PPO's actors send unclipped Gaussian samples
    assert mismatch(rollout(BOX).arrays, BOX, bounded=True) == ""
    core = ApexLearner(config("apex").replace({"replay.capacity": 16}), DISCRETE)
    assert "does not fit" not in core.refusal(rollout(DISCRETE, T=7).arrays)  # 8 x 2 slots: fits
    assert "the buffer holds 16" in core.refusal(rollout(DISCRETE, T=8).arrays)
    core = ApexLearner(config("apex"), DISCRETE)
    core.update([rollout(DISCRETE)])
    batch = core.replay.sample(4)
    core.update_priorities(batch, torch.tensor([math.inf, math.nan, 1.0, 2.0]))  # a diverged network: no crash
    assert core.nonfinite_td == 2
    assert core.replay.tree.get(batch.ids[:2] % core.replay.capacity).max() <= core.replay.max_priority * (1 + 1e-9)


def test_a_shard_without_data_still_takes_part_and_refreshes_its_target() -> None:
    core = ApexLearner(config("apex").replace({"algo.target_update_every": 1}), DISCRETE)
    with torch.no_grad():
        core.target.advantage.bias.add_(1.0)
    assert core.train_step(None) == {}
    sample = torch.ones((1, 3))
    assert torch.equal(core.target(sample), core.model(sample))
    sac = SACLearner(config("sac"), BOX)
    assert sac.train_step(None) == {}


def test_replay_modes_refuse_what_they_cannot_learn_with() -> None:
    assert "normalize_obs" in spec_refusal(Config().replace({"algo.name": "sac", "algo.normalize_obs": True}), BOX)
    with pytest.raises(ConfigError, match="eval_every"):
        Config().replace({"train.target_kind": "eval"})
    with pytest.raises(ValueError, match="discrete"):
        ApexLearner(config("apex"), BOX)
    with pytest.raises(ValueError, match="continuous"):
        SACLearner(config("sac"), DISCRETE)
    unbounded = EnvSpec((3,), False, 1, (-math.inf,), (math.inf,))
    assert "finite action bounds" in spec_refusal(config("sac"), unbounded)
    assert spec_refusal(config("apex"), BOX) == "algo.name 'apex' needs a discrete (Discrete) action space"
    assert "more than 80% of" in replay_refusal(config("apex", capacity=10**12), DISCRETE)
    assert replay_refusal(config("apex"), DISCRETE) == ""
