"""PPO maths and the learner core: loss gradients by hand, optimizer equivalence, batches, normalisers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from samples import cartpole_trajectory
from zddrl.algos.core import RewardScaler, RunningMeanStd, schedule
from zddrl.algos.optim import Adam
from zddrl.algos.ppo.learner import PPOLearner, ppo_loss
from zddrl.config import Config, run_kind
from zddrl.envs import EnvSpec
from zddrl.protocol import Trajectory


def _loss_grads(logp, old_logp, adv, value, returns, entropy, **kw):
    logp = torch.tensor(logp, requires_grad=True)
    value = torch.tensor(value, requires_grad=True)
    entropy = torch.tensor(entropy, requires_grad=True)
    loss, parts = ppo_loss(
        logp,
        torch.tensor(old_logp),
        torch.tensor(adv),
        value,
        torch.zeros_like(value),
        torch.tensor(returns),
        entropy,
        **kw,
    )
    loss.backward()
    return loss, parts, logp.grad, value.grad, entropy.grad


def test_ppo_loss_gradients_by_hand() -> None:
    # Two samples. Sample 0: ratio e^0.1 = 1.105 (inside the 0.2 clip), adv +2 -> d/dlogp = -2 * 1.105 / 2.
    # Sample 1: ratio e^0.5 = 1.649 > 1.2 with adv +1 -> clipped branch is the max: gradient 0.
    loss, parts, g_logp, g_value, g_ent = _loss_grads(
        [0.1, 0.5], [0.0, 0.0], [2.0, 1.0], [1.0, 3.0], [2.0, 0.0], [0.5, 0.7], clip=0.2, vf_coef=0.5, ent_coef=0.01
    )
    r0 = np.exp(0.1)
    np.testing.assert_allclose(g_logp.numpy(), [-2.0 * r0 / 2, 0.0], rtol=1e-6)
    # value loss 0.5 * mean((v - R)^2) * vf_coef -> d/dv = vf_coef * (v - R) / 2
    np.testing.assert_allclose(g_value.numpy(), [0.5 * (1 - 2) / 2, 0.5 * (3 - 0) / 2], rtol=1e-6)
    np.testing.assert_allclose(g_ent.numpy(), [-0.01 / 2, -0.01 / 2], rtol=1e-6)
    expected_pg = np.mean([-2.0 * r0, -1.0 * 1.2])
    assert parts["policy_loss"] == pytest.approx(expected_pg, rel=1e-6)
    assert parts["clipfrac"] == pytest.approx(0.5)


def test_ppo_loss_negative_advantage_clips_below() -> None:
    # ratio e^-0.5 = 0.607 < 0.8 with adv -1: the clipped term (-adv * 0.8 = 0.8) is the max -> no gradient.
    _, _, g_logp, _, _ = _loss_grads([-0.5], [0.0], [-1.0], [0.0], [0.0], [0.0], clip=0.2, vf_coef=0.5, ent_coef=0.0)
    assert g_logp.item() == 0.0


def test_adam_matches_torch_adam() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
    b.load_state_dict(a.state_dict())
    ours, theirs = Adam(a.parameters(), lr=3e-3, eps=1e-5), torch.optim.Adam(b.parameters(), lr=3e-3, eps=1e-5)
    for step in range(30):
        x = torch.randn(16, 6)
        for model, opt in ((a, ours), (b, theirs)):
            opt.zero_grad()
            (model(x) ** 2).mean().backward()
            if step == 10:
                opt.param_groups[0]["lr"] = 1e-3  # schedules change lr in place
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_adam_keeps_per_parameter_steps_across_skips_and_a_resume(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter without a gradient takes no step (torch's rule, its own bias corrections), a resumed optimizer goes
    on with each parameter's count, and a step with no gradient at all changes nothing."""
    import zddrl.algos.optim as optim

    monkeypatch.setattr(optim, "FUSED", fused)
    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
    b.load_state_dict(a.state_dict())
    ours, theirs = Adam(a.parameters(), lr=3e-3), torch.optim.Adam(b.parameters(), lr=3e-3)
    for step in range(20):
        x = torch.randn(16, 6)
        for model, opt in ((a, ours), (b, theirs)):
            opt.zero_grad()
            (model(x) ** 2).mean().backward()
            if step % 3 == 0:
                model.bias.grad = None
            opt.step()
        if step == 10:
            ours, state = Adam(a.parameters(), lr=3e-3), ours.state_dict()
            ours.load_state_dict(state)
    ours.zero_grad()
    ours.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_running_mean_std_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    data = rng.normal(3.0, 2.0, size=(1000, 3))
    rms = RunningMeanStd((3,))
    for chunk in np.array_split(data, 7):
        rms.update(chunk)
    np.testing.assert_allclose(rms.mean, data.mean(0), rtol=1e-3)
    np.testing.assert_allclose(rms.var, data.var(0), rtol=1e-3)


def test_reward_scaler_tracks_each_stream_and_resets_at_episode_end() -> None:
    scaler = RewardScaler(gamma=0.5)
    r = np.ones((3, 2), dtype=np.float32)
    done = np.array([[False, False], [True, False], [False, False]])
    (scaled,) = scaler.scale([("a", 0, r, done)])
    # stream a env 0: returns 1, 1.5 (episode ends), then 1; env 1: 1, 1.5, 1.75 -> carried over
    np.testing.assert_allclose(scaler.returns["a"], [1.0, 1.75])
    assert "b" not in scaler.returns
    seen = np.array([1.0, 1.0, 1.5, 1.5, 1.0, 1.75])
    np.testing.assert_allclose(scaled, r / np.sqrt(scaler.rms.var + 1e-8), rtol=1e-6)
    assert scaler.rms.var == pytest.approx(seen.var(), rel=1e-3)


def test_reward_scaler_scales_a_batch_whatever_its_order() -> None:
    """The whole batch enters the statistics before any of it is scaled: arrival order is irrelevant."""
    rng = np.random.default_rng(1)
    streams = [(s, 0, rng.normal(size=(4, 2)).astype(np.float32), np.zeros((4, 2), bool)) for s in "abc"]
    forward, backward = RewardScaler(0.9), RewardScaler(0.9)
    out_f = forward.scale(streams)
    out_b = backward.scale(streams[::-1])[::-1]
    for x, y in zip(out_f, out_b):
        np.testing.assert_allclose(x, y, rtol=1e-6)


def test_schedule() -> None:
    assert schedule(1.0, "constant", 0.7) == 1.0
    assert schedule(1.0, "linear", 0.25) == pytest.approx(0.75)
    assert schedule(1.0, "linear", 2.0) == 0.0


def test_make_batch_uses_truncation_values_and_flattens_time_major() -> None:
    core = PPOLearner(Config().replace({"algo.gamma": 0.5, "algo.gae_lambda": 1.0}), EnvSpec((4,), True, 2))
    batch = core.make_batch([cartpole_trajectory(3, 2), cartpole_trajectory(2, 1, "b", 1)])
    assert batch.obs.shape == (8, 4) and batch.returns.shape == (8,)
    # env 0 of the first trajectory, rows t=0,1 (flat 0 and 2): truncated after t=1 with V(final) = 10
    # R_1 = 1 + 0.5 * 10 = 6; R_0 = 1 + 0.5 * 6 = 4
    assert batch.returns[2].item() == pytest.approx(6.0)
    assert batch.returns[0].item() == pytest.approx(4.0)


def test_update_reports_figures_and_moves_parameters() -> None:
    core = PPOLearner(Config(), EnvSpec((4,), True, 2))
    before, _, _ = core.params()
    figures = core.update([cartpole_trajectory(16, 4)])
    after, _, _ = core.params()
    assert not np.array_equal(before, after)
    for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "grad_norm", "lr"):
        assert np.isfinite(figures[key]), key
    assert figures["batch_steps"] == 64


@pytest.mark.parametrize("mode", ["sync", "async", "impala"])
def test_splitting_the_same_data_over_1_2_4_actors_gives_the_same_update(mode: str) -> None:
    """A batch of 8 env columns sent as 1 x 8, 2 x 4 or 4 x 2 trajectories trains the same parameters."""
    from zddrl.algos.impala.learner import ImpalaLearner

    T, N = 16, 8
    whole = cartpole_trajectory(T, N)
    for key in ("rewards", "terminated"):
        whole.arrays[key][:] = (
            np.random.default_rng(1).random((T, N)) < 0.3
            if key == "terminated"
            else np.random.default_rng(2).standard_normal((T, N))
        )
    config = Config().replace({**run_kind(mode), "algo.minibatches": 1, "algo.epochs": 3})
    results = []
    for parts in (1, 2, 4):
        w = N // parts
        trajectories = [_split(whole, i * w, (i + 1) * w, f"actor-{i}") for i in range(parts)]
        core = (ImpalaLearner if mode == "impala" else PPOLearner)(config, EnvSpec((4,), True, 2))
        for _ in range(3):
            core.update(trajectories)
        results.append(core.params()[0])
    np.testing.assert_allclose(results[0], results[1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(results[0], results[2], rtol=1e-4, atol=1e-5)


def _split(traj: Trajectory, lo: int, hi: int, peer_id: str) -> Trajectory:
    """Env columns lo..hi of ``traj`` as the trajectory one actor with those envs would have sent."""
    x, (T, N) = traj.arrays, traj.arrays["rewards"].shape
    t_idx, n_idx = np.divmod(x["trunc_idx"], N)
    keep = (n_idx >= lo) & (n_idx < hi)
    arrays = {k: v[:, lo:hi] for k, v in x.items() if v.ndim >= 2 and v.shape[:2] == (T, N)}
    arrays.update(next_obs=x["next_obs"][lo:hi], next_value=x["next_value"][lo:hi])
    if keep.any():  # the truncation arrays travel only when some episode was truncated
        arrays.update(
            trunc_idx=t_idx[keep] * (hi - lo) + n_idx[keep] - lo,
            trunc_obs=x["trunc_obs"][keep],
            trunc_value=x["trunc_value"][keep],
        )
    return Trajectory(
        run_id="r", peer_id=peer_id, seq=0, policy_version=0, param_hash="", env_steps=T * (hi - lo), arrays=arrays
    )
