"""The heartbeat interval grows with the fleet (broker/cadence.py) and members keep it (docs/protocol.md 5.2).

The unit tests pin the arithmetic; the process test runs a real `zddrl broker` with a low ``heartbeat_rate`` and
real ``BrokerLink`` clients: the interval doubles as members join, every client adopts it from the broker's
heartbeats, a newcomer's welcome carries it, members silent for longer than the base expiry are kept, and the
interval comes back down as they leave.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from broker_clients import WAIT_S, ProfiledBroker, counters, status
from conftest import Bus, Procs, wait_for
from zddrl import protocol as P
from zddrl.broker.cadence import Cadence
from zddrl.broker.membership import Member, id_conflict
from zddrl.config import BrokerConfig


def test_the_interval_doubles_past_each_multiple_of_the_rate() -> None:
    c = Cadence(1.0, 3, 256.0)
    assert [c.wanted(n) for n in (0, 1, 256, 257, 512, 513, 1024, 1025, 10_000)] == [1, 1, 1, 2, 2, 4, 4, 8, 64]
    assert Cadence(1.0, 3, 0.0).wanted(1_000_000) == 1.0, "rate 0: a fixed interval"
    assert Cadence(1.0, 3, 1e-3).wanted(10**6) == 2048.0, "never past MAX_HEARTBEAT_INTERVAL_S"
    assert Cadence(0.4, 3, 5.0).wanted(6) == pytest.approx(1.6)
    defaults = BrokerConfig()
    at_defaults = Cadence(defaults.heartbeat_interval_s, defaults.heartbeat_liveness, defaults.heartbeat_rate)
    assert [at_defaults.wanted(n) for n in (257, 1025)] == [1.0, 4.0], "256 or 1,024 actors and a learner"


def test_fit_grows_at_once_and_comes_down_with_a_margin() -> None:
    c = Cadence(1.0, 3, 256.0)
    assert not c.fit(100, 0.0) and c.interval_s == 1.0
    assert c.fit(1024, 1.0) and c.interval_s == 4.0
    assert c.expiry_s(1.0) == 12.0
    assert not c.fit(1000, 2.0), "still needs 4 s"
    # 500 members fit 2 s, but not with the margin (500 > 0.75 x 512): it stays at 4 s...
    assert not c.fit(500, 3.0) and c.interval_s == 4.0
    # ...and at 300 it comes down one step: 2 s would fit with the margin, 1 s would not.
    assert c.fit(300, 4.0) and c.interval_s == 2.0
    # members may keep 4 s until they hear of 2 s, then beat 2 s later: 3 x 4 + 2 s of silence is allowed...
    assert c.expiry_s(4.0) == 14.0 and c.expiry_s(4.0 + 11.9) == 14.0
    assert c.expiry_s(4.0 + 12.1) == 6.0, "...for as long as a member could still be keeping 4 s"
    assert c.fit(10, 20.0) and c.interval_s == 1.0


def test_an_id_waits_for_a_late_beat_and_is_taken_over_after_two_intervals_of_the_fleets_cadence() -> None:
    """A live member beats once an interval, and its beat lands a poll after it: one interval of silence must not
    hand its id to a second process (the refused-duplicate actor test once saw the second actor welcomed), nor
    refuse for good a process restarted at once after a kill (the replay service's restart test)."""
    c = Cadence(1.0, 3, 256.0)
    assert c.keeping_s(0.0) == 1.0
    assert c.fit(1024, 1.0) and c.keeping_s(1.0) == 4.0, "the fleet's interval, not the configured base"
    assert c.fit(300, 4.0) and c.keeping_s(4.0) == 4.0, "members may still keep 4 s..."
    assert c.keeping_s(4.0 + 12.1) == 2.0, "...until they have heard of 2 s"
    held = Member(peer_id="actor-0", role="actor", identity=b"a", host="h", pid=1)
    second = P.Hello(role="actor", peer_id="actor-0", host="h", pid=2)

    def conflict(silent_s: float) -> tuple[str, bool]:
        held.last_seen = time.monotonic() - silent_s
        return id_conflict(held, second, 1.0)

    why, final = conflict(0.5)
    assert final and "is in use by pid 1 on h" in why and "late" not in why, "a live holder: refused for good"
    for late_s in (1.0, 1.1, 1.9):  # a beat due or late, or a holder just killed: refused, asked again
        why, final = conflict(late_s)
        assert not final and "is in use by pid 1 on h" in why and "heartbeat is late" in why, late_s
    assert conflict(2.1) == ("", True), "a missed beat: a crashed process coming back takes it"
    held.last_seen, held.conn_closed = time.monotonic(), True
    assert conflict(0.0) == ("", True), "closed bus: its connection closed"


@pytest.mark.slow
def test_members_follow_the_interval_as_the_fleet_grows_and_shrinks(procs: Procs, tmp_path: Path, bus: Bus) -> None:
    # 0.4 s at most 5 beats/s: 2 members fit 0.4 s, 3-4 need 0.8 s, 5-8 need 1.6 s; base expiry 1.2 s.
    broker = ProfiledBroker(procs, tmp_path, heartbeat_interval_s=0.4, heartbeat_liveness=3, heartbeat_rate=5.0)
    broker.start()
    first = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-0"))
    assert first.wait_welcome(WAIT_S).heartbeat_interval_s == pytest.approx(0.4)
    others = [bus.link(broker.connect, P.Hello(role="actor", peer_id=f"actor-{i}")) for i in range(1, 5)]
    links = [first, *others]
    wait_for(lambda: all(link.interval_s == pytest.approx(1.6) for link in links), WAIT_S, "every link at 1.6 s")

    late = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-5"))
    assert late.wait_welcome(WAIT_S).heartbeat_interval_s == pytest.approx(1.6), "a newcomer is told in its welcome"
    links.append(late)

    # Members now beat every 1.6 s: silent longer than the base expiry (1.2 s), and kept.
    def someone_quiet_past_the_base_expiry() -> bool:
        rows = status(broker, bus)["members"]
        return len(rows) == 6 and max(row["last_seen_s"] for row in rows.values()) > 1.25

    wait_for(someone_quiet_past_the_base_expiry, WAIT_S, "a member silent for longer than 1.2 s")
    generations = [link.generation for link in links]

    for link in links[1:]:
        link.close()
    wait_for(lambda: first.interval_s == pytest.approx(0.4), WAIT_S, "the last member back at 0.4 s")
    wait_for(lambda: counters(broker, bus)["expired_or_left"] == 5, WAIT_S, "five byes")
    assert first.generation == generations[0] and first.reconnects == 0, "no member was expired on the way"
    assert list(status(broker, bus)["members"]) == ["actor-0"]


@pytest.mark.parametrize("interval", [1e-300, 0.005, -1.0, 3601.0])
def test_the_wire_refuses_an_interval_a_client_cannot_keep(interval: float) -> None:
    with pytest.raises(P.ProtocolError, match="interval_s must be 0 or in 0.01..3600"):
        P.decode(P.encode(P.Heartbeat(peer_id="broker", interval_s=interval)))
    welcome = P.Welcome(
        peer_id="a",
        run_id="",
        run=None,
        ports={},
        heartbeat_interval_s=interval,
        heartbeat_liveness=3,
        max_message_bytes=1024,
    )
    with pytest.raises(P.ProtocolError, match="heartbeat_interval_s must be in 0.01..3600"):
        P.decode(P.encode(welcome))
    for fine in (0.0, 0.01, 3600.0):
        assert P.decode(P.encode(P.Heartbeat(peer_id="broker", interval_s=fine))).interval_s == fine
