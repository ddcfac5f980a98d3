"""Issue 13, attack 3: "one in-spec 262k-step rollout (9.5 MiB) costs the learner 7 s and +640 MB". A rollout may
hold at most ROLLOUT_SLACK times the steps its sender was asked for, and one from a version never published is
refused; both are judged from shapes and header numbers, before any array is read (``learner/admit.py``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from loguru import logger

from fakes import FakeChannel, FakeLink
from samples import rollout_of
from zddrl.config import Config
from zddrl.learner.admit import ROLLOUT_SLACK, AskedLengths, envs_of, refusal
from zddrl.learner.node import LearnerNode
from zddrl.learner.poll import ShardPoller
from zddrl.learner.rounds import SyncRounds
from zddrl.shards.group import ShardGroup

BIG = 1 << 18  # 262,144 steps of one CartPole env: ~9.5 MiB on the wire


def test_refusal_bounds_steps_per_env_and_in_all_by_what_was_asked() -> None:
    assert refusal((8, 4), 3, 3, 8, 4) == "" == refusal((ROLLOUT_SLACK * 8, 4), 0, 3, 8, 4)
    assert "over 2 x the 8" in refusal((ROLLOUT_SLACK * 8 + 1, 1), 3, 3, 8, 4)
    assert "the 8 x 4 the run asked of this actor" in refusal((8, 9), 3, 3, 8, 4)  # 72 > 2 x 32 steps
    assert refusal((4, 16), 3, 3, 8, 4) == ""  # fewer steps per env, more envs: within 2 x its share
    assert "not one of the published 0..3" in refusal((8, 4), 4, 3, 8, 4)  # a version from the future
    assert "not one of the published 0..3" in refusal((8, 4), -1, 3, 8, 4)


def test_an_actors_envs_come_from_the_fleet_message() -> None:
    fleet = (1, {"a": {"num_envs": 16, "host": "h"}, "b": {"num_envs": 0, "host": "h"}})
    assert envs_of("a", fleet, 4) == 16 and envs_of("b", fleet, 4) == 4
    assert envs_of("new", fleet, 4) == 16  # not announced yet: the most any listed actor has
    assert envs_of("new", None, 4) == 4


def test_the_bound_is_the_longest_length_of_the_latest_versions() -> None:
    lengths = AskedLengths(32)
    for n in (8, 8, 4):
        lengths.asked(n)
    assert lengths.most() == 32  # a straggler's rollout of the version that asked 32 is late, not too big
    for _ in range(16):
        lengths.asked(4)
    assert lengths.most() == 4


@pytest.fixture
def node(tmp_path):
    """A sync learner node of a CartPole run, wired as ``_join`` wires it, without a broker."""
    config = Config().replace({"algo.batch_size": 16, "env.rollout_len": 8})
    n = LearnerNode("tcp://127.0.0.1:9", config, tmp_path / "run")
    n.own = n.open_run()
    n.link = FakeLink({"a": 1, "b": 1})
    n.own.fleet.refresh(n.link.fleet())  # two actors of one env: 8 steps each make the batch of 16
    n.rollout_len = n.own.fleet.rollout_len
    channel = FakeChannel()
    n.poller = ShardPoller(
        n.link, lambda: channel, "r", ShardGroup(), n._mismatch, logger, n._asked_len, admit=n._admit
    )
    yield n, channel
    n.own.runlog.close()


def test_a_rollout_far_bigger_than_asked_is_refused_before_it_is_read(node) -> None:
    n, channel = node
    fleet, ledger = n.own.fleet, n.own.ledger
    rounds = SyncRounds(n.poller, n.config.algo, logger, fleet, ledger, lambda: fleet.refresh(n.link.fleet()))
    channel.messages.extend([rollout_of("a", 0, 0, T=BIG, N=1), rollout_of("b", 0, 0, T=8, N=1)])
    lines: list[str] = []
    sink = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        t0 = time.monotonic()
        got = rounds.collect(threading.Event(), 0)
        elapsed = time.monotonic() - t0
    finally:
        logger.remove(sink)
    assert [t.peer_id for t in got.batch] == ["b"] and elapsed < 1.0
    assert dict(ledger.progress.dropped_invalid) == {"a": 1} and ledger.env_steps() == 8
    assert any("from a (seq 0)" in line and f"a rollout of {BIG} steps per env" in line for line in lines), lines
    assert fleet.stragglers == set()  # a refused rollout is an answer: the round did not wait for a


def test_a_rollout_of_a_version_never_published_is_refused(node) -> None:
    n, _ = node
    assert "not one of the published 0..0" in n._admit(rollout_of("a", 0, 7, T=8, N=1))
    assert n._admit(rollout_of("a", 0, 0, T=8, N=1)) == ""


def test_the_main_shard_hands_the_asked_length_to_the_others() -> None:
    main_part = {"records": [], "stop": False, "control": {"stop": False}, "asked_len": 64}
    group = SimpleNamespace(sharded=True, is_main=False, exchange=lambda mine: [main_part, mine])
    poller = ShardPoller(FakeLink(), FakeChannel, "r", group, lambda m: "", logger, None, 8)  # type: ignore[arg-type]
    assert poller.asked_len == 8
    poller.poll(threading.Event(), {}, lambda m: True, [])
    assert poller.asked_len == 64
