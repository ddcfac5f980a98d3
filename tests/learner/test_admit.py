"""Issue 13, attack 3: "one in-spec 262k-step rollout (9.5 MiB) costs the learner 7 s and +640 MB". A rollout may
hold at most ROLLOUT_SLACK times the steps its sender was asked for, and one from a version never published is
refused; both are judged from shapes and header numbers, before any array is read (``intake/admit.py``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from loguru import logger

from fakes import FakeChannel, FakeLink
from samples import rollout_of
from zddrl.config import Config
from zddrl.intake.admit import ROLLOUT_SLACK, AskedLengths, envs_bound, envs_of, refusal
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
    assert envs_of("a", fleet, 4, 64) == 16 and envs_of("b", fleet, 4, 64) == 4
    assert envs_of("new", fleet, 4, 64) == 16  # not announced yet: the most any listed actor has
    assert envs_of("new", None, 4, 64) == 4


def test_a_claimed_env_count_is_bounded_by_the_run() -> None:
    """Issue 28: "a hello with num_envs = 1048576, then one 262k-step rollout" was admitted: the bound came from the
    sender's own claim. Now the claim counts at most ``train.max_actor_envs`` (0: 16 x env.num_envs)."""
    huge = (1, {"thief": {"num_envs": 1 << 20, "host": "h"}})
    assert envs_bound(Config()) == 64 and envs_of("thief", huge, 4, 64) == 64
    assert envs_of("new", huge, 4, 64) == 64  # an actor not listed yet borrows no more than the bound either
    assert envs_bound(Config().replace({"train.max_actor_envs": 512})) == 512
    assert envs_bound(Config().replace({"train.max_actor_envs": 2, "env.num_envs": 8})) == 8  # never below the run's
    assert "over 2 x the 32 x 64" in refusal((1, BIG), 0, 0, 32, envs_of("thief", huge, 4, 64))
    assert refusal((1, 2 * 32 * 64), 0, 0, 32, 64) == ""  # 4,096 steps: what the bound allows, not 262k


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
    rounds = SyncRounds(n.poller, n.config, logger, fleet, ledger, lambda: fleet.refresh(n.link.fleet()))
    rounds.report_times["b"].extend([0.001] * 3)  # a known normal round: the straggler timeout is its 50 ms floor
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
    assert fleet.stragglers == {"a"}  # a refused rollout is no answer (issue 28): a missed the round


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


def test_a_claim_of_a_million_envs_gets_no_huge_rollout_through_the_learner(node) -> None:
    """Issue 28: "a hello with num_envs = 1048576, then one 262k-step rollout: the learner published no version for
    18 s and grew by 716 MB". The node's own check, with the broker's fleet message listing that claim."""
    n, _ = node
    n.link.set_actors({"a": 1, "b": 1, "thief": 1 << 20})
    assert "the 8 x 64 the run asked of this actor" in n._admit(rollout_of("thief", 0, 0, T=1, N=BIG))
    assert "the 8 x 64" in n._admit(rollout_of("thief", 0, 0, T=8, N=2 * 64 + 1))
    assert n._admit(rollout_of("thief", 0, 0, T=8, N=2 * 64)) == ""  # 1,024 steps: the most one actor may send
