"""Issue 13, attack 1: "a rollout whose log-probs are -3e38 makes every optimizer step skip while versions keep
rising". The learner refuses such log-probabilities before they reach a batch (``rollout.mismatch``), and every
ratio the cores form from log-probabilities is bounded (``returns.LOG_RATIO_BOUND``), so that even a batch that
carries one still takes its steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from samples import rollout_of
from zddrl.algos.impala.learner import ImpalaLearner
from zddrl.algos.ppo.learner import PPOLearner, ppo_loss
from zddrl.algos.returns import LOG_RATIO_BOUND, truncated_importance_weights, vtrace
from zddrl.algos.rollout import LOGP_BOUND, mismatch
from zddrl.config import Config
from zddrl.envs import EnvSpec

SPEC = EnvSpec((4,), True, 2)
BOX = EnvSpec((4,), False, 2, action_low=(-1.0, -1.0), action_high=(1.0, 1.0))
POISON = -3e38


def poisoned(T: int = 8, N: int = 2, seq: int = 0):
    """A CartPole-shaped rollout whose env 0 carries behaviour log-probabilities of -3e38."""
    t = rollout_of("a", seq, 0, T, N)
    t.arrays["logp"][:, 0] = POISON
    return t


@pytest.mark.parametrize("logp", [POISON, -2 * LOGP_BOUND, -math.inf])
def test_implausible_discrete_log_probabilities_are_refused(logp: float) -> None:
    t = poisoned()
    t.arrays["logp"][0, 1] = logp
    assert mismatch(t.arrays, SPEC) != ""
    assert mismatch(rollout_of("a", 0, 0, 8, 2, logp=-LOGP_BOUND + 1).arrays, SPEC) == ""  # rare, but possible


def test_implausible_continuous_log_probabilities_are_refused() -> None:
    t = rollout_of("a", 0, 0, 4, 2)
    arrays = {**t.arrays, "actions": np.zeros((4, 2, 2), np.float32)}
    assert mismatch({**arrays, "logp": np.full((4, 2), 5.0, np.float32)}, BOX) == ""  # a density may exceed 1
    for logp in (POISON, -POISON):
        assert "implausible behaviour log-probabilities" in mismatch(
            {**arrays, "logp": np.full((4, 2), logp, np.float32)}, BOX
        )


def test_sync_ppo_takes_every_step_on_a_batch_with_poisoned_log_probabilities() -> None:
    """Behind the admission check: even if such a rollout reached the core, no step may be skipped."""
    config = Config().replace({"algo.name": "ppo", "algo.schedule": "sync", "algo.epochs": 2, "algo.minibatches": 2})
    core = PPOLearner(config, SPEC)
    before = [p.detach().clone() for p in core.model.parameters()]
    figures = core.update([poisoned(), rollout_of("b", 0, 0, 8, 2)])
    assert core.skipped_steps == 0 and core.optimizer.steps == 4
    assert math.isfinite(figures["policy_loss"]) and math.isfinite(figures["grad_norm"])
    moved = False
    for old, new in zip(before, core.model.parameters()):
        assert torch.isfinite(new).all()
        moved |= not torch.equal(old, new)
    assert moved


def test_the_poisoned_samples_pass_no_gradient_and_the_others_are_unchanged() -> None:
    """With the log-ratio beyond the bound the ratio is a constant: the loss's gradient is that of the other
    samples alone (computed here without the poisoned ones, as a reference)."""
    torch.manual_seed(0)
    logits = torch.randn(6, requires_grad=True)
    logp = torch.nn.functional.logsigmoid(logits)
    old = torch.tensor([POISON, -0.7, -0.6, POISON, -0.9, -0.5])
    adv = torch.tensor([-1.0, 0.5, -0.3, 2.0, 1.0, -2.0])
    zeros = torch.zeros(6)

    def policy_grad(idx: list[int]) -> torch.Tensor:
        loss, _ = ppo_loss(logp[idx], old[idx], adv[idx], zeros[idx], zeros[idx], zeros[idx], zeros[idx], 0.2, 0, 0)
        (grad,) = torch.autograd.grad(loss * len(idx), logits, retain_graph=True)
        return grad

    everything, clean = policy_grad(list(range(6))), policy_grad([1, 2, 4, 5])
    assert torch.isfinite(everything).all()
    torch.testing.assert_close(everything, clean)


def test_every_ratio_is_bounded_by_the_documented_log_ratio_bound() -> None:
    pi = torch.tensor([[-0.5, -0.5, -0.5]])
    mu = torch.tensor([[POISON, -0.5, 3e38]])  # log-ratios +3e38, 0, -3e38
    w = truncated_importance_weights(pi, mu, clip=1e12)
    torch.testing.assert_close(w, torch.tensor([[math.exp(LOG_RATIO_BOUND), 1.0, math.exp(-LOG_RATIO_BOUND)]]))
    vt = vtrace(mu, pi, torch.ones(1, 3), torch.full((1, 3), 0.9), torch.zeros(1, 3), torch.zeros(3), 1e12, 1e12)
    torch.testing.assert_close(vt.rhos, w)
    assert torch.isfinite(vt.vs).all() and torch.isfinite(vt.pg_advantages).all()


def test_impala_and_async_ppo_take_every_step_on_poisoned_log_probabilities() -> None:
    for core in (
        ImpalaLearner(Config().replace({"algo.name": "impala", "algo.minibatches": 2}), SPEC),
        PPOLearner(Config().replace({"algo.name": "ppo", "algo.schedule": "async", "algo.minibatches": 2}), SPEC),
    ):
        figures = core.update([poisoned(), rollout_of("b", 0, 0, 8, 2)])
        assert core.skipped_steps == 0 and math.isfinite(figures["grad_norm"])
        assert all(torch.isfinite(p).all() for p in core.model.parameters())
