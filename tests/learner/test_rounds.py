"""Sync rounds against a fake link and data channel: when a round closes, who becomes a straggler and
when it is back, how rollouts are sized from the fleet, and how straggler events are logged."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from loguru import logger

from fakes import FakeChannel, FakeLink
from samples import rollout_of
from zddrl import protocol as P
from zddrl.algos.rollout import mismatch
from zddrl.config import Config
from zddrl.envs import EnvSpec
from zddrl.learner.fleet import FleetPlan
from zddrl.learner.ledger import Ledger
from zddrl.learner.poll import ShardPoller
from zddrl.learner.rounds import SyncRounds
from zddrl.shards.group import ShardGroup


class Rig:
    """SyncRounds of a single (main) learner over a FakeLink whose fleet is ``actors``."""

    def __init__(
        self,
        actors: dict[str, int],
        batch_size: int = 10**6,
        default_envs: int = 1,
        check: Callable[[P.Trajectory], str] = lambda m: "",
        **learner,
    ) -> None:
        self.config = Config().replace(
            {"algo.batch_size": batch_size, **{f"learner.{k}": v for k, v in learner.items()}}
        )
        self.link, self.channel = FakeLink(actors), FakeChannel()
        self.lines: list[str] = []
        self.sink = logger.add(self.lines.append, level="INFO", format="{message}")
        self.ledger = Ledger(self.config, logger, time.time())
        self.fleet = FleetPlan(default_envs, batch_size, 8, logger)
        poller = ShardPoller(self.link, lambda: self.channel, "r", ShardGroup(), check, logger)
        self.rounds = SyncRounds(
            poller, self.config, logger, self.fleet, self.ledger, lambda: self.fleet.refresh(self.link.fleet())
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
    r = rig({"a": 4, "b": 4}, batch_size=64, default_envs=4)
    r.fleet.refresh(r.link.fleet())
    assert r.fleet.rollout_len == 8  # 64 steps over 8 envs
    r.link.set_actors({"a": 4, "b": 4, "c": 8})  # an actor joins: the next rollouts are shorter
    assert r.fleet.refresh(r.link.fleet()) and r.fleet.rollout_len == 6  # c counts as env.num_envs (4) until it sends
    assert r.fleet.publish(0) == 6
    got = r.round(0, rollout_of("a", 0, 0, T=6, N=4), rollout_of("b", 0, 0, T=6, N=4), rollout_of("c", 0, 0, T=6, N=8))
    assert got.actors == 3 and r.fleet.stragglers == set() and r.fleet.rollout_len == 4  # c showed 8: 64 over 16
    r.link.set_actors({"a": 4, "b": 4})  # c leaves
    r.fleet.refresh(r.link.fleet())
    assert r.fleet.rollout_len == 8


def test_an_actor_that_joins_when_the_batch_is_already_full_is_a_straggler_until_it_keeps_up(rig) -> None:
    r = rig({"a": 4, "b": 4}, batch_size=64, default_envs=4)
    r.fleet.refresh(r.link.fleet())
    r.fleet.publish(0)  # asks 8
    r.link.set_actors({"a": 4, "b": 4, "c": 8})
    got = r.round(0, rollout_of("a", 0, 0, T=8, N=4), rollout_of("b", 0, 0, T=8, N=4))  # full before c reports
    assert got.actors == 2 and r.fleet.stragglers == {"c"} and r.fleet.rollout_len == 8  # 64 over a's and b's envs
    r.fleet.publish(1)
    r.round(1, rollout_of("c", 0, 0, T=8, N=8), rollout_of("a", 1, 1, T=8, N=4), rollout_of("b", 1, 1, T=8, N=4))
    assert r.fleet.stragglers == set() and r.fleet.rollout_len == 4  # c came within one version: back, with 8 envs


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


def refuse(peer: str) -> Callable[[P.Trajectory], str]:
    """A run check that refuses every rollout of ``peer`` (as ``algos.rollout.mismatch`` refuses a bad one)."""
    return lambda m: "rewards outside the env's declared reward range" if m.peer_id == peer else ""


def test_a_refused_rollout_is_no_answer_the_round_waits_for_its_actor(rig) -> None:
    """Issue 28: a rollout the learner refused still counted as "reported", so one key answering every round with
    refused data closed rounds before the others' data came ("batch_steps 0 for versions 101-454")."""
    r = rig({"a": 1, "b": 1}, check=refuse("b"), min_round_timeout_s=0.05)
    r.rounds.report_times["a"].extend([0.001] * 3)  # a known normal round: the straggler timeout is its 50 ms floor
    got = r.round(3, rollout_of("b", 0, 3), rollout_of("a", 0, 3))
    assert [t.peer_id for t in got.batch] == ["a"] and got.round_s >= 0.05  # waited for b to the timeout
    assert r.fleet.stragglers == {"b"} and r.ledger.progress.dropped_invalid == {"b": 1}
    # Per the straggler rules, as for an actor that sent nothing: not waited for next round, back once in time.
    r.rounds.poller.check = lambda m: ""
    got = r.round(4, rollout_of("b", 1, 4), rollout_of("a", 1, 4))
    assert sorted(t.peer_id for t in got.batch) == ["a", "b"] and r.fleet.stragglers == set()


def test_a_round_of_refused_rollouts_only_ends_by_the_timeout(rig) -> None:
    r = rig({"a": 1}, check=refuse("a"), min_round_timeout_s=0.05)
    r.rounds.report_times["a"].append(0.001)
    lines: list[str] = []
    sink = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        got = r.round(0, rollout_of("a", 0, 0))
    finally:
        logger.remove(sink)
    assert got.batch == [] and not got.stopped and r.fleet.stragglers == {"a"}  # no deadlock: the next version comes
    assert any("no rollout could be used" in line for line in lines), lines


F32 = np.float32
CLAIM = 1 << 20  # the hello: num_envs = 1,048,576


def test_a_claim_of_a_million_envs_does_not_shrink_the_rollouts_of_the_honest_fleet(rig) -> None:
    """Issue 28: "an actor claiming 1,048,576 envs that answers every round brought rollout_len from 64 to 1". A
    claim counts at most as one actor of the run's env.num_envs until the actor sends; then as what it sends."""
    r = rig({"a": 4, "b": 4}, batch_size=256, default_envs=4, min_round_timeout_s=0.05)
    r.fleet.refresh(r.link.fleet())
    honest = r.fleet.rollout_len
    assert honest == 32  # 256 steps over the honest 8 envs
    r.rounds.report_times.update({peer: [0.001] for peer in ("a", "b")})
    r.link.set_actors({"a": 4, "b": 4, "thief": CLAIM})
    r.fleet.refresh(r.link.fleet())
    assert r.fleet.rollout_len == 22  # ceil(256 / 12): the claim counts as 4 envs, not a million (which gave 1)
    for v in range(5):  # it answers every round with one step of one env
        L = r.fleet.publish(v)
        got = r.round(
            v, rollout_of("thief", v, v, T=1, N=1), rollout_of("a", v, v, T=L, N=4), rollout_of("b", v, v, T=L, N=4)
        )
        assert got.actors == 3 and r.fleet.stragglers == set()
        assert r.fleet.rollout_len == honest  # worth 1/L of an env: ceil(256 / 8.05) = 32, the honest fleet's


def test_a_silent_claim_of_a_million_envs_costs_one_round_at_most(rig) -> None:
    r = rig({"a": 4, "b": 4}, batch_size=256, default_envs=4, min_round_timeout_s=0.05)
    r.rounds.report_times.update({peer: [0.001] for peer in ("a", "b")})
    r.link.set_actors({"a": 4, "b": 4, "thief": CLAIM})
    r.fleet.refresh(r.link.fleet())
    L = r.fleet.publish(0)
    assert L == 22  # as one ordinary actor (4 envs) until it sends or misses a round
    r.round(0, rollout_of("a", 0, 0, T=L, N=4), rollout_of("b", 0, 0, T=L, N=4))
    assert r.fleet.stragglers == {"thief"} and r.fleet.rollout_len == 32  # missed a round: sized without it


def test_rewards_beyond_the_declared_range_are_refused_counted_and_logged_once(rig) -> None:
    """Issue 28: rewards outside the reward range the env declares are refused like any rollout the run cannot train
    on: counted for the actor, one aggregated log line, and (as above) no answer in the round."""
    ranged = EnvSpec((4,), True, 2, reward_low=-1.0, reward_high=1.0)
    r = rig({"a": 1, "b": 1}, check=lambda m: mismatch(m.arrays, ranged), min_round_timeout_s=0.05)
    r.rounds.report_times["a"].append(0.001)
    for v in range(5):
        forged = rollout_of("b", v, v)
        forged = P.Trajectory(**{**forged.__dict__, "arrays": {**forged.arrays, "rewards": np.full((4, 1), 1e4, F32)}})
        got = r.round(v, forged, rollout_of("a", v, v))
        assert [t.peer_id for t in got.batch] == ["a"]
    assert r.ledger.progress.dropped_invalid == {"b": 5} and r.ledger.progress.episodes == 0
    assert len([line for line in r.lines if "declared reward range [-1, 1]" in line]) == 1, r.lines
