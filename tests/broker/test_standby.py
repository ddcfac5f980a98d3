"""A standby pair of brokers (``broker.peer``, zddrl/broker/standby.py): only the active one takes clients.

The state machine is checked on its own (``Standby.observe`` with made-up answers, ``tick`` and ``admits`` with a
made-up clock), then with real `zddrl broker`
processes on 127.0.0.1 and real client links: a backup refuses clients while the primary lives and takes them after
the primary's kill -9 within the bound docs/deploying.md states; a client cut off from the primary alone (its route
to it closed, the brokers still seeing each other) is sent back by the backup, never welcomed there, and returns to
the primary when its route heals; a primary restarted after a failover finds the backup active and stays passive.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_clients import ProfiledBroker
from conftest import Bus, Procs, wait_for
from zddrl import protocol as P
from zddrl.broker.standby import ACTIVE, PASSIVE, STARTING, Standby, peer_state, standby_of
from zddrl.brokerconf import BrokerConfig
from zddrl.ops.status import format_status
from zddrl.proc import free_ports
from zddrl.tomlconf import ConfigError
from zddrl.transport.fallback import RECONNECT_INITIAL_S, Brokers
from zddrl.transport.link import BrokerLink
from zddrl.transport.session import PASSIVE as PASSIVE_CAUSE
from zddrl.transport.session import Session
from zddrl.transport.status import request_status

INTERVAL_S, LIVENESS = 0.2, 3
HEARTBEAT: dict[str, Any] = {"heartbeat_interval_s": INTERVAL_S, "heartbeat_liveness": LIVENESS}
FAILOVER_BOUND_S = INTERVAL_S * (LIVENESS + 2) + 0.5
"""docs/deploying.md, "A standby broker": the primary's kill -9 to the client welcomed by the backup."""
SCHEDULING_S = 1.0
"""Added to the bound in the assertion: five processes share two cores under test, and a process that is not
scheduled for a while delays the probe or the client by as much."""
WAIT_S = 20.0
PEER = "tcp://127.0.0.1:6001"


def body_of(state: str | None) -> dict:
    """A status body whose broker is in ``state`` (None: a broker without a peer)."""
    return {"broker": {"standby": None if state is None else {"state": state}}}


# ---------------------------------------------------------------- the state machine alone


def machine(role: str) -> Standby:
    return Standby(BrokerConfig(peer=PEER, peer_role=role, **HEARTBEAT))  # not started: no probe thread


def probe(s: Standby, body: dict | None, now: float, refused: bool = False) -> None:
    """One probe's outcome, then the broker's tick that applies it."""
    s.observe(body, now, refused=refused)
    s.tick(now)


def test_a_backup_starts_passive_and_takes_over_after_its_peer_is_silent_for_interval_x_liveness() -> None:
    s = machine("backup")
    t0 = s.started
    assert s.state == PASSIVE and not s.active
    probe(s, body_of(ACTIVE), t0 + 0.1)
    s.knocked = t0 + 0.2  # a client asked it (the voter rule)
    probe(s, None, t0 + 0.1 + INTERVAL_S * LIVENESS - 0.01)
    assert s.state == PASSIVE, "silent for less than interval x liveness"
    probe(s, None, t0 + 0.1 + INTERVAL_S * LIVENESS + 0.001)
    assert s.state == ACTIVE
    s.members = lambda: 1  # a client took it
    probe(s, answer(ACTIVE, 2), t0 + 5)  # the primary is back, active, with clients: a warning and the status say it
    assert s.state == ACTIVE and s.both_active(t0 + 5) and s.status(t0 + 5)["both_active"]
    assert not s.both_active(t0 + 5 + INTERVAL_S * LIVENESS + 0.1), "the peer's answer is old: it is gone again"


def answer(state: str, members: int) -> dict:
    return {"broker": {"standby": {"state": state}, "members_total": members}}


@pytest.mark.parametrize(
    ("role", "mine", "theirs", "state"),
    [
        ("primary", 0, 3, PASSIVE),  # the partition that cut the primary from everyone healed: the backup has the run
        ("backup", 0, 3, PASSIVE),
        ("primary", 2, 3, ACTIVE),  # a real split: both stay, both warn, the status says so
        ("primary", 2, 0, ACTIVE),
        ("primary", 0, 0, ACTIVE),  # both empty: the backup yields, the primary stays
        ("backup", 0, 0, PASSIVE),
    ],
)
def test_of_two_active_brokers_only_one_that_holds_no_members_yields(
    role: str, mine: int, theirs: int, state: str
) -> None:
    s = Standby(BrokerConfig(peer=PEER, peer_role=role, **HEARTBEAT), members=lambda: mine)
    s.state = ACTIVE
    probe(s, answer(ACTIVE, theirs), s.started + 1)
    assert s.state == state
    assert s.status(s.started + 1)["both_active"] == (state == ACTIVE)
    assert s.status(s.started + 1)["peer_members"] == theirs


def test_a_backup_whose_peer_never_answered_counts_the_silence_from_its_own_start() -> None:
    s = machine("backup")
    assert not s.admits(s.started + INTERVAL_S * LIVENESS - 0.01), "a knock before the silence period"
    assert s.state == PASSIVE
    probe(s, None, s.started + INTERVAL_S * LIVENESS + 0.001)
    assert s.state == ACTIVE


@pytest.mark.parametrize(
    ("answer", "state"),
    [(ACTIVE, PASSIVE), (PASSIVE, ACTIVE), (STARTING, ACTIVE), (None, STARTING), ("no peer", PASSIVE)],
)
def test_a_primary_decides_on_its_first_answer_and_waits_on_silence(answer: str | None, state: str) -> None:
    s = machine("primary")
    assert s.state == STARTING and not s.active
    assert s.refusal().startswith(P.PASSIVE_PREFIX) and PEER in s.refusal()
    body = None if answer is None else body_of(None if answer == "no peer" else answer)  # None: no answer
    probe(s, body, s.started + 0.05)
    assert s.state == state


def test_two_passive_brokers_do_not_wait_on_each_other_forever() -> None:
    p = machine("primary")  # restarted after a failover: it found the backup active and stayed passive
    probe(p, body_of(ACTIVE), p.started + 0.1)
    assert p.state == PASSIVE
    probe(p, body_of(PASSIVE), p.started + 0.3)  # the backup crashed and came back passive within the silence
    assert p.state == ACTIVE, "a primary whose peer says passive is active at once"
    b = machine("backup")
    t0 = b.started
    probe(b, body_of(PASSIVE), t0 + 0.1)
    probe(b, body_of(STARTING), t0 + 0.1 + INTERVAL_S * LIVENESS - 0.01)
    assert b.state == PASSIVE, "a backup gives a passive peer one silence period"
    # a hundredth past the period: t0 is the real clock's, and (t0 + 0.1 + x) - (t0 + 0.1) may round below x
    probe(b, body_of(PASSIVE), t0 + 0.1 + INTERVAL_S * LIVENESS + 0.01)
    assert b.state == ACTIVE, "two backups: one becomes active"


def test_a_peer_of_the_same_role_is_a_misconfiguration_said_in_the_log_and_the_status() -> None:
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m), level="ERROR")
    try:
        s = machine("backup")
        for i in range(5):  # five probes within one interval: one error
            probe(s, {"broker": {"standby": {"state": PASSIVE, "role": "backup"}}}, s.started + 0.01 * i)
    finally:
        logger.remove(sink)
    assert len(lines) == 1 and "both brokers of the standby pair are configured backup" in lines[0], lines
    assert s.status(s.started)["same_role"] and s.status(s.started)["peer_role"] == "backup"


def test_a_refused_probe_is_an_answer_and_a_backup_no_client_asks_for_stays_passive() -> None:
    s = machine("backup")
    t0 = s.started
    probe(s, body_of(ACTIVE), t0 + 0.1)
    for i in range(1, 20):  # someone floods the primary's status: every probe is refused, none silent
        s.knocked = t0 + 0.1 * i
        probe(s, None, t0 + 0.1 + 0.1 * i, refused=True)
    assert s.state == PASSIVE and s.peer_said == ACTIVE and s.status(t0 + 2)["refusals"] == 19
    silent_at = t0 + 2 + INTERVAL_S * LIVENESS + 0.01
    probe(s, None, silent_at)  # the primary is silent now, but no client asked the backup lately
    assert s.state == PASSIVE, "no voter: no takeover"
    assert s.admits(silent_at + 0.01), "a client asks: the backup takes over and admits it at once"


def test_a_restarted_primary_waits_the_silence_period_before_it_goes_active() -> None:
    s = machine("primary")
    s.knocked = s.started + 0.01
    probe(s, None, s.started + INTERVAL_S)  # one unanswered probe
    assert s.state == STARTING and not s.active
    s.knocked = s.started + INTERVAL_S * LIVENESS - 0.05
    probe(s, None, s.started + INTERVAL_S * LIVENESS + 0.001)  # past it: the clock's rounding
    assert s.state == ACTIVE


def test_the_probe_only_records_and_the_loop_changes_the_state() -> None:
    s = Standby(BrokerConfig(peer=PEER, peer_role="backup", **HEARTBEAT), members=lambda: 0)
    s.state = ACTIVE
    s.observe(answer(ACTIVE, 3), s.started + 1)  # the probe thread, while the loop may admit a hello
    assert s.state == ACTIVE, "no state change off the broker's loop"
    s.members = lambda: 1  # the loop admitted a hello in between
    s.tick(s.started + 1.01)
    assert s.state == ACTIVE, "a broker that holds a member does not step down"


def test_what_a_status_body_says_of_its_broker() -> None:
    assert peer_state(None) is None
    assert peer_state({"broker": {}}) == ACTIVE  # an older broker, or one without a peer: it takes clients
    assert peer_state(body_of(PASSIVE)) == PASSIVE
    assert peer_state({"broker": {"standby": {"state": "sideways"}}}) == ACTIVE
    assert peer_state({"broker": "not a map"}) == ACTIVE


def test_the_pair_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="primary or backup"):
        BrokerConfig(peer=PEER, peer_role="second")
    with pytest.raises(ConfigError, match="one broker"):
        BrokerConfig(peer=f"{PEER},tcp://127.0.0.1:6002")
    with pytest.raises(ConfigError, match="not this one's bind"):
        BrokerConfig(bind=PEER, peer=PEER)
    assert standby_of(BrokerConfig()) is None


def test_a_closed_bus_pair_needs_a_monitor_key_for_its_probe(tmp_path: Path) -> None:
    (tmp_path / "broker").mkdir()
    with pytest.raises(ConfigError, match="monitor key"):
        standby_of(BrokerConfig(peer=PEER, keys=str(tmp_path)))


def test_a_passive_answer_ends_the_session_at_once_and_keeps_the_shortest_backoff() -> None:
    session = Session(0.0, fallback=True)
    assert session.ended(0.01) == ""
    session.passive(f"{P.PASSIVE_PREFIX}use {PEER}")
    assert session.ended(0.01).startswith(PASSIVE_CAUSE)
    brokers = Brokers("tcp://127.0.0.1:6002,tcp://127.0.0.1:6003")
    assert brokers.next(False, answered=True) == 0.0, "within a pass: on to the next at once"
    assert brokers.next(False) == RECONNECT_INITIAL_S, "a broker of the pass answered: no growing backoff"
    assert brokers.next(False) == 0.0 and brokers.next(False) == RECONNECT_INITIAL_S * 2
    line = brokers.moving("tcp://127.0.0.1:6003", 0.0, session.ended(0.01))
    assert "tcp://127.0.0.1:6003 is a passive standby; moving to the broker at" in line and "silent" not in line


# ---------------------------------------------------------------- real brokers


class Pair:
    """A primary (a) and a backup (b) broker naming each other, each in a folder of its own."""

    def __init__(self, tmp_path: Path) -> None:
        self.folders = {name: tmp_path / name for name in ("a", "b")}
        self.procs = {name: Procs(folder) for name, folder in self.folders.items()}
        for folder in self.folders.values():
            folder.mkdir()
        self.a = ProfiledBroker(self.procs["a"], self.folders["a"], **HEARTBEAT)
        self.b = ProfiledBroker(self.procs["b"], self.folders["b"], **HEARTBEAT)

    def start(self, name: str) -> ProfiledBroker:
        me, peer = (self.a, self.b) if name == "a" else (self.b, self.a)
        return me.start("--peer", peer.connect, "--peer-role", "primary" if name == "a" else "backup")

    def log(self, name: str) -> str:
        return self.procs[name].log("broker")

    def close(self) -> None:
        for procs in self.procs.values():
            procs.stop_all()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path)
    try:
        yield p
    finally:
        p.close()


def standby(connect: str) -> dict:
    """The broker's ``standby`` status map, with its members' ids and its count of hellos sent to the peer."""
    body = request_status(connect, 2.0)
    assert body is not None, f"no status from {connect}"
    b = body["broker"]
    return {**b["standby"], "members": set(body["members"]), "hello_passive": b.get("hello_passive", 0)}


def state_is(connect: str, state: str) -> bool:
    body = request_status(connect, 1.0)
    return body is not None and body["broker"]["standby"]["state"] == state


def welcomed_at(link: BrokerLink, connect: str) -> bool:
    return link.welcome is not None and link.connect == connect and link.generation > 0


def test_a_backup_refuses_clients_while_the_primary_lives_and_takes_them_after_its_kill(pair: Pair, bus: Bus) -> None:
    pair.start("a")  # starting: alone, with no client asking, it waits for its peer (the voter rule)
    pair.start("b")
    wait_for(lambda: state_is(pair.a.connect, ACTIVE), WAIT_S, "the primary to be active: its peer says passive")
    wait_for(lambda: standby(pair.b.connect)["peer_state"] == ACTIVE, WAIT_S, "the backup to see the primary active")
    wait_for(lambda: state_is(pair.b.connect, PASSIVE), WAIT_S, "the backup to answer, passive")
    # The backup first in the list: a client that tries it is sent on to the primary at once.
    link = bus.link(f"{pair.b.connect},{pair.a.connect}", P.Hello(role="actor", peer_id="actor-0"))
    wait_for(lambda: welcomed_at(link, pair.a.connect), WAIT_S, "the client welcomed by the primary")
    b = standby(pair.b.connect)
    assert b["hello_passive"] >= 1 and b["members"] == set(), b
    assert b["peer_state"] == ACTIVE and b["peer_answered_s_ago"] is not None and not b["both_active"]
    assert standby(pair.a.connect)["members"] == {"actor-0"}
    assert "STANDBY BACKUP: PASSIVE" in format_status(request_status(pair.b.connect, 2.0) or {}).upper()

    generation = link.generation
    assert pair.a.proc is not None
    pair.a.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    pair.a.proc.wait(timeout=10)
    wait_for(
        lambda: link.generation > generation and welcomed_at(link, pair.b.connect),
        WAIT_S,
        "the client welcomed by the backup",
        interval_s=0.01,
    )
    took_s = time.monotonic() - killed
    print(f"\nkill -9 of the primary to the client welcomed by the backup: {took_s:.2f} s (bound {FAILOVER_BOUND_S} s)")
    assert took_s <= FAILOVER_BOUND_S + SCHEDULING_S
    b = standby(pair.b.connect)
    assert b["state"] == ACTIVE and b["members"] == {"actor-0"}
    assert "taking over, active" in pair.log("b")


class Route:
    """A TCP route from a port of its own to ``target_port`` on 127.0.0.1: ``cut()`` closes it (its listener and
    every connection through it), ``heal()`` opens it again. What a client sees of a broker whose host is cut off
    from the client's alone: that broker's peer still reaches it directly."""

    def __init__(self, target_port: int) -> None:
        self.port, self.target = free_ports(1)[0], target_port
        self.connect = f"tcp://127.0.0.1:{self.port}"
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def heal(self) -> Route:
        self._stop.clear()
        listener = socket.create_server(("127.0.0.1", self.port))
        listener.settimeout(0.05)
        self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._thread.start()
        return self

    def cut(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            for s in self._socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self._socks.clear()

    def _accept(self, listener: socket.socket) -> None:
        with listener:
            while not self._stop.is_set():
                try:
                    client, _ = listener.accept()
                except TimeoutError:
                    continue
                server = socket.create_connection(("127.0.0.1", self.target))
                with self._lock:
                    self._socks += [client, server]
                for src, dst in ((client, server), (server, client)):
                    threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def test_a_client_cut_off_from_the_primary_alone_is_sent_back_and_never_stays_on_the_backup(
    pair: Pair, bus: Bus
) -> None:
    pair.start("a")  # starting: alone, with no client asking, it waits for its peer (the voter rule)
    pair.start("b")
    wait_for(lambda: state_is(pair.a.connect, ACTIVE), WAIT_S, "the primary to be active: its peer says passive")
    wait_for(lambda: standby(pair.b.connect)["peer_state"] == ACTIVE, WAIT_S, "the backup to see the primary active")
    wait_for(lambda: state_is(pair.b.connect, PASSIVE), WAIT_S, "the backup to answer, passive")
    route = Route(pair.a.ports[0]).heal()
    try:
        link = bus.link(f"{route.connect},{pair.b.connect}", P.Hello(role="actor", peer_id="actor-0"))
        wait_for(lambda: welcomed_at(link, route.connect), WAIT_S, "the client welcomed by the primary")
        generation, refused = link.generation, standby(pair.b.connect)["hello_passive"]
        route.cut()
        # Several passes over the list: each one asks the backup, which sends the client back.
        wait_for(
            lambda: standby(pair.b.connect)["hello_passive"] >= refused + 3, WAIT_S, "the backup to refuse 3 hellos"
        )
        b = standby(pair.b.connect)
        assert b["state"] == PASSIVE and b["members"] == set(), "the backup took a client while the primary lives"
        assert link.generation == generation, "welcomed by nobody while cut off"
        route.heal()
        wait_for(
            lambda: link.generation > generation and welcomed_at(link, route.connect),
            WAIT_S,
            "the client back on the primary",
        )
        assert standby(pair.b.connect)["members"] == set() and state_is(pair.b.connect, PASSIVE)
        assert standby(pair.a.connect)["members"] == {"actor-0"}
    finally:
        route.cut()


def test_a_restarted_primary_finds_the_backup_active_and_stays_passive(pair: Pair, bus: Bus) -> None:
    pair.start("a")  # starting: alone, with no client asking, it waits for its peer (the voter rule)
    pair.start("b")
    wait_for(lambda: state_is(pair.a.connect, ACTIVE), WAIT_S, "the primary to be active: its peer says passive")
    wait_for(lambda: standby(pair.b.connect)["peer_state"] == ACTIVE, WAIT_S, "the backup to see the primary active")
    wait_for(lambda: state_is(pair.b.connect, PASSIVE), WAIT_S, "the backup to answer, passive")
    link = bus.link(f"{pair.a.connect},{pair.b.connect}", P.Hello(role="actor", peer_id="actor-0"))
    wait_for(lambda: welcomed_at(link, pair.a.connect), WAIT_S, "the client welcomed by the primary")
    first = link.generation
    assert pair.a.proc is not None
    pair.a.proc.send_signal(signal.SIGKILL)
    pair.a.proc.wait(timeout=10)
    wait_for(lambda: link.generation > first and welcomed_at(link, pair.b.connect), WAIT_S, "the client on the backup")

    pair.start("a")  # the same ports: every client's list still names it first
    wait_for(lambda: state_is(pair.a.connect, PASSIVE), WAIT_S, "the restarted primary to stay passive")
    late = bus.link(f"{pair.a.connect},{pair.b.connect}", P.Hello(role="actor", peer_id="actor-1"))
    wait_for(lambda: welcomed_at(late, pair.b.connect), WAIT_S, "a new client sent on to the backup")
    generation = link.generation
    time.sleep(INTERVAL_S * LIVENESS * 3)  # what the test checks is that nothing changes in this time
    a, b = standby(pair.a.connect), standby(pair.b.connect)
    assert a["state"] == PASSIVE and a["members"] == set() and a["hello_passive"] >= 1, a
    assert b["state"] == ACTIVE and b["members"] == {"actor-0", "actor-1"} and not b["both_active"], b
    assert link.generation == generation and welcomed_at(link, pair.b.connect), "the run stays on the backup"
    assert "this primary stays passive" in pair.log("a")


def test_a_relay_sent_on_by_the_passive_backup_joins_the_primary(pair: Pair, tmp_path: Path) -> None:
    pair.start("a")  # starting: alone, with no client asking, it waits for its peer (the voter rule)
    pair.start("b")
    wait_for(lambda: state_is(pair.a.connect, ACTIVE), WAIT_S, "the primary to be active: its peer says passive")
    wait_for(lambda: standby(pair.b.connect)["peer_state"] == ACTIVE, WAIT_S, "the backup to see the primary active")
    wait_for(lambda: state_is(pair.b.connect, PASSIVE), WAIT_S, "the backup to answer, passive")
    folder = tmp_path / "relay"
    folder.mkdir()
    procs = Procs(folder)
    try:
        relay = ProfiledBroker(procs, folder, **HEARTBEAT).start("--upstream", f"{pair.b.connect},{pair.a.connect}")

        def upstream() -> dict:
            body = request_status(relay.connect, 2.0)
            return body["broker"]["upstream"] if body is not None else {}

        wait_for(lambda: upstream().get("welcomed") and upstream()["connect"] == pair.a.connect, WAIT_S, "the relay up")
        roles = [m["role"] for m in (request_status(pair.a.connect, 2.0) or {}).get("members", {}).values()]
        assert roles == ["relay"], roles
        b = standby(pair.b.connect)
        assert b["hello_passive"] >= 1 and b["members"] == set(), b
        assert f"{pair.b.connect} is a passive standby; moving to the broker at {pair.a.connect}" in procs.log("broker")
    finally:
        procs.stop_all()
