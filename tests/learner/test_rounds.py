"""Sync rounds against a fake link and data channel: when a round closes, who becomes a straggler and
when it is back, how rollouts are sized from the fleet, and how straggler events are logged."""

from __future__ import annotations

import threading
import time

import pytest
from loguru import logger

from fakes import FakeChannel, FakeLink
from samples import rollout_of
from zddrl import protocol as P
from zddrl.config import Config
from zddrl.learner.fleet import FleetPlan
from zddrl.learner.ledger import Ledger
from zddrl.learner.poll import ShardPoller
from zddrl.learner.rounds import SyncRounds
from zddrl.shards.group import ShardGroup


class Rig:
    """SyncRounds of a single (main) learner over a FakeLink whose fleet is ``actors``."""

    def __init__(self, actors: dict[str, int], batch_size: int = 10**6, **algo) -> None:
        self.config = Config().replace({"algo.batch_size": batch_size, **{f"algo.{k}": v for k, v in algo.items()}})
        self.link, self.channel = FakeLink(actors), FakeChannel()
        self.lines: list[str] = []
        self.sink = logger.add(self.lines.append, level="INFO", format="{message}")
        self.ledger = Ledger(self.config, logger, time.time())
        self.fleet = FleetPlan(1, batch_size, 8, logger)
        poller = ShardPoller(self.link, lambda: self.channel, "r", ShardGroup(), lambda m: "", logger)
        self.rounds = SyncRounds(
            poller, self.config.algo, logger, self.fleet, self.ledger, lambda: self.fleet.refresh(self.link.fleet())
        )

    def round(self, version: int, *messages: P.Trajectory):
        self.channel.messages.extend(messages)
        return self.rounds.collect(threading.Event(), version)

    def close(self) -> None:
        logger.remove(self.sink)


@pytest.fixture
def rig():
    made: list[Rig] = []
    yield lambda *a, **k: made.append(Rig(*a, **k)) or made[-1]
    for r in made:
        r.close()


def test_a_round_closes_once_every_actor_reported_and_late_data_is_dropped(rig) -> None:
    r = rig({"a": 1, "b": 1})
    got = r.round(3, rollout_of("a", 0, 3), rollout_of("b", 0, 2), rollout_of("b", 1, 3), rollout_of("a", 1, 3))
    assert sorted(t.peer_id for t in got.batch) == ["a", "b"] and got.actors == 2 and not got.stopped
    assert r.ledger.progress.dropped_late == {"b": 1}
    assert [(m.peer_id, m.seq) for m in r.channel.messages] == [("a", 1)]  # the rest waits for the next poll
    assert r.fleet.stragglers == set()


def test_a_silent_actor_becomes_a_straggler_then_returns_to_the_quota(rig) -> None:
    r = rig({"a": 1, "b": 1}, min_round_timeout_s=0.05)
    r.rounds.report_times["a"].extend([0.001] * 3)  # a known typical time: the straggler timeout is its floor, 50 ms
    got = r.round(3, rollout_of("a", 0, 3))
    assert [t.peer_id for t in got.batch] == ["a"]
    assert r.fleet.stragglers == {"b"} and r.fleet.expected() == {"a"}
    # b's rollout of version 3 arrives during round 4: one version late, so dropped but back in the quota.
    got = r.round(4, rollout_of("b", 0, 3), rollout_of("a", 1, 4))
    assert [t.peer_id for t in got.batch] == ["a"] and r.ledger.progress.dropped_late == {"b": 1}
    got = r.round(5, rollout_of("a", 2, 5), rollout_of("b", 1, 5))
    assert sorted(t.peer_id for t in got.batch) == ["a", "b"] and r.fleet.stragglers == set()
    straggler_lines = [line for line in r.lines if "stragglers since the last such line" in line]
    assert len(straggler_lines) == 1 and "b x1" in straggler_lines[0]  # aggregated: not one line per round


def test_rollouts_are_sized_so_that_the_fleet_makes_one_batch(rig) -> None:
    r = rig({"a": 4, "b": 4}, batch_size=64)
    r.fleet.refresh(r.link.fleet())
    assert r.fleet.rollout_len == 8  # 64 steps over 8 envs
    r.link.set_actors({"a": 4, "b": 4, "c": 8})  # an actor joins: the next rollouts are shorter
    assert r.fleet.refresh(r.link.fleet()) and r.fleet.rollout_len == 4  # 64 steps over 16 envs
    got = r.round(0, rollout_of("a", 0, 0, T=4, N=4), rollout_of("b", 0, 0, T=4, N=4), rollout_of("c", 0, 0, T=4, N=8))
    assert got.actors == 3 and r.fleet.stragglers == set() and r.fleet.rollout_len == 4
    r.link.set_actors({"a": 4, "b": 4})  # c leaves
    r.fleet.refresh(r.link.fleet())
    assert r.fleet.rollout_len == 8


def test_an_actor_that_joins_when_the_batch_is_already_full_is_a_straggler_until_it_keeps_up(rig) -> None:
    r = rig({"a": 4, "b": 4}, batch_size=64)
    r.fleet.refresh(r.link.fleet())
    r.link.set_actors({"a": 4, "b": 4, "c": 8})
    got = r.round(0, rollout_of("a", 0, 0, T=8, N=4), rollout_of("b", 0, 0, T=8, N=4))  # full before c reports
    assert got.actors == 2 and r.fleet.stragglers == {"c"} and r.fleet.rollout_len == 8  # 64 over a's and b's envs
    r.round(1, rollout_of("c", 0, 0, T=8, N=8), rollout_of("a", 1, 1, T=8, N=4), rollout_of("b", 1, 1, T=8, N=4))
    assert r.fleet.stragglers == set() and r.fleet.rollout_len == 4  # c came within one version: back


def test_a_joining_actor_is_waited_for_in_the_round_it_joins(rig) -> None:
    r = rig({"a": 1})
    r.fleet.refresh(r.link.fleet())
    r.link.set_actors({"a": 1, "b": 1})
    got = r.round(0, rollout_of("a", 0, 0), None, rollout_of("b", 0, 0))
    assert sorted(t.peer_id for t in got.batch) == ["a", "b"]


def test_the_round_times_out_at_the_factor_times_the_normal_round_of_the_actors_it_waits_for(rig) -> None:
    r = rig({f"a{i}": 1 for i in range(8)}, straggler_factor=3.0, min_round_timeout_s=0.001)
    everyone = {f"a{i}" for i in range(8)}
    assert r.rounds.timeout_s(everyone) == 10.0  # nobody has reported yet: generous
    for i in range(8):  # 8 actors on 2 cores report one after another, 0.1 s to 0.8 s into a round
        r.rounds.report_times[f"a{i}"].extend([0.1 * (i + 1)] * 5)
    # The normal round ends with the last of them: 3 x 0.8 s, not 3 x the median actor's 0.4 s (which a
    # scheduler hiccup of the last one would pass).
    assert r.rounds.timeout_s(everyone) == pytest.approx(2.4)
    assert r.rounds.timeout_s(everyone - {"a7"}) == pytest.approx(2.1)  # a7 not waited for: a6 ends the round


def test_a_consistently_slow_actor_never_sets_the_normal_round(rig) -> None:
    r = rig({"a": 1, "b": 1, "slow": 1}, straggler_factor=3.0, min_round_timeout_s=0.001)
    for peer, t in {"a": 0.1, "b": 0.12, "slow": 5.0}.items():  # slow made it in time once (a generous round)
        r.rounds.report_times[peer].append(t)
    assert r.rounds.timeout_s({"a", "b", "slow"}) == pytest.approx(0.36)  # 5 s > 3 x the median 0.12 s: left out
    two = rig({"a": 1, "slow": 1}, straggler_factor=3.0, min_round_timeout_s=0.001)
    two.rounds.report_times["a"].append(0.1)
    two.rounds.report_times["slow"].append(0.4)
    assert two.rounds.timeout_s({"a", "slow"}) == pytest.approx(0.3)  # of two, the faster is the yardstick
    r.link.set_actors({"a": 1, "b": 1})  # slow leaves: its times are forgotten at the next round's start
    r.round(7, rollout_of("a", 0, 7), rollout_of("b", 0, 7))
    assert set(r.rounds.report_times) == {"a", "b"}
