"""Nothing the learner keeps grows with the update count: a multi-day run makes millions of updates.

The per-update path (collect through the poller, the PPO update, splitting a version for publishing, the
ledger's row) runs a few hundred times to warm up, then tracemalloc compares the heap after many more.
Before the ledger's hashes were bounded, each update kept ~170 bytes (~11 MB after 63k updates).

The measurement runs in a fresh interpreter: tracemalloc counts every thread's allocations, and in the full suite's
process it read 167 and 183 KiB (twice, against ~50 KiB alone then) from what earlier tests leave running there."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from loguru import logger

from fakes import FakeChannel, FakeLink
from samples import rollout_of
from zddrl.algos.ppo.learner import PPOLearner
from zddrl.config import Config
from zddrl.envs import probe_spec
from zddrl.learner.fleet import FleetPlan
from zddrl.learner.ledger import HASHES_KEPT, Ledger
from zddrl.learner.poll import ShardPoller
from zddrl.learner.rounds import SyncRounds
from zddrl.shards.group import ShardGroup
from zddrl.transport.params import split

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # a memory measurement: alone (tests/phases.py)

HERE = Path(__file__).resolve().parent


def test_the_update_path_keeps_no_memory_per_update() -> None:
    path = f"{HERE.parent}:{HERE}"
    code = "import test_memory; print(test_memory.grown_over_updates())"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    grown = int(proc.stdout.split()[-1])
    # Measured (2026-12-02): 26-28 KiB of noise; keeping one more hash string per update (~80 bytes) 126 KiB; the
    # ledger's old leak (~170 bytes per update) would add ~200 KiB over these 1,200 updates.
    assert grown < 96 * 1024, f"{grown / 1024:.0f} KiB kept over 1,200 updates"


def grown_over_updates() -> int:
    """Bytes the heap grew over 1,200 updates after a warm-up (the update path of one PPO shard)."""
    config = Config().replace({"algo.batch_size": 64, "algo.epochs": 1, "algo.minibatches": 1})
    core = PPOLearner(config, probe_spec("CartPole-v1"), ShardGroup())
    link, channel = FakeLink({"a": 4, "b": 4}), FakeChannel()
    ledger, fleet = Ledger(config, logger, time.time()), FleetPlan(4, 64, 8, logger)
    poller = ShardPoller(link, lambda: channel, "r", ShardGroup(), lambda m: "", logger)
    rounds = SyncRounds(poller, config, logger, fleet, ledger, lambda: fleet.refresh(link.fleet()))

    def update(v: int) -> None:
        channel.messages.extend([rollout_of("a", v, v, T=8, N=4), rollout_of("b", v, v, T=8, N=4)])
        core.update(rounds.collect(threading.Event(), v).batch)
        flat, layout, extra = core.params()
        head, *_ = split(
            run_id="r",
            peer_id="learner-0",
            version=v + 1,
            flat=flat,
            layout=layout,
            extras=extra,
            meta={},
            chunk_bytes=1 << 20,
            dtype="float32",
        )
        ledger.published(v + 1, head.param_hash)
        poller.send_params([head])
        channel.sent.clear()
        ledger.row({"batch_steps": 64}, policy_version=v + 1)

    # Traced from the start: the warm-up fills the bounded state (the ledger's last HASHES_KEPT hashes) with traced
    # allocations, so replacing them later nets to zero instead of counting as growth.
    tracemalloc.start()
    try:
        for v in range(HASHES_KEPT + 50):
            update(v)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for v in range(HASHES_KEPT + 50, HASHES_KEPT + 1250):
            update(v)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return grown
