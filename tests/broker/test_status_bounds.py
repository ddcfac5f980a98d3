"""The status body, a member's stats and the health checks stay bounded whatever the fleet (issues 13.7, 16.2).

In-process: a Broker object (never bound) whose ``members`` are filled directly, so that 10,000 members cost
nothing but memory. The same bounds through a real broker process: tests/broker/test_public_port.py.
"""

from __future__ import annotations

import time

import msgpack
import pytest

from broker_clients import in_process_broker
from zddrl import protocol as P
from zddrl.broker import health as H
from zddrl.broker.broker import Broker
from zddrl.broker.health import HealthMonitor, HealthWarning
from zddrl.broker.health_events import log_health_events
from zddrl.broker.limits import (
    LIMITED_IDENTITIES,
    MAX_ACTORS_PER_HOST,
    MAX_MEMBERS_PER_ROLE,
    STATUS_TOTAL_BURST_BYTES,
    Limits,
    RateLimit,
)
from zddrl.broker.membership import (
    DEPARTURE_REASON_CHARS,
    DEPARTURES_KEPT,
    MAX_STATS_BYTES,
    MAX_STATS_KEYS,
    MAX_STATS_STRING,
    Member,
    checked_stats,
)
from zddrl.broker.report import HEALTH_ROWS_LISTED, HOSTS_LISTED, MAX_STATUS_BYTES, PAGE_MEMBERS, row_bytes
from zddrl.broker.roster import Roster
from zddrl.logs import RateLimitedLog


def packed(value: object) -> int:
    return len(msgpack.packb(value, use_bin_type=True))


def big_stats(nbytes: int) -> dict:
    """A flat stats map of about ``nbytes`` packed: 256-character strings under 40-byte keys."""
    n = nbytes // (MAX_STATS_STRING + 45)
    return {f"figure/{i:08d}/" + "k" * 24: "v" * MAX_STATS_STRING for i in range(n)}


def fill(broker: Broker, n: int, stats: dict, host_of=lambda i: f"node{i % 64}") -> None:
    """``n`` members (a learner, a monitor, the rest actors), all holding the same ``stats`` (shared: cheap)."""
    kept, nbytes, _ = checked_stats(stats)
    for i in range(n):
        role = "learner" if i == n - 1 else "monitor" if i == n - 2 else "actor"
        peer_id = f"{role}-{i:05d}"
        m = Member(peer_id=peer_id, role=role, identity=peer_id.encode(), host=host_of(i), pid=i, num_envs=8)
        m.stats, m.stats_bytes = kept, nbytes
        for reason in ("malformed", "unknown_sender", "unknown_run", "stale", "unknown_version", "no_route"):
            m.counters[f"dropped_{reason}"] = 1 << 40
        broker.members[peer_id] = m


def all_pages(broker: Broker) -> list[dict]:
    first = broker.status(1)
    return [first, *(broker.status(p) for p in range(2, first["broker"]["pages"] + 1))]


def test_10000_members_page_through_bodies_under_the_bound() -> None:
    with in_process_broker() as broker:
        fill(broker, 10_000, {"sps": 1234.5, "comm_share": 0.1, "param_hash": "f" * 16, "rss_mb": 512.0})
        pages = all_pages(broker)
        assert len(pages) == 10_000 // PAGE_MEMBERS
        seen: list[str] = []
        for body in pages:
            assert packed(body) <= MAX_STATUS_BYTES
            assert len(body["members"]) <= PAGE_MEMBERS
            seen += body["members"]
        assert sorted(seen) == sorted(broker.members), "every member on exactly one page"
        summary = pages[0]["broker"]
        assert list(pages[0]["members"])[:2] == ["learner-09999", "monitor-09998"], "learners first, then monitors"
        assert summary["members_total"] == 10_000 and summary["hosts_total"] == 64
        assert summary["members_by_role"] == {"actor": 9_998, "learner": 1, "monitor": 1, "relay": 0, "replay": 0}
        assert summary["envs_total"] == 80_000 and len(summary["members_by_host"]) == HOSTS_LISTED
        assert broker.status(len(pages) + 1)["members"] == {}, "a page past the last is empty, not an error"
        with pytest.raises(P.ProtocolError):
            broker.status(0)


def test_a_small_fleet_is_all_on_page_one() -> None:
    with in_process_broker() as broker:
        fill(broker, 9, {"sps": 1.0})
        body = broker.status()
        assert body["broker"]["pages"] == 1 and set(body["members"]) == set(broker.members)


def test_the_worst_body_stays_under_the_bound_and_fits_a_message() -> None:
    """Every part at its own bound: members with the largest stats and longest names and hosts, more hosts and
    warnings than are listed, every departure with the longest reason."""
    with in_process_broker() as broker:
        long_host = lambda i: f"{i:04d}" + "h" * (P.MAX_HOST_BYTES - 4)  # noqa: E731
        fill(broker, 2_000, big_stats(2 * MAX_STATS_BYTES), host_of=long_host)
        now = time.monotonic()
        for i, m in enumerate(list(broker.members.values())[:300]):
            broker.health.observe(m.peer_id, "actor", {"first_obs_hash": "x" * MAX_STATS_STRING}, now)
            if i < DEPARTURES_KEPT:
                broker.membership.departures.record(m, P.CRASH_PREFIX + "t" * 2 * DEPARTURE_REASON_CHARS)
        assert broker.health.counts()["same_initial_obs"] == 300
        last = broker.status()["broker"]["pages"]
        assert last > 200, "rows of 64 KiB: a few per page"
        pages = [broker.status(p) for p in (1, 2, last)]
        for body in pages:
            nbytes = packed(body)
            assert nbytes <= MAX_STATUS_BYTES, nbytes
            assert P.decode(P.encode(P.Status(body=body))).body == body, "a status message any client can decode"
        body = pages[0]
        assert len(body["health"]) == HEALTH_ROWS_LISTED and body["broker"]["health_total"] == 300
        assert len(body["departures"]) == DEPARTURES_KEPT and body["broker"]["hosts_total"] == 2_000
        assert packed(body) > MAX_STATUS_BYTES // 2, "the bound is what such a body needs, not far above it"
        for m in list(broker.members.values())[:5]:  # each row is within what paging charges for it
            assert packed(m.peer_id) + packed({**m.row(now), "warnings": 6}) <= row_bytes(m)


def test_stats_of_0_6_mib_are_truncated_to_the_bound() -> None:
    stats = {"sps": 10.0, "comm_share": 0.5, **big_stats(600 << 10)}
    kept, nbytes, dropped = checked_stats(stats)
    assert packed(kept) <= nbytes <= MAX_STATS_BYTES
    assert list(kept) == list(stats)[: len(kept)], "a prefix, in the sender's order"
    assert dropped == len(stats) - len(kept) > 0 and kept["sps"] == 10.0
    many = {f"k{i}": None for i in range(3 * MAX_STATS_KEYS)}
    assert len(checked_stats(many)[0]) == MAX_STATS_KEYS
    odd = {"x" * 200: 1, "long": "s" * (MAX_STATS_STRING + 1), "ok": 1}
    assert checked_stats(odd)[0] == {"ok": 1}, "an overlong key or string is left out, the rest kept"
    with pytest.raises(P.ProtocolError):
        checked_stats({"nested": {"a": 1}})
    member = Member(peer_id="a", role="actor", identity=b"a")
    assert "entries dropped" in member.take_stats(stats) and member.stats == kept
    assert member.take_stats({"sps": 1.0}) == "" and member.stats_bytes < 100


def test_2000_actors_sharing_a_first_observation_cost_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same_initial_obs check once rewrote every group member's warning per report (quadratic: 1,200 fake
    actors stalled a broker ~4 s). Each report now raises or refreshes at most two warnings."""
    updates = 0
    set_warning = HealthMonitor._set

    def counted(self, *args):  # type: ignore[no-untyped-def]
        nonlocal updates
        updates += args[1] == "same_initial_obs"
        return set_warning(self, *args)

    monkeypatch.setattr(HealthMonitor, "_set", counted)
    monitor = HealthMonitor()
    t0 = time.perf_counter()
    for i in range(2_000):
        monitor.observe(f"actor-{i}", "actor", {"first_obs_hash": "abc", "sps": 1.0}, float(i))
    monitor.evaluate(2_000.0)
    rows = monitor.rows(2_000.0, H.CHECKS.__len__())
    elapsed = time.perf_counter() - t0
    assert updates <= 2 * 2_000, f"{updates} warning updates for 2,000 reports: not linear"
    assert monitor.counts()["same_initial_obs"] == 2_000 and len(rows) == len(H.CHECKS)
    assert elapsed < 1.0, f"2,000 reports took {elapsed:.2f} s"
    monitor.forget("actor-0")
    assert monitor.count_of("actor-0") == 0 and monitor.counts()["same_initial_obs"] == 1_999


def test_health_log_keys_do_not_grow_with_the_members_ever_seen() -> None:
    """The rate-limited log never forgets a key: keyed by member, peers churning through new ids grew it."""
    log = RateLimitedLog()
    for i in range(1_000):
        warning = HealthWarning(f"actor-{i}", "same_initial_obs", "same first observations", 0.0)
        log_health_events(log, [(True, warning), (False, warning)])
    assert len(log._last) + len(log._pending) <= 2 * 2 * len(H.CHECKS)


def test_rates_per_connection_and_in_all_with_a_bounded_number_of_buckets() -> None:
    limit = RateLimit(2.0, 10, total=(1.0, 12))
    assert sum(limit.allow(b"a", 0.0) for _ in range(20)) == 10, "the burst of one connection"
    assert limit.allow(b"a", 0.5), "two per second: one after half a second"
    assert not limit.allow(b"a", 0.5)
    assert sum(limit.allow(b"b", 0.5) for _ in range(20)) == 1, "the total is spent (12 - 11 + 0.5)"
    for i in range(LIMITED_IDENTITIES + 100):
        limit.allow(i.to_bytes(4, "big"), 100.0)
    assert len(limit) == LIMITED_IDENTITIES
    limits = Limits()
    assert limits.status_bytes(STATUS_TOTAL_BURST_BYTES, time.monotonic())
    assert not limits.status_bytes(1 << 20, time.monotonic()), "the bytes of all replies are bounded too"


def test_caps_per_role_and_per_host() -> None:
    fleet = Roster()
    for i in range(MAX_ACTORS_PER_HOST):
        fleet.joined(f"actor-{i}", 1, "big-host")
    hello = P.Hello(role="actor", peer_id="actor-new", host="big-host")
    assert "from one host" in Limits.cap_refusal(hello, None, len(fleet), 0, fleet)
    assert Limits.cap_refusal(P.Hello(role="actor", peer_id="x", host="other"), None, len(fleet), 0, fleet) == ""
    old = Member(peer_id="actor-0", role="actor", identity=b"", host="big-host")
    again = P.Hello(role="actor", peer_id="actor-0", host="big-host")
    assert Limits.cap_refusal(again, old, len(fleet), 0, fleet) == "", "a re-hello replaces, it does not add"
    learners = MAX_MEMBERS_PER_ROLE["learner"]
    refusal = Limits.cap_refusal(P.Hello(role="learner", peer_id="l"), None, len(fleet) + learners, learners, fleet)
    assert f"at most {learners} members of role 'learner'" in refusal
    fleet.left("actor-0")
    assert fleet.on_host("big-host") == MAX_ACTORS_PER_HOST - 1
