"""Async PPO and IMPALA: importance weights, V-trace batches, and the learner's staleness rule."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from loguru import logger

from fakes import FakeChannel, FakeLink
from samples import rollout_of
from zddrl import protocol as P
from zddrl.algos.impala.learner import ImpalaLearner, stack_time_major
from zddrl.algos.ppo.learner import PPOLearner
from zddrl.algos.rollout import mismatch
from zddrl.config import Config, run_kind
from zddrl.envs import EnvSpec
from zddrl.learner.ledger import HASHES_KEPT, LAG_WINDOW, Ledger
from zddrl.learner.node import publish_due
from zddrl.learner.poll import ShardPoller
from zddrl.learner.rounds import AsyncStream
from zddrl.shards.group import ShardGroup

SPEC = EnvSpec((4,), True, 2)


def trajectory(
    T: int,
    N: int,
    peer_id: str = "a",
    seq: int = 0,
    version: int = 0,
    logp: float = -0.69,
    trunc_at: tuple[int, int] | None = (1, 0),
) -> P.Trajectory:
    """samples.rollout_of with this module's defaults: env 0 truncated at step 1, one episode of return 10 ended."""
    return rollout_of(peer_id, seq, version, T, N, logp=logp, trunc_at=trunc_at, ep_returns=(10.0,))


def test_stack_time_major_maps_truncation_indices_to_global_columns() -> None:
    a, b = trajectory(3, 2, seq=1, trunc_at=(2, 1)), trajectory(3, 3, seq=2, trunc_at=(1, 2))
    tm = stack_time_major([a, b], [a.arrays["rewards"], b.arrays["rewards"]])
    assert tm.obs.shape == (3, 5, 4) and tm.next_obs.shape == (5, 4)
    # a: t=2, column 1 -> 2*5 + 1 = 11; b: t=1, column 2 + offset 2 -> 1*5 + 4 = 9
    np.testing.assert_array_equal(tm.trunc_index, [11, 9])
    assert tm.truncated.reshape(-1)[tm.trunc_index].all() and tm.truncated.sum() == 2
    np.testing.assert_array_equal(tm.trunc_obs[:, 0], [1.0, 2.0])
    with pytest.raises(ValueError, match="share their length"):
        stack_time_major([a, trajectory(4, 2)], [a.arrays["rewards"], np.ones((4, 2))])


def test_async_ppo_weights_are_one_on_policy_and_truncated_off_policy() -> None:
    core = PPOLearner(Config().replace({"algo.name": "ppo", "algo.schedule": "async", "algo.rho_bar": 1.0}), SPEC)
    on = trajectory(8, 2)
    with torch.no_grad():
        obs = torch.as_tensor(on.arrays["obs"].reshape(16, 4))
        current = core.model.evaluate(obs, torch.as_tensor(on.arrays["actions"].reshape(16)))[0].numpy()
    on.arrays["logp"][:] = current.reshape(8, 2)  # behaviour == current network: fresh data
    batch = core.make_batch([on])
    torch.testing.assert_close(batch.weights, torch.ones(16))
    off = trajectory(8, 2, logp=-5.0)  # very unlikely under the behaviour policy -> ratio >> 1 -> clipped
    assert torch.all(core.make_batch([off]).weights == 1.0)
    rare = trajectory(8, 2, logp=-1e-3)  # behaviour was nearly certain: pi/mu ~ 0.5 < rho_bar
    w = core.make_batch([rare]).weights
    assert torch.all(w < 0.75) and torch.all(w > 0.25)


def test_impala_update_reports_vtrace_figures() -> None:
    core = ImpalaLearner(Config().replace({"algo.name": "impala", "algo.minibatches": 2}), SPEC)
    figures = core.update([trajectory(16, 4, seq=1), trajectory(16, 4, "b", seq=2)])
    assert figures["batch_steps"] == 128
    for key in ("policy_loss", "value_loss", "entropy", "grad_norm", "rho_mean", "lr"):
        assert np.isfinite(figures[key]), key


def stream(config: Config, messages: list[P.Trajectory]) -> tuple[AsyncStream, Ledger, FakeChannel]:
    """The async collector of a single learner, fed ``messages`` through a fake data channel."""
    channel, ledger = FakeChannel(messages), Ledger(config, logger, time.time())
    T = config.env.rollout_len if config.algo.name == "impala" else None
    poller = ShardPoller(FakeLink(), lambda: channel, "r", ShardGroup(), lambda m: mismatch(m.arrays, SPEC, T), logger)
    return AsyncStream(poller, config, ledger), ledger, channel


@pytest.mark.parametrize("mode", ["async", "impala"])
def test_stream_drops_data_older_than_max_staleness_and_counts_it(mode: str) -> None:
    config = Config().replace(
        {
            **run_kind(mode),
            "algo.batch_size": 64,
            "bus.max_staleness": 2,
            "train.max_steps": 10_000,
            "env.rollout_len": 8,
        }
    )
    wrong_obs = trajectory(8, 4, "wrong-obs", 0, version=5)
    wrong_obs.arrays["obs"] = np.zeros((8, 4, 3), np.float32)  # CartPole observations have 4 numbers
    other_length = [trajectory(16, 4, "other-length", 0, version=5)] if mode == "impala" else []
    msgs = [
        trajectory(8, 4, "fresh", 0, version=5),
        wrong_obs,
        trajectory(8, 4, "old", 1, version=2),
        trajectory(8, 4, "future", 3, version=7),
        *other_length,
        trajectory(8, 4, "ok", 2, version=3),
    ]
    collector, ledger, channel = stream(config, msgs)
    got = collector.collect(threading.Event(), version=5)
    assert not got.stopped and sorted(t.peer_id for t in got.batch) == ["fresh", "ok"]
    assert ledger.progress.dropped_stale == {"old": 1, "future": 1}
    # Data this run cannot train on is counted per actor and never trained on; IMPALA stacks rollouts
    # time-major, so there a rollout of another length cannot join the batch (PPO takes any length).
    assert ledger.progress.dropped_invalid == {"wrong-obs": 1, **({"other-length": 1} if other_length else {})}
    assert channel.granted == len(msgs)
    assert ledger.lag == {"fresh": 0, "old": 3, "ok": 2, "future": -2}
    assert got.figures == {"staleness_mean": 1.0, "staleness_max": 2, "staleness_hist": "0:32 2:32"}
    assert got.staleness == 1.0 and got.actors == 2
    row = ledger.row({"batch_steps": 64, **got.figures}, policy_version=6)
    assert row["staleness_hist"] == "0:32 2:32" and row["dropped_stale"] == 2
    assert row["dropped_invalid"] == sum(ledger.progress.dropped_invalid.values())


def test_async_modes_publish_every_k_updates_and_sync_every_round() -> None:
    assert [publish_due("async", u, 2) for u in range(1, 6)] == [False, True, False, True, False]
    assert all(publish_due("sync", u, 5) for u in range(1, 6))


def test_growing_median_lag_raises_a_warning() -> None:
    ledger = Ledger(Config().replace({"algo.name": "impala"}), logger, time.time())
    lines: list[str] = []
    sink = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        for _ in range(LAG_WINDOW - 1):  # steady lag: no warning
            ledger.lag = {"a": 1, "b": 1}
            ledger.watch_lag()
        assert lines == []
        ledger.lag_medians.clear()
        for lag in range(LAG_WINDOW):  # the actors fall one version further behind at every update
            ledger.lag = {"a": lag, "b": lag, "c": 0}
            ledger.watch_lag()
    finally:
        logger.remove(sink)
    assert any("median actor lag keeps growing" in line for line in lines)


def test_the_ledger_remembers_a_bounded_number_of_published_hashes() -> None:
    ledger = Ledger(Config(), logger, time.time())
    for version in range(HASHES_KEPT * 4):  # a long run publishes millions of versions
        ledger.published(version, f"{version:016x}")
    assert len(ledger.hashes) == HASHES_KEPT and min(ledger.hashes) == HASHES_KEPT * 3


def test_publish_every_beyond_the_staleness_bound_is_refused() -> None:
    from zddrl.config import ConfigError

    with pytest.raises(ConfigError, match="publish_every"):
        Config().replace(
            {"algo.name": "ppo", "algo.schedule": "async", "learner.publish_every": 6, "bus.max_staleness": 4}
        )
    Config().replace({"algo.name": "ppo", "algo.schedule": "async", "learner.publish_every": 5, "bus.max_staleness": 4})


def test_a_step_without_samples_anywhere_is_not_taken() -> None:
    """IMPALA minibatches split env columns: 2 columns in 4 minibatches leave 2 steps per epoch empty.
    An empty step must not move the weights (Adam's momentum would) nor count as an optimizer step."""
    from zddrl.algos.impala.learner import ImpalaLearner

    core = ImpalaLearner(Config().replace({"algo.name": "impala", "algo.minibatches": 4, "algo.epochs": 3}), SPEC)
    figures = core.update([trajectory(8, 2)])
    assert core.optimizer.steps == 3 * 2 and np.isfinite(figures["grad_norm"])
