"""Issue 28: "two rollouts of 1e4-reward steps ended a run with until_return = 100000 as reached: true". Training
returns are sums of the actors' rewards; with ``target_kind = "train"`` the learner's own evaluation confirms a
target before the run stops (``ledger.Ledger``, ``train.confirm_target``)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from loguru import logger

from fakes import FakeChannel, FakeLink
from samples import rollout_of
from zddrl import protocol as P
from zddrl.config import Config
from zddrl.learner.ledger import CONFIRM_SHARE, Ledger
from zddrl.learner.node import LearnerNode
from zddrl.learner.poll import ShardPoller
from zddrl.learner.rounds import SyncRounds
from zddrl.shards.group import ShardGroup

T = 32


def episode(n: LearnerNode, peer: str, v: int, reward: float) -> P.Trajectory:
    """One rollout of ``T`` steps of one env acting with version ``v``, every step paying ``reward``, an episode
    ending at its last step (so each rollout completes one episode of return ``T * reward``)."""
    t = rollout_of(peer, v, v, T=T, N=1)
    terminated = np.zeros((T, 1), bool)
    terminated[-1, 0] = True
    arrays = {**t.arrays, "rewards": np.full((T, 1), reward, np.float32), "terminated": terminated}
    return P.Trajectory(**{**t.__dict__, "arrays": arrays, "param_hash": n.own.ledger.hashes[v]})


@pytest.fixture
def lines():
    got: list[str] = []
    sink = logger.add(got.append, level="INFO", format="{message}")
    yield got
    logger.remove(sink)


def forged_run(tmp_path, confirm_target: bool, rounds: int = 12) -> tuple[LearnerNode, list[float]]:
    """A sync CartPole learner node (no broker: fakes) of two one-env actors; ``thief`` sends rewards of 1e4."""
    config = Config().replace(
        {
            "algo.batch_size": 2 * T,
            "env.rollout_len": T,
            "train.until_return": 1e5,
            "train.confirm_target": confirm_target,
        }
    )
    n = LearnerNode("tcp://127.0.0.1:9", config, tmp_path / "run")
    n.own = own = n.open_run()
    n.link = FakeLink({"honest": 1, "thief": 1})
    own.fleet.refresh(n.link.fleet())
    channel = FakeChannel()
    n.poller = ShardPoller(
        n.link, lambda: channel, "r", ShardGroup(), n._mismatch, logger, n._asked_len, admit=n._admit
    )
    confirmed: list[float] = []
    real = own.ledger.confirm
    own.ledger.confirm = lambda: confirmed.append(real()) or confirmed[-1]
    n._publish()
    collector = SyncRounds(n.poller, n.config, logger, own.fleet, own.ledger, n._refresh_fleet)
    for v in range(rounds):
        channel.messages.extend([episode(n, "honest", v, 1.0), episode(n, "thief", v, 1e4)])
        if not n._step(collector.collect(threading.Event(), n.policy_version)):
            break
    return n, confirmed


def test_one_actors_rewards_do_not_end_a_run(tmp_path, lines) -> None:
    n, confirmed = forged_run(tmp_path, confirm_target=True)
    ledger = n.own.ledger
    try:
        assert ledger.return_mean() > 1e5  # the forged episodes are in the training return...
        assert not ledger.finished() and not ledger.summary()["reached"]  # ...but did not end the run
        assert confirmed and all(0 < r <= 500 for r in confirmed)  # the learner's own CartPole episodes
        assert ledger.progress.eval_return == confirmed[-1]
        assert len([line for line in lines if "not confirmed, the run goes on" in line]) == 1  # aggregated
    finally:
        n.own.runlog.close()


def test_without_the_confirmation_the_same_rewards_end_the_run(tmp_path) -> None:
    """What the confirmation prevents (``train.confirm_target = false``: a fleet one fully trusts)."""
    n, confirmed = forged_run(tmp_path, confirm_target=False)
    try:
        assert n.own.ledger.finished() and n.own.ledger.summary()["reached"] and not confirmed
    finally:
        n.own.runlog.close()


def ledger_at(value: float, confirm, **train) -> Ledger:
    """A ledger whose training return (the last 20 episodes) is ``value``."""
    config = Config().replace({"train.until_return": 475.0, **{f"train.{k}": v for k, v in train.items()}})
    ledger = Ledger(config, logger, time.time(), confirm=confirm)
    ledger.progress.add_episodes([value] * 20)
    return ledger


def test_an_honest_target_is_confirmed_at_the_row_that_reaches_it(lines) -> None:
    ledger = ledger_at(480.0, lambda: 500.0)
    row = ledger.row({"batch_steps": 256}, policy_version=7)
    assert ledger.finished() and ledger.summary()["return_at_target"] == 480.0 and row["eval_return"] == 500.0
    assert any("confirmed by the learner's own evaluation: 500.0" in line for line in lines), lines


def test_a_failed_confirmation_is_retried_within_its_share_of_the_learners_time() -> None:
    calls: list[float] = []
    took: list[float] = []

    def slow_short() -> float:
        calls.append(time.monotonic())
        time.sleep(0.02)
        took.append(time.monotonic() - calls[-1])  # a busy machine's sleep runs long: the wait follows
        return 400.0

    ledger = ledger_at(480.0, slow_short)
    ledger.row({}, policy_version=1)
    ledger.row({}, policy_version=2)  # at once: within the wait, not evaluated again
    assert len(calls) == 1 and not ledger.finished()
    time.sleep(took[0] / CONFIRM_SHARE + 0.05)
    ledger.row({}, policy_version=3)
    assert len(calls) == 2 and not ledger.finished()


def test_no_confirmation_for_an_eval_target_or_below_the_target() -> None:
    never = lambda: pytest.fail("evaluated")  # noqa: E731
    ledger_at(400.0, never).row({}, policy_version=1)  # the training return is not there yet
    evaluated = ledger_at(480.0, never, target_kind="eval", eval_every=1000)
    evaluated.progress.eval_return = 490.0
    evaluated.row({}, policy_version=1)
    assert evaluated.finished()
    unconfirmable = ledger_at(480.0, None)
    unconfirmable.row({}, policy_version=1)
    assert not unconfirmable.finished()  # nothing to confirm with: never by the actors' numbers alone
