"""Behavioural tests for zddrl.algos.returns (GAE, V-trace, truncated importance weights)."""

import math

import numpy as np
import pytest
import torch

from zddrl.algos.returns import gae, truncated_importance_weights, vtrace, vtrace_discounts_and_rewards

NAN = float("nan")


def col(*xs):
    """A [T, 1] float tensor from a list of numbers (one env)."""
    return torch.tensor(xs, dtype=torch.float32)[:, None]


def assert_close(actual, expected, atol=1e-5, rtol=1e-5):
    """``actual`` against ``expected`` taken to ``actual``'s dtype (the functions keep the caller's)."""
    expected = torch.as_tensor(np.asarray(expected, dtype=np.float64)).to(actual.dtype)
    torch.testing.assert_close(actual, expected.reshape(actual.shape), atol=atol, rtol=rtol)


# ---------------------------------------------------------------- GAE, hand-computed
# Shared case: gamma = 0.5, lambda = 0.5 (so gamma * lambda = 0.25), r = [1, 2, 4], V = [2, 4, 8].
R, V, ZERO = col(1, 2, 4), col(2, 4, 8), col(0, 0, 0)


def test_gae_termination_mid_rollout():
    # terminated after t=1, bootstrap V(s_3) = 16.
    # delta0 = 1 + .5*4 - 2 = 1;  delta1 = 2 + 0 - 4 = -2 (no bootstrap);  delta2 = 4 + .5*16 - 8 = 4
    # A2 = 4;  A1 = -2 (trace cut);  A0 = 1 + .25*(-2) = 0.5;  returns = A + V = [2.5, 2, 12]
    out = gae(R, V, col(0, 1, 0), ZERO, torch.tensor([16.0]), gamma=0.5, gae_lambda=0.5)
    assert_close(out.advantages, [0.5, -2, 4])
    assert_close(out.returns, [2.5, 2, 12])


def test_gae_truncation_bootstraps_from_truncation_value():
    # truncated after t=1 with V(final obs) = 6; NaN elsewhere must be ignored.
    # delta1 = 2 + .5*6 - 4 = 1;  A2 = 4;  A1 = 1 (trace cut);  A0 = 1 + .25*1 = 1.25
    tv = col(NAN, 6, NAN)
    out = gae(R, V, ZERO, col(0, 1, 0), torch.tensor([16.0]), tv, gamma=0.5, gae_lambda=0.5)
    assert_close(out.advantages, [1.25, 1, 4])
    assert_close(out.returns, [3.25, 5, 12])
    # truncation_value=None means V(final obs) = 0: same numbers as a termination.
    out = gae(R, V, ZERO, col(0, 1, 0), torch.tensor([16.0]), gamma=0.5, gae_lambda=0.5)
    assert_close(out.advantages, [0.5, -2, 4])
    # terminated wins over truncated: no bootstrap from truncation_value.
    out = gae(R, V, col(0, 1, 0), col(0, 1, 0), torch.tensor([16.0]), tv, gamma=0.5, gae_lambda=0.5)
    assert_close(out.advantages, [0.5, -2, 4])


def test_gae_rollout_cut_mid_episode_uses_bootstrap_value():
    # no episode end: delta = [1 + 2 - 2, 2 + 4 - 4, 4 + 8 - 8] = [1, 2, 4]
    # A2 = 4;  A1 = 2 + .25*4 = 3;  A0 = 1 + .25*3 = 1.75;  returns = [3.75, 7, 12]
    out = gae(R, V, ZERO, ZERO, torch.tensor([16.0]), gamma=0.5, gae_lambda=0.5)
    assert_close(out.advantages, [1.75, 3, 4])
    assert_close(out.returns, [3.75, 7, 12])


def test_gae_several_episodes_in_one_rollout_two_envs():
    # env 0: r = [1, 3, 3, 4], V = 2, terminated after t=1, truncated after t=3 (last row) with
    #   V(final) = 10, so bootstrap_value (100) is NOT used.
    #   delta = [1 + 1 - 2, 3 + 0 - 2, 3 + 1 - 2, 4 + 5 - 2] = [0, 1, 2, 7]
    #   A3 = 7; A2 = 2 + .25*7 = 3.75; A1 = 1; A0 = 0 + .25*1 = 0.25
    # env 1: r = 1, V = 0, no ends, bootstrap 8: delta = [1, 1, 1, 5]
    #   A3 = 5; A2 = 2.25; A1 = 1.5625; A0 = 1.390625
    rewards = torch.tensor([[1.0, 1], [3, 1], [3, 1], [4, 1]])
    values = torch.tensor([[2.0, 0]] * 4)
    term = torch.tensor([[False, False], [True, False], [False, False], [False, False]])
    trunc = torch.tensor([[False, False], [False, False], [False, False], [True, False]])
    tv = torch.tensor([[NAN, NAN], [NAN, NAN], [NAN, NAN], [10.0, NAN]])
    out = gae(rewards, values, term, trunc, torch.tensor([100.0, 8.0]), tv, 0.5, 0.5)
    assert_close(out.advantages, [[0.25, 1.390625], [1, 1.5625], [3.75, 2.25], [7, 5]])
    assert_close(out.returns, out.advantages + values)


def random_rollout(rng, T, B, p_end=0.2):
    return dict(
        rewards=rng.normal(size=(T, B)),
        values=rng.normal(size=(T, B)),
        terminated=rng.random((T, B)) < p_end,
        truncated=rng.random((T, B)) < p_end,
        bootstrap_value=rng.normal(size=B),
        truncation_value=rng.normal(size=(T, B)),
    )


def test_gae_lambda_one_is_discounted_monte_carlo_return_plus_bootstrap():
    rng, gamma = np.random.default_rng(0), 0.9
    ro = random_rollout(rng, 7, 3)
    out = gae(
        ro["rewards"],
        ro["values"],
        np.zeros((7, 3)),
        np.zeros((7, 3)),
        ro["bootstrap_value"],
        gamma=gamma,
        gae_lambda=1.0,
    )
    for t in range(7):
        mc = sum(gamma ** (k - t) * ro["rewards"][k] for k in range(t, 7))
        assert_close(out.returns[t], mc + gamma ** (7 - t) * ro["bootstrap_value"], atol=1e-4)


def test_gae_lambda_zero_is_one_step_td():
    rng, gamma = np.random.default_rng(1), 0.9
    ro = random_rollout(rng, 6, 4)
    out = gae(**ro, gamma=gamma, gae_lambda=0.0)
    nxt = np.concatenate([ro["values"][1:], ro["bootstrap_value"][None]])
    nxt = np.where(ro["truncated"], ro["truncation_value"], nxt)
    nxt = np.where(ro["terminated"], 0.0, nxt)
    assert_close(out.advantages, ro["rewards"] + gamma * nxt - ro["values"])


def slow_gae(rewards, values, terminated, truncated, bootstrap_value, truncation_value, gamma, lam):
    T, B = rewards.shape
    adv = np.zeros((T, B))
    for b in range(B):
        a_next = 0.0
        for t in reversed(range(T)):
            if terminated[t, b]:
                next_v, cont = 0.0, 0.0
            elif truncated[t, b]:
                next_v, cont = truncation_value[t, b], 0.0
            else:
                next_v = values[t + 1, b] if t + 1 < T else bootstrap_value[b]
                cont = 1.0
            delta = rewards[t, b] + gamma * next_v - values[t, b]
            a_next = delta + gamma * lam * cont * a_next
            adv[t, b] = a_next
    return adv


@pytest.mark.parametrize("T,B,seed", [(1, 1, 0), (1, 5, 1), (5, 1, 2), (16, 8, 3), (64, 3, 4)])
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.5, 0.8), (1.0, 1.0)])
def test_gae_matches_slow_loop(T, B, seed, gamma, lam):
    ro = random_rollout(np.random.default_rng(seed), T, B)
    out = gae(**ro, gamma=gamma, gae_lambda=lam)  # numpy float64 + bool masks in: computed in float64
    assert out.advantages.dtype == out.returns.dtype == torch.float64 and out.advantages.shape == (T, B)
    expected = slow_gae(*ro.values(), gamma, lam)
    assert_close(out.advantages, expected, atol=1e-12, rtol=0)
    assert_close(out.returns, expected + ro["values"], atol=1e-12, rtol=0)
    f32 = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in ro.items()}
    out = gae(**f32, gamma=gamma, gae_lambda=lam)  # float32 in: float32 out, to float32's precision
    assert out.advantages.dtype == out.returns.dtype == torch.float32
    assert_close(out.advantages, expected, atol=1e-4)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(values=np.zeros((3, 2))), "values"),
        (dict(terminated=np.zeros((4, 3))), "terminated"),
        (dict(rewards=np.zeros(4), values=np.zeros(4), terminated=np.zeros(4), truncated=np.zeros(4)), "rewards"),
        (dict(bootstrap_value=np.zeros((1, 2))), "bootstrap_value"),
        (dict(bootstrap_value=np.zeros(3)), "bootstrap_value"),
        (dict(truncation_value=np.zeros((4, 1))), "truncation_value"),
        (dict(gamma=1.5), "gamma"),
    ],
)
def test_gae_bad_inputs_raise_value_error(change, match):
    args = dict(
        rewards=np.zeros((4, 2)),
        values=np.zeros((4, 2)),
        terminated=np.zeros((4, 2)),
        truncated=np.zeros((4, 2)),
        bootstrap_value=np.zeros(2),
    )
    with pytest.raises(ValueError, match=match):
        gae(**{**args, **change})


# ---------------------------------------------------------------- V-trace
def slow_vtrace(mu, pi, r, d, v, boot, rho_bar, c_bar):
    """Eq. (1) of Espeholt et al. 2018 in its explicit-sum form, one env at a time."""
    T, B = r.shape
    vs, pg = np.zeros((T, B)), np.zeros((T, B))
    for b in range(B):
        ratio = np.exp(pi[:, b] - mu[:, b])
        rho, c = np.minimum(rho_bar, ratio), np.minimum(c_bar, ratio)
        v_ext = np.append(v[:, b], boot[b])
        delta = rho * (r[:, b] + d[:, b] * v_ext[1:] - v[:, b])
        for s in range(T):
            total, weight = 0.0, 1.0
            for t in range(s, T):
                total += weight * delta[t]
                weight *= d[t, b] * c[t]
            vs[s, b] = v[s, b] + total
        vs_ext = np.append(vs[:, b], boot[b])
        pg[:, b] = rho * (r[:, b] + d[:, b] * vs_ext[1:] - v[:, b])
    return vs, pg


def random_offpolicy(rng, T, B, gamma=0.9):
    return dict(
        behaviour_logp=rng.normal(size=(T, B)),
        target_logp=rng.normal(size=(T, B)),
        rewards=rng.normal(size=(T, B)),
        discounts=gamma * (rng.random((T, B)) > 0.2),
        values=rng.normal(size=(T, B)),
        bootstrap_value=rng.normal(size=B),
    )


@pytest.mark.parametrize("T,B,seed", [(1, 1, 0), (4, 1, 1), (7, 5, 2), (32, 4, 3)])
@pytest.mark.parametrize("rho_bar,c_bar", [(1.0, 1.0), (0.5, 0.5), (10.0, 10.0), (2.0, 0.5), (math.inf, math.inf)])
def test_vtrace_matches_slow_paper_formula(T, B, seed, rho_bar, c_bar):
    x = random_offpolicy(np.random.default_rng(seed), T, B)
    out = vtrace(**x, rho_bar=rho_bar, c_bar=c_bar)  # float64 in: computed in float64
    vs, pg = slow_vtrace(*x.values(), rho_bar, c_bar)
    assert out.vs.dtype == out.pg_advantages.dtype == out.rhos.dtype == torch.float64
    assert_close(out.vs, vs, atol=1e-12, rtol=0)
    assert_close(out.pg_advantages, pg, atol=1e-12, rtol=0)
    assert_close(out.rhos, np.minimum(rho_bar, np.exp(x["target_logp"] - x["behaviour_logp"])), atol=1e-12, rtol=0)
    out = vtrace(**{k: v.astype(np.float32) for k, v in x.items()}, rho_bar=rho_bar, c_bar=c_bar)
    assert out.vs.dtype == out.pg_advantages.dtype == out.rhos.dtype == torch.float32
    assert_close(out.vs, vs, atol=1e-4)
    assert_close(out.pg_advantages, pg, atol=1e-4)


def test_float32_and_float64_inputs_keep_their_dtype_and_mixing_them_is_an_error():
    """The caller's dtype is kept (as rlax does), in numpy or torch; a mix raises and names each dtype."""
    x = random_offpolicy(np.random.default_rng(11), 6, 2)
    for dtype in (torch.float32, torch.float64):
        out = vtrace(**{k: torch.as_tensor(v, dtype=dtype) for k, v in x.items()})
        assert {t.dtype for t in out} == {dtype}
        r2, d = vtrace_discounts_and_rewards(
            torch.as_tensor(x["rewards"], dtype=dtype),
            np.zeros((6, 2), bool),
            np.ones((6, 2), bool),
            torch.ones(6, 2, dtype=dtype),
            0.9,
        )
        assert r2.dtype == d.dtype == dtype
        w = truncated_importance_weights(torch.zeros(3, dtype=dtype), torch.zeros(3, dtype=dtype), clip=1.0)
        assert w.dtype == dtype
        g = gae(
            torch.zeros(3, 2, dtype=dtype),
            torch.zeros(3, 2, dtype=dtype),
            torch.zeros(3, 2, dtype=torch.bool),
            np.zeros((3, 2)),
            torch.zeros(2, dtype=dtype),
        )  # a mask's dtype does not count
        assert g.advantages.dtype == g.returns.dtype == dtype
    # Inputs without a dtype of their own (lists, numbers) take the others', else torch's default.
    assert gae([[1.0]], np.zeros((1, 1)), [[0]], [[0]], [0.0]).advantages.dtype == torch.float64
    assert gae([[1.0]], [[0.0]], [[0]], [[0]], [0.0]).advantages.dtype == torch.float32
    mixed = {**x, "rewards": x["rewards"].astype(np.float32)}
    with pytest.raises(ValueError, match="mixed float dtypes.*rewards float32.*values float64"):
        vtrace(**mixed)
    with pytest.raises(ValueError, match="bootstrap_value float32"):
        gae(np.zeros((3, 2)), np.zeros((3, 2)), np.zeros((3, 2)), np.zeros((3, 2)), torch.zeros(2))
    with pytest.raises(ValueError, match="truncation_value float64"):
        vtrace_discounts_and_rewards(torch.zeros(3, 2), np.zeros((3, 2)), np.zeros((3, 2)), np.zeros((3, 2)), 0.9)
    with pytest.raises(ValueError, match="behaviour_logp float64"):
        truncated_importance_weights(torch.zeros(2), torch.zeros(2, dtype=torch.float64), clip=1.0)


def test_vtrace_on_policy_is_bootstrapped_discounted_return():
    x = random_offpolicy(np.random.default_rng(5), 9, 3)
    x["target_logp"] = x["behaviour_logp"]
    out = vtrace(**x)
    ret, expected = x["bootstrap_value"], np.zeros((9, 3))
    for t in reversed(range(9)):  # n-step return, cut where discount = 0
        ret = x["rewards"][t] + x["discounts"][t] * ret
        expected[t] = ret
    assert_close(out.vs, expected, atol=1e-4)
    assert_close(out.rhos, np.ones((9, 3)))
    # pg adv = r_t + d_t vs_{t+1} - V_t, which on-policy is vs_t - V_t
    assert_close(out.pg_advantages, expected - x["values"], atol=1e-4)
    # and it equals GAE with lambda = 1 on the same episode ends
    term = x["discounts"] == 0
    g = gae(x["rewards"], x["values"], term, np.zeros_like(term), x["bootstrap_value"], gamma=0.9, gae_lambda=1.0)
    assert_close(out.vs, g.returns, atol=1e-4)


def test_vtrace_hand_computed_with_episode_end():
    # V = [1, 2, 3], V(x_3) = 4, r = [1, 1, 2], discounts = [.5, 0, .5], pi/mu = [2, .5, .25]
    # rho = c = [1, .5, .25] (rho_bar = c_bar = 1);  V(x_{t+1}) = [2, 3, 4]
    # delta0 = 1*(1 + .5*2 - 1) = 1;  delta1 = .5*(1 + 0 - 2) = -.5;  delta2 = .25*(2 + 2 - 3) = .25
    # vs2 = 3 + .25 = 3.25;  vs1 = 2 - .5 = 1.5 (discount 0: nothing from vs2 leaks back)
    # vs0 = 1 + 1 + .5*1*(1.5 - 2) = 1.75
    # pg0 = 1*(1 + .5*1.5 - 1) = .75;  pg1 = .5*(1 + 0 - 2) = -.5;  pg2 = .25*(2 + .5*4 - 3) = .25
    out = vtrace(
        col(0, 0, 0), torch.log(col(2, 0.5, 0.25)), col(1, 1, 2), col(0.5, 0, 0.5), col(1, 2, 3), torch.tensor([4.0])
    )
    assert_close(out.vs, [1.75, 1.5, 3.25])
    assert_close(out.pg_advantages, [0.75, -0.5, 0.25])
    assert_close(out.rhos, [1, 0.5, 0.25])


def test_vtrace_discounts_and_rewards_truncation():
    # gamma = .5; step 0 truncated (V(final) = 10 -> r' = 1 + 5), step 1 terminated, step 2 both
    # (termination wins: no bootstrap), step 3 ongoing.
    r2, d = vtrace_discounts_and_rewards(
        col(1, 2, 3, 4), col(0, 1, 1, 0), col(1, 0, 1, 0), col(10, NAN, NAN, NAN), gamma=0.5
    )
    assert_close(r2, [6, 2, 3, 4])
    assert_close(d, [0, 0, 0, 0.5])
    r2, d = vtrace_discounts_and_rewards(col(1, 2), col(0, 0), col(1, 0), None, gamma=0.5)
    assert_close(r2, [1, 2])
    assert_close(d, [0, 0.5])


def test_vtrace_truncation_equals_rollout_ending_at_final_obs():
    # Off-policy: truncating at t=3 with V(final) must give, for rows 0..3, exactly what V-trace
    # gives on the rollout cut there with bootstrap_value = V(final).
    rng, gamma, T = np.random.default_rng(7), 0.9, 8
    x = random_offpolicy(rng, T, 2, gamma)
    term, trunc = np.zeros((T, 2), bool), np.zeros((T, 2), bool)
    trunc[3] = True
    tv = rng.normal(size=(T, 2))
    r2, d = vtrace_discounts_and_rewards(x["rewards"], term, trunc, tv, gamma)
    full = vtrace(
        x["behaviour_logp"], x["target_logp"], r2, d, x["values"], x["bootstrap_value"], rho_bar=2.0, c_bar=1.0
    )
    head = vtrace(
        x["behaviour_logp"][:4],
        x["target_logp"][:4],
        x["rewards"][:4],
        np.full((4, 2), gamma),
        x["values"][:4],
        tv[3],
        rho_bar=2.0,
        c_bar=1.0,
    )
    assert_close(full.vs[:4], head.vs)
    assert_close(full.pg_advantages[:4], head.pg_advantages)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(behaviour_logp=np.zeros((3, 3))), "behaviour_logp"),
        (dict(discounts=np.zeros((4, 3, 1))), "discounts"),
        (dict(bootstrap_value=np.zeros((3, 1))), "bootstrap_value"),
        (dict(rho_bar=0.0), "rho_bar"),
    ],
)
def test_vtrace_bad_inputs_raise_value_error(change, match):
    args = {k: np.zeros((4, 3)) for k in ("behaviour_logp", "target_logp", "rewards", "discounts", "values")}
    with pytest.raises(ValueError, match=match):
        vtrace(**{**args, "bootstrap_value": np.zeros(3), **change})
    with pytest.raises(ValueError, match="truncation_value"):
        vtrace_discounts_and_rewards(np.zeros((4, 3)), np.zeros((4, 3)), np.zeros((4, 3)), np.zeros((4, 2)), 0.9)


# ---------------------------------------------------------------- truncated importance weights
def test_truncated_importance_weights_clip_and_no_grad():
    target = torch.log(torch.tensor([[0.5, 1.0], [2.0, 8.0]])).requires_grad_()
    w = truncated_importance_weights(target, torch.zeros(2, 2), clip=2.0)
    assert_close(w, [[0.5, 1.0], [2.0, 2.0]])
    assert not w.requires_grad
    assert_close(truncated_importance_weights(target, torch.zeros(2, 2), clip=100.0), [[0.5, 1.0], [2.0, 8.0]])
    with pytest.raises(ValueError, match="shape"):
        truncated_importance_weights(torch.zeros(3), torch.zeros(2), clip=1.0)
    with pytest.raises(ValueError, match="clip"):
        truncated_importance_weights(torch.zeros(2), torch.zeros(2), clip=0.0)
