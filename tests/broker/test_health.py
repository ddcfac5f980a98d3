"""Fleet health warnings and failure forensics.

Units: ``HealthMonitor`` fed by hand (each check fires on a provoked case and clears), the actor-side
figures, crash reports. End to end: a real broker judging what real ``BrokerLink`` clients report,
and a real actor process that crashes (its env raises) while a real learner trains.

This module is also the env factory of the end-to-end crash test (``tests.broker.test_health:exploding_cartpole``,
imported by the learner and actor processes), so it imports nothing heavy at module level.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import zmq

from conftest import Bus
from zddrl import protocol as P
from zddrl.actor.host import ActorTimers, first_obs_hash
from zddrl.broker import health as H
from zddrl.broker.health import HealthMonitor
from zddrl.transport.link import CRASH_MESSAGE_CHARS, CRASH_TRACEBACK_CHARS, BrokerLink, crash_reason
from zddrl.transport.status import request_status

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 10.0
EXPLODE_ENV = "ZDDRL_TEST_EXPLODE_AFTER"
"""Env var read by exploding_cartpole: env steps after which it raises (unset: never)."""


# ------------------------------------------------------------------------------------------------
# The env factory of the end-to-end crash test
# ------------------------------------------------------------------------------------------------


class _Exploding(gym.Wrapper):
    def __init__(self, env: gym.Env, after: int) -> None:
        super().__init__(env)
        self.after, self.steps = after, 0

    def step(self, action: Any):
        self.steps += 1
        if self.after and self.steps > self.after:
            raise RuntimeError(f"exploding_cartpole failed at step {self.steps}, on purpose")
        return self.env.step(action)


def exploding_cartpole() -> gym.Env:
    return _Exploding(gym.make("CartPole-v1"), int(os.environ.get(EXPLODE_ENV, "0")))


# ------------------------------------------------------------------------------------------------
# Units: each check fires on a provoked case and clears
# ------------------------------------------------------------------------------------------------


def checks(mon: HealthMonitor) -> set[tuple[str, str]]:
    return {(w.member, w.check) for w in mon.active()}


def test_comm_share_fires_after_consecutive_reports_and_clears() -> None:
    mon = HealthMonitor()
    for i in range(H.COMM_SHARE_REPORTS - 1):
        mon.observe("a", "actor", {"comm_share": 0.9}, float(i))
    assert not mon.active(), "one slow interval is not a condition"
    (w,) = mon.observe("a", "actor", {"comm_share": 0.9}, 10.0)
    assert (w.member, w.check, w.since) == ("a", "comm_share", 10.0) and "90%" in w.message
    assert [(raised, e.check) for raised, e in mon.pop_events()] == [(True, "comm_share")]
    mon.observe("a", "actor", {"comm_share": 0.95}, 11.0)
    assert mon.pop_events() == [], "an onset is reported once, not per report"
    assert mon.rows(15.0)[0]["since_s"] == 5.0 and "95%" in mon.rows(15.0)[0]["message"]
    assert mon.observe("a", "actor", {"comm_share": 0.1}, 12.0) == []
    assert [(raised, e.check) for raised, e in mon.pop_events()] == [(False, "comm_share")]
    for i in range(5):  # learners wait for data by design: only actors are judged
        mon.observe("l", "learner", {"comm_share": 0.9}, float(i))
    assert not mon.active()


def test_unknown_params_fires_for_a_hash_never_published_and_clears() -> None:
    mon = HealthMonitor()
    mon.observe("a", "actor", {"policy_version": 0, "param_hash": "bogus"}, 0.0)
    assert not mon.active(), "nothing published yet: nothing to judge against"
    mon.published(0, "h0")
    mon.published(1, "h1")
    mon.observe("a", "actor", {"policy_version": 1, "param_hash": "bogus"}, 1.0)
    (w,) = mon.active()
    assert w.check == "unknown_params" and "bogus" in w.message and "h1" in w.message
    mon.observe("a", "actor", {"policy_version": 1, "param_hash": "h1"}, 2.0)
    assert not mon.active()
    mon.observe("a", "actor", {"policy_version": 7, "param_hash": "h7"}, 3.0)
    assert checks(mon) == {("a", "unknown_params")}, "a version never published"


def test_unknown_params_does_not_judge_versions_older_than_the_broker_saw() -> None:
    mon = HealthMonitor()  # a restarted broker: the learner republished version 5 only
    mon.published(5, "h5")
    mon.observe("a", "actor", {"policy_version": 4, "param_hash": "h4"}, 0.0)
    assert not mon.active()
    mon.start_run(run_id="run-2")  # versions restart with a run: the old run's hashes are unknown in the new one
    mon.published(0, "n0")
    mon.observe("a", "actor", {"run_id": "run-1", "policy_version": 0, "param_hash": "h5"}, 1.0)
    assert not mon.active(), "the old run's last report, sent as the new run started, is not judged"
    mon.observe("a", "actor", {"run_id": "run-2", "policy_version": 0, "param_hash": "h5"}, 2.0)
    assert checks(mon) == {("a", "unknown_params")}


@pytest.mark.parametrize("report_s", [1.0, 8.0])
def test_stuck_version_fires_after_its_time_and_clears(report_s: float) -> None:
    mon = HealthMonitor()
    mon.report_interval_s = report_s  # a large fleet reports less often: judged that much later
    after = H.STUCK_AFTER_S + 2 * report_s
    mon.published(0, "h0")
    mon.observe("a", "actor", {"policy_version": 0, "param_hash": "h0"}, 0.0)
    for v in range(1, H.STUCK_VERSIONS + 2):
        mon.published(v, f"h{v}")
    assert not mon.evaluate(1.0)
    assert not mon.evaluate(1.0 + after - 0.5), "behind, but not for long enough"
    (w,) = mon.evaluate(1.0 + after + 0.5)  # without a new report: a stuck actor may be silent
    assert w.check == "stuck_version" and f"{H.STUCK_VERSIONS + 1} behind" in w.message
    mon.observe("a", "actor", {"policy_version": H.STUCK_VERSIONS + 1, "param_hash": "h4"}, 2.0 + after)
    assert not mon.active()
    assert [raised for raised, _ in mon.pop_events()] == [True, False]


def test_stuck_version_says_what_holds_the_actor() -> None:
    """A relay cut from its root holds its actors by flow control: they go quiet, or report that they wait; the
    warning says so instead of asking whether parameters reach them."""

    def stuck(stats: dict, reports_at: list[float], judged_at: float) -> str:
        mon = HealthMonitor()
        for v in range(H.STUCK_VERSIONS + 2):
            mon.published(v, f"h{v}")
        for t in reports_at:
            mon.observe("a", "actor", {"policy_version": 0, "param_hash": "h0", **stats}, t)
        (w,) = mon.evaluate(judged_at)
        return w.message

    late = H.STUCK_AFTER_S + 2 + H.STATS_SLACK_S + 5
    assert "no report for" in stuck({}, [0.0], late) and "flow control" in stuck({}, [0.0], late)
    reporting = [float(t) for t in range(int(late))]
    assert "waits 95%" in stuck({"wait_share": 0.95}, reporting, late)
    assert stuck({"wait_share": 0.1}, reporting, late).endswith("are parameters reaching it?")


def test_stuck_version_allows_the_runs_max_staleness() -> None:
    mon = HealthMonitor()
    mon.start_run(max_staleness=8)  # async modes act behind by design
    for v in range(7):
        mon.published(v, f"h{v}")
    mon.observe("a", "actor", {"policy_version": 0, "param_hash": "h0"}, 0.0)
    assert not mon.evaluate(0.0) and not mon.evaluate(100.0)


def test_the_brokers_tick_raises_stuck_version_without_a_new_report() -> None:
    """The judging above, on the broker's own tick: a silent actor behind is warned about in the status body once
    its clock passed STUCK_AFTER_S (the end-to-end test below covers the reports and the published hashes)."""
    from broker_clients import in_process_broker

    with in_process_broker() as b:
        now = time.monotonic()
        for v in range(H.STUCK_VERSIONS + 2):
            b.health.published(v, f"h{v}")
        b.health.observe("actor-0", "actor", {"policy_version": 0, "param_hash": "h0"}, now)
        b._tick(now + 1.0)
        assert b.status()["health"] == []
        b._tick(now + H.STUCK_AFTER_S + 2 * b.health.report_interval_s + 1.0)
        (w,) = b.status()["health"]
        assert (w["member"], w["check"]) == ("actor-0", "stuck_version"), w


def feed_rss(mon: HealthMonitor, member: str, values: list[float], t0: float = 0.0, role: str = "learner") -> float:
    t = t0
    for value in values:
        mon.observe(member, role, {"rss_mb": value}, t)
        t += H.RSS_SAMPLE_EVERY_S
    return t


def test_rss_growth_fires_on_steady_growth_and_clears_when_it_levels_off() -> None:
    mon = HealthMonitor()
    n = H.RSS_WINDOW
    t = feed_rss(mon, "l", [100.0 + 2 * i for i in range(n - 1)])
    assert not mon.active(), "the window is not full yet"
    t = feed_rss(mon, "l", [100.0 + 2 * (n - 1)], t)
    (w,) = mon.active()
    assert (w.member, w.check) == ("l", "rss_growth") and "MB" in w.message
    feed_rss(mon, "l", [160.0] * n, t)
    assert not mon.active()


def test_rss_growth_ignores_one_step_noise_and_dense_reports() -> None:
    mon = HealthMonitor()
    k = H.RSS_WINDOW // 2
    feed_rss(mon, "a", [100.0] * k + [200.0] * k)  # one big allocation: a step, not a leak
    noisy = [100.0 + (40.0 if i % 2 else 0.0) for i in range(H.RSS_WINDOW)]
    feed_rss(mon, "b", noisy)
    for i in range(3 * H.RSS_WINDOW):  # reports closer than RSS_SAMPLE_EVERY_S are not samples
        mon.observe("c", "actor", {"rss_mb": 100.0 + 10 * i}, i * 0.1)
    assert not mon.active()


def test_sps_collapse_fires_after_consecutive_low_reports_and_clears() -> None:
    mon = HealthMonitor()
    for i, sps in enumerate([500.0, 1000.0, 900.0]):
        mon.observe("a", "actor", {"sps": sps}, float(i))
    for i in range(H.SPS_COLLAPSE_REPORTS - 1):
        mon.observe("a", "actor", {"sps": 200.0}, 10.0 + i)
    assert not mon.active()
    mon.observe("a", "actor", {"sps": 200.0}, 20.0)
    (w,) = mon.active()
    assert w.check == "sps_collapse" and "1000" in w.message
    mon.observe("a", "actor", {"sps": 800.0}, 21.0)
    assert not mon.active()


def test_same_initial_obs_fires_for_each_actor_of_a_group_and_clears() -> None:
    mon = HealthMonitor()
    mon.observe("a", "actor", {"first_obs_hash": "x"}, 0.0)
    mon.observe("c", "actor", {"first_obs_hash": "y"}, 0.0)
    assert not mon.active()
    mon.observe("b", "actor", {"first_obs_hash": "x"}, 1.0)
    assert checks(mon) == {("a", "same_initial_obs"), ("b", "same_initial_obs")}
    assert "b" in next(w.message for w in mon.active() if w.member == "a")
    mon.observe("d", "actor", {"first_obs_hash": "x"}, 2.0)
    mon.forget("d")
    assert checks(mon) == {("a", "same_initial_obs"), ("b", "same_initial_obs")}
    mon.forget("b")
    assert not mon.active(), "alone again"
    mon.observe("b", "actor", {"first_obs_hash": "x"}, 3.0)
    mon.observe("b", "actor", {"first_obs_hash": "z"}, 4.0)  # b's envs were rebuilt (a new run)
    assert not mon.active()


def test_a_new_run_clears_what_belonged_to_the_old_one_and_forget_clears_all() -> None:
    mon = HealthMonitor()
    mon.published(0, "h0")
    mon.observe("a", "actor", {"policy_version": 0, "param_hash": "bad"}, 0.0)
    feed_rss(mon, "a", [100.0 + 3 * i for i in range(H.RSS_WINDOW)], 1.0, role="actor")
    assert checks(mon) == {("a", "unknown_params"), ("a", "rss_growth")}
    mon.start_run()
    assert checks(mon) == {("a", "rss_growth")}, "RSS belongs to the process, not to the run"
    mon.forget("a")
    assert not mon.active() and mon.rows(0.0) == []


def test_malformed_figures_are_ignored() -> None:
    mon = HealthMonitor()
    stats = {
        "sps": True,
        "comm_share": "high",
        "rss_mb": None,
        "policy_version": True,
        "param_hash": 3,
        "first_obs_hash": "",
    }
    for i in range(40):
        mon.observe("a", "actor", stats, i * 10.0)
    assert not mon.active()


# ------------------------------------------------------------------------------------------------
# Units: actor-side figures and crash reports
# ------------------------------------------------------------------------------------------------


def test_actor_rates_are_per_report_interval() -> None:
    timers = ActorTimers(started=time.monotonic() - 10.0)
    timers.env_steps, timers.wait_params_s, timers.send_s = 10_000, 6.0, 3.0
    first = timers.stats()
    assert 900 < first["sps"] <= 1000 and 0.25 < first["comm_share"] < 0.35 and 0.55 < first["wait_share"] < 0.65
    timers._mark = (time.monotonic() - 1.0, timers.env_steps, 3.0, 6.0)  # one more second: fast, no waiting
    timers.env_steps += 5000
    second = timers.stats()
    assert 4000 < second["sps"] <= 5000 and second["comm_share"] < 0.05 and second["wait_share"] < 0.05
    assert second["env_steps"] == 15_000 and second["wait_params_s"] == 6.0, "totals stay cumulative"


def test_first_obs_hash() -> None:
    obs = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert re.fullmatch(r"[0-9a-f]{16}", first_obs_hash(obs))
    assert first_obs_hash(obs) == first_obs_hash(obs[:1].copy()), "env 0 only: --envs does not matter"
    assert first_obs_hash(obs) != first_obs_hash(obs + 1)
    same_start = np.zeros((8, 84, 84), dtype=np.uint8)  # Pong: one first frame whatever the seed
    assert first_obs_hash(same_start) == "", "envs seeded apart that start alike say nothing about seeds"
    assert first_obs_hash(same_start[:1]) != "", "one env: no way to tell, the hash is sent"


class Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("no")


def test_crash_reason_is_bounded_and_never_raises() -> None:
    try:
        raise RuntimeError("boom " * 10_000)
    except RuntimeError as exc:
        reason = crash_reason(exc)
    assert reason.startswith("crashed: RuntimeError: boom boom")
    assert "Traceback (most recent call last)" in reason and "test_crash_reason_is_bounded" in reason
    assert len(reason) < CRASH_MESSAGE_CHARS + CRASH_TRACEBACK_CHARS + 200
    try:
        raise Unprintable()
    except Unprintable as exc:
        assert crash_reason(exc).startswith("crashed: Unprintable: <unprintable")


def test_report_crash_sends_the_bye_with_the_exception() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link = BrokerLink(f"tcp://127.0.0.1:{port}", P.Hello(role="actor", peer_id="actor-0"), context=ctx).start()
    try:
        assert router.poll(int(WAIT_S * 1000))
        identity, *frames = router.recv_multipart()
        assert isinstance(P.decode(frames), P.Hello)
        router.send_multipart(
            [
                identity,
                *P.encode(
                    P.Welcome(
                        peer_id="actor-0",
                        run_id="",
                        run=None,
                        ports={"trajectories": 1, "learners": 2, "params": 3},
                        heartbeat_interval_s=1.0,
                        heartbeat_liveness=3,
                        max_message_bytes=1 << 20,
                    )
                ),
            ]
        )
        assert link.wait_welcome(WAIT_S) is not None
        try:
            {}["missing"]
        except KeyError as exc:
            link.report_crash(exc)
        assert not link.alive
        while True:
            assert router.poll(int(WAIT_S * 1000)), "no bye"
            msg = P.decode(router.recv_multipart()[1:])
            if isinstance(msg, P.Bye):
                break
        assert msg.reason.startswith("crashed: KeyError: 'missing'\nTraceback")
        assert "test_report_crash_sends_the_bye_with_the_exception" in msg.reason
    finally:
        link.close()
        ctx.destroy(linger=0)


# ------------------------------------------------------------------------------------------------
# End to end: a real broker judges what real links report
# ------------------------------------------------------------------------------------------------


class Clients(Bus):
    """Links that have been welcomed, and status requests, on the test's own context."""

    def link(self, broker: Any, hello: P.Hello) -> BrokerLink:  # type: ignore[override]
        link = super().link(broker.connect, hello)
        assert link.wait_welcome(WAIT_S) is not None, f"{hello.peer_id}: no welcome"
        return link

    def status(self, broker: Any) -> dict:
        body = request_status(broker.connect, WAIT_S, self.ctx)
        assert body is not None, "the broker did not answer a status request"
        return body


@pytest.fixture
def clients() -> Iterator[Clients]:
    c = Clients()
    try:
        yield c
    finally:
        c.close()


class TestLearner:
    """A learner shard: announces a run on its link, publishes parameters on its learners DEALER."""

    __test__ = False

    def __init__(self, clients: Clients, broker: Any, run_id: str = "run-h") -> None:
        from broker_clients import learner_hello
        from zddrl.config import Config

        self.run_id = run_id
        self.link = clients.link(broker, learner_hello("learner-0", run_id, Config().to_dict()))
        self.sock = clients.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, b"learner-0")
        self.sock.connect(self.link.endpoint("learners"))

    def publish(self, version: int) -> str:
        flat = np.arange(8, dtype=np.float32) + version
        digest = P.param_hash(flat)
        self.sock.send_multipart(
            P.encode(
                P.Parameters(
                    run_id=self.run_id,
                    peer_id="learner-0",
                    policy_version=version,
                    param_hash=digest,
                    layout=[["w", "float32", [8], 0]],
                    arrays={"flat": flat},
                )
            )
        )
        return digest


def health_of(body: dict, member: str) -> dict[str, dict]:
    return {w["check"]: w for w in body["health"] if w["member"] == member}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zddrl", *args], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
    )


@pytest.mark.slow
def test_broker_warns_about_unknown_params_and_clears_the_warning(broker: Any, procs: Any, clients: Clients) -> None:
    from conftest import wait_for

    learner = TestLearner(clients, broker)
    hashes = {0: learner.publish(0)}
    wait_for(lambda: clients.status(broker)["broker"]["policy_version"] == 0, WAIT_S, "version 0")
    actor = clients.link(broker, P.Hello(role="actor", peer_id="actor-0", num_envs=2))
    actor.send(P.Stats(peer_id="actor-0", role="actor", stats={"policy_version": 0, "param_hash": "0123456789abcdef"}))
    body = wait_for(lambda: (b := clients.status(broker)) and health_of(b, "actor-0") and b, WAIT_S, "the warning")
    (w,) = body["health"]
    assert w["check"] == "unknown_params" and "0123456789abcdef" in w["message"] and w["since_s"] >= 0
    text = cli("status", "--connect", broker.connect).stdout
    assert "health warnings (1)" in text and re.search(r"^  actor-0 +unknown_params +\d+ +acts with", text, re.M), text

    actor.send(P.Stats(peer_id="actor-0", role="actor", stats={"policy_version": 0, "param_hash": hashes[0]}))
    wait_for(lambda: not clients.status(broker)["health"], WAIT_S, "the warning to clear")
    assert "health: ok" in cli("status", "--connect", broker.connect).stdout
    log = procs.log("broker")
    assert log.count("health: actor-0: unknown_params: acts with parameters 0123456789abcdef") == 1
    assert "health: actor-0: unknown_params cleared" in log


@pytest.mark.slow
def test_stats_of_an_unknown_peer_are_ignored(broker: Any, clients: Clients) -> None:
    from conftest import wait_for

    learner = TestLearner(clients, broker)
    learner.publish(0)
    wait_for(lambda: clients.status(broker)["broker"]["policy_version"] == 0, WAIT_S, "version 0")
    stranger = clients.ctx.socket(zmq.DEALER)  # never said hello
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(broker.connect)
    bogus = P.Stats(
        peer_id="actor-9", role="actor", stats={"policy_version": 0, "param_hash": "bogus", "comm_share": 0.9}
    )
    for _ in range(H.COMM_SHARE_REPORTS + 1):
        stranger.send_multipart(P.encode(bogus))
    rejects = 0
    while rejects < H.COMM_SHARE_REPORTS + 1:  # each one is answered "send hello first", i.e. not taken
        assert stranger.poll(int(WAIT_S * 1000)), "no reject"
        msg = P.decode(stranger.recv_multipart())
        assert isinstance(msg, P.Reject) and msg.rehello
        rejects += 1
    body = clients.status(broker)
    assert body["health"] == [] and "actor-9" not in body["members"]


# ------------------------------------------------------------------------------------------------
# End to end: a real actor process crashes; its exception is in `zddrl status`
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_crashing_actor_leaves_its_exception_in_status(
    broker: Any, procs: Any, clients: Clients, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import wait_for

    # Learner and actors import this module as the run's env factory (and it imports conftest).
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    )
    procs.start(
        "learner",
        "learner",
        "--connect",
        broker.connect,
        str(ROOT / "examples" / "cartpole_ppo.toml"),
        "--run-dir",
        str(tmp_path / "run"),
        "--schedule",
        "async",
        "--set",
        "env.rollout_len=8",
        "--set",
        "env.id=tests.broker.test_health:exploding_cartpole",
    )
    allow = ("--allow-code", "tests.broker.test_health:exploding_cartpole")  # actors import only what they allow
    procs.start("actor-1", "actor", "--connect", broker.connect, "--actor-id", "1", "--envs", "2", *allow)
    monkeypatch.setenv(EXPLODE_ENV, "20")
    crashing = procs.start("actor-0", "actor", "--connect", broker.connect, "--actor-id", "0", "--envs", "2", *allow)
    monkeypatch.delenv(EXPLODE_ENV)

    wait_for(lambda: crashing.poll() is not None, 90, "actor-0 to crash")
    assert crashing.returncode != 0, procs.log("actor-0")
    body = wait_for(lambda: (b := clients.status(broker)) and b["departures"] and b, WAIT_S, "the departure")
    (dep,) = body["departures"]
    assert dep["member"] == "actor-0" and dep["role"] == "actor" and dep["crashed"] is True
    assert dep["host"] == socket.gethostname() and dep["pid"] == crashing.pid
    assert dep["reason"].startswith(
        "crashed: RuntimeError: exploding_cartpole failed at step 21, on purpose\nTraceback (most recent call last):"
    ), dep["reason"]
    assert "in step" in dep["reason"] and "test_health.py" in dep["reason"], "the frames of the failure"
    log = procs.log("broker")
    line = next(ln for ln in log.splitlines() if "crashed: RuntimeError" in ln)
    assert "ERROR" in line and f"actor actor-0 on {socket.gethostname()} (pid {crashing.pid}) crashed" in line

    # The rest of the fleet is live, with the actor-side figures; the crashed actor is not a member.
    body = wait_for(
        lambda: (
            (b := clients.status(broker)) and "first_obs_hash" in b["members"].get("actor-1", {}).get("stats", {}) and b
        ),
        60,
        "actor-1's stats",
    )
    assert set(body["members"]) == {"learner-0", "actor-1"}
    stats = body["members"]["actor-1"]["stats"]
    assert re.fullmatch(r"[0-9a-f]{16}", stats["first_obs_hash"]) and stats["rss_mb"] > 10
    text = cli("status", "--connect", broker.connect).stdout
    assert re.search(r"^  actor-0 +actor +\S+ +\d+ +crashed: RuntimeError: exploding_cartpole failed", text, re.M), text
    assert json.loads(cli("status", "--connect", broker.connect, "--json").stdout)["departures"][0]["crashed"]


def test_a_thousand_actors_sharing_a_first_observation_cost_the_monitor_linear_work(monkeypatch) -> None:
    """Each join touches at most two warnings (its own, and the first member's when the group forms): 1,000 actors
    with one first_obs_hash used to cost a million message rebuilds and stalled the broker for seconds."""
    mon = HealthMonitor()
    calls = []
    real_set = mon._set
    monkeypatch.setattr(mon, "_set", lambda *args: calls.append(args[:2]) or real_set(*args))
    for i in range(1000):
        mon.observe(f"actor-{i}", "actor", {"first_obs_hash": "same"}, float(i))
    assert len(calls) == 1000  # the first alone: none; the second: two; every later one: its own
    assert len(mon.active()) == 1000
    assert "actor-0, actor-1, actor-2 and 996 more" in next(w.message for w in mon.active() if w.member == "actor-999")
    for i in range(999):
        mon.forget(f"actor-{i}")
    assert not mon.active(), "the last one alone again"
