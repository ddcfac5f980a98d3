"""Refused handshakes on a closed bus are cheap for the broker and logged per peer address, aggregated per interval
(broker/zap.py, broker/auth.py): the ZAP handler's answers, its log of refusals, the socket monitor's addresses of
refusals libzmq makes before ZAP, and a real `zddrl broker --keys` under a burst of strangers' handshakes."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth
from zmq.utils import z85

from broker_clients import WAIT_S
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl.broker import zap
from zddrl.broker.auth import DOMAINS, HandshakeCounter, _AllowList
from zddrl.broker.zap import UNKNOWN_ADDRESS, RefusedHandshakes, ZapHandler
from zddrl.keys import credentials, new_key
from zddrl.transport.status import request_status

NULL_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
"""A ZMTP 3.0 greeting offering the NULL mechanism (no CURVE): what a client without keys sends."""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_refusals_are_logged_at_once_then_once_per_interval_per_address() -> None:
    lines: list[str] = []
    clock = Clock()
    refused = RefusedHandshakes(every_s=30.0, log=lines.append, clock=clock)
    raw = bytes(range(32))
    key, shown = raw.hex(), z85.encode(raw)[:8].decode()
    refused.note("10.0.0.7", ("unlisted", key))
    assert lines == [f"refused 1 handshake: 1 from 10.0.0.7 (a CURVE key the broker does not list, {shown}...: "
                     "not in its --keys, or revoked)"]  # fmt: skip
    for _ in range(500):
        clock.now += 0.01
        refused.note("10.0.0.7", ("unlisted", key))
    refused.note("10.0.0.9", ("no-curve", "control"))
    assert len(lines) == 1, "a flood within the interval logs nothing more"
    assert refused.flush() == pytest.approx(30.0 - 5.0)
    clock.now = 1000.0 + 30.0
    refused.flush()
    assert len(lines) == 2
    assert lines[1].startswith("refused 501 handshakes in the last 30 s: 500 from 10.0.0.7 (a CURVE key")
    assert lines[1].endswith("; 1 from 10.0.0.9 (no CURVE on control: a client without --keys)")
    assert refused.flush() == 30.0 and len(lines) == 2, "nothing new: no line"
    refused.note("10.0.0.7", ("unlisted", key))
    assert len(lines) == 2
    refused.flush(final=True)  # the broker stops: what the interval gathered is not lost
    assert lines[2] == lines[0], lines[2]


def test_the_refusal_log_keeps_a_bounded_table_and_names_the_busiest() -> None:
    lines: list[str] = []
    clock = Clock()
    refused = RefusedHandshakes(every_s=30.0, log=lines.append, clock=clock)
    refused.note("first", ("closed", "params"))
    for i in range(zap.MAX_SOURCES + 100):  # one address each, e.g. a v6 prefix
        refused.note(f"2001:db8::{i:x}", ("unlisted", "ab" * 32))
    for _ in range(50):
        refused.note("10.0.0.1", ("role", "monitor", "params"))
    assert len(refused._counts) == zap.MAX_SOURCES, "the table does not grow past its bound"
    clock.now += 30.0
    refused.flush()
    line, total = lines[-1], zap.MAX_SOURCES + 150  # "first" had a line of its own, at once
    assert line.startswith(f"refused {total} handshakes in the last 30 s: 50 from 10.0.0.1 (a monitor key, which "
                           "the params socket does not admit); 1 from ")  # fmt: skip
    assert len(re.findall(r"; 1 from ", line)) == zap.SOURCES_NAMED - 1, "the busiest are named, one by one"
    assert line.endswith(f"; {total - 50 - (zap.SOURCES_NAMED - 1)} more from other addresses")


class Judge:
    def __init__(self) -> None:
        self.denied = 0

    def judge(self, domain: bytes, key: bytes) -> tuple[str, tuple[str, ...] | None]:
        return ("actor:a", None) if key == b"k" * 32 else ("", ("unlisted", key.hex()))


@pytest.fixture
def handler() -> Iterator[tuple[ZapHandler, Judge, list[str]]]:
    ctx = zmq.Context()
    lines: list[str] = []
    judge = Judge()
    h = ZapHandler(ctx, judge, RefusedHandshakes(log=lines.append))
    yield h, judge, lines
    h.stop()
    ctx.destroy(linger=0)


def request(*, mechanism: bytes = b"CURVE", key: bytes = b"k" * 32, address: bytes = b"10.1.2.3") -> list[bytes]:
    return [b"1.0", b"7", b"control", address, b"", mechanism, key]


def test_the_zap_handler_admits_with_the_keys_user_and_refuses_with_a_count(handler) -> None:
    h, judge, lines = handler
    assert h.answer(request()) == [b"1.0", b"7", b"200", b"OK", b"actor:a", b""]
    assert h.answer(request(key=b"u" * 32))[2:5] == [b"400", b"not admitted", b""]
    assert h.answer(request(mechanism=b"PLAIN"))[2] == b"400"
    assert h.answer([b"1.0", b"8"])[:3] == [b"1.0", b"8", b"500"]
    assert judge.denied == 2
    assert lines == [f"refused 1 handshake: 1 from 10.1.2.3 (a CURVE key the broker does not list, "
                     f"{z85.encode(b'u' * 32)[:8].decode()}...: not in its --keys, or revoked)"]  # fmt: skip


def test_the_zap_handler_answers_libzmq_and_stops(handler) -> None:
    """On real sockets: a CURVE server of the handler's context admits a listed key, with its user, and refuses
    another."""
    h, _, _ = handler
    server, server_public, port = curve_server(h.ctx)
    listed, unlisted = zmq.curve_keypair(), zmq.curve_keypair()
    h.judge = allow = _AllowList({listed[0]: ("actor", "a")})
    clients = []
    for public, secret in (listed, unlisted):
        client = h.ctx.socket(zmq.DEALER)
        client.curve_serverkey, client.curve_publickey, client.curve_secretkey = server_public, public, secret
        client.linger = 0
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"hi")
        clients.append(client)
    assert server.poll(int(WAIT_S * 1000))
    frames = server.recv_multipart(copy=False)
    assert frames[1].bytes == b"hi" and frames[1].get("User-Id") == "actor:a"
    wait_for(lambda: allow.denied >= 1, WAIT_S, "the unlisted key's refusal")
    assert not server.poll(300), "nothing from the refused client"
    for sock in (*clients, server):
        sock.close(linger=0)
    h.stop()
    assert not h._thread.is_alive()


def test_a_request_the_handler_fails_on_is_refused_and_the_next_answered(handler) -> None:
    h, judge, _ = handler

    def broken(domain: bytes, key: bytes) -> tuple[str, tuple[str, ...] | None]:
        raise KeyError("a bug")

    judge.judge = broken  # type: ignore[method-assign]
    assert h._reply(request())[:3] == [b"1.0", b"7", b"500"] and h.errors == 1
    del judge.judge
    assert h._reply(request())[2] == b"200"


def curve_server(ctx: zmq.Context) -> tuple[zmq.Socket, bytes, int]:
    public, secret = zmq.curve_keypair()
    server = ctx.socket(zmq.ROUTER)
    server.curve_server, server.curve_secretkey, server.curve_publickey = True, secret, public
    server.zap_domain = b"control"
    return server, public, server.bind_to_random_port("tcp://127.0.0.1")


def test_a_handler_whose_thread_died_admits_no_one(handler) -> None:
    """libzmq admits every key on a CURVE server whose context has no ZAP handler: a dead handler's socket stays
    bound, so that handshakes wait unanswered instead."""
    h, judge, _ = handler

    def crash() -> float:
        raise RuntimeError("a bug in the loop")

    h.refused.flush = crash  # type: ignore[method-assign]
    asker = h.ctx.socket(zmq.REQ)
    asker.connect(zap.ZAP_ENDPOINT)
    asker.send_multipart(request())  # answered; then the loop comes round, and crashes
    assert asker.poll(int(WAIT_S * 1000)) and asker.recv_multipart()[2] == b"200"
    asker.close(linger=0)
    wait_for(lambda: not h._thread.is_alive(), WAIT_S, "the handler's thread to die")
    server, server_public, port = curve_server(h.ctx)
    client = h.ctx.socket(zmq.DEALER)
    public, secret = zmq.curve_keypair()
    client.curve_serverkey, client.curve_publickey, client.curve_secretkey = server_public, public, secret
    client.linger = 0
    client.connect(f"tcp://127.0.0.1:{port}")
    client.send(b"hi")
    assert not server.poll(1000), "a message got through with no handler answering"
    for sock in (client, server):
        sock.close(linger=0)
    h.refused.flush = lambda final=False: 0.0  # type: ignore[method-assign]
    h.stop()
    assert h._zap.closed


def test_the_allow_list_judges_raw_keys_by_domain_and_swaps_whole() -> None:
    actor_public, _ = zmq.curve_keypair()
    monitor_public, _ = zmq.curve_keypair()
    allow = _AllowList({actor_public: ("actor", "a"), monitor_public: ("monitor", "m")})
    raw = {k: z85.decode(k) for k in (actor_public, monitor_public)}
    assert allow.judge(b"params", raw[actor_public]) == ("actor:a", None)
    assert allow.judge(b"params", raw[monitor_public]) == ("", ("role", "monitor", "params"))
    assert allow.judge(b"control", raw[monitor_public]) == ("monitor:m", None)
    assert allow.judge(b"control", b"\x00" * 32) == ("", ("unlisted", "00" * 32))
    allow.allowed = {monitor_public: ("monitor", "m")}  # a reload that revoked the actor key
    assert allow.judge(b"params", raw[actor_public])[1] == ("unlisted", raw[actor_public].hex())
    assert set(DOMAINS) == {"control", "trajectories", "learners", "params"}


@pytest.fixture
def monitored() -> Iterator[tuple[zmq.Socket, HandshakeCounter, list[tuple[str, tuple[str, ...]]]]]:
    ctx = zmq.Context()
    public, secret = zmq.curve_keypair()
    control = ctx.socket(zmq.ROUTER)
    control.curve_server, control.curve_secretkey, control.curve_publickey = True, secret, public
    control.zap_domain = b"control"
    control.bind_to_random_port("tcp://127.0.0.1")
    noted: list[tuple[str, tuple[str, ...]]] = []

    class Noted(RefusedHandshakes):
        def note(self, address: str, reason: tuple[str, ...]) -> None:
            noted.append((address, reason))

    counter = HandshakeCounter([control], closes_of=control, refused=Noted())
    yield control, counter, noted
    counter.close()
    control.close(linger=0)
    ctx.destroy(linger=0)


def drain_until(counter: HandshakeCounter, counters: dict[str, int], condition, what: str) -> list[int]:
    closed: list[int] = []

    def step() -> bool:
        if counter.monitors[0].poll(20):
            closed.extend(counter.drain(counter.monitors[0], counters))
        return condition()

    wait_for(step, WAIT_S, what, interval_s=0.0)
    return closed


@pytest.mark.parametrize(
    ("greeting", "reason"),
    [(NULL_GREETING, ("no-curve", "control")), (b"", ("closed", "control"))],
    ids=["no-curve", "closed"],
)
def test_a_failure_before_zap_is_noted_with_the_peers_address(monitored, greeting: bytes, reason) -> None:
    control, counter, noted = monitored
    port = int(control.last_endpoint.rsplit(b":", 1)[1])
    counters = {"handshakes_ok": 0, "handshakes_failed": 0}
    with socket.create_connection(("127.0.0.1", port)) as peer:
        drain_until(counter, counters, lambda: counter._peers, "the connection's ACCEPTED")
        assert list(counter._peers.values()) == ["127.0.0.1"]
        if greeting:
            peer.sendall(greeting)
            drain_until(counter, counters, lambda: noted, "the refused greeting")
    if not greeting:  # closed before any greeting: libzmq reports no detail
        drain_until(counter, counters, lambda: noted, "the closed connection")
    assert noted == [("127.0.0.1", reason)]
    assert counters == {"handshakes_ok": 0, "handshakes_failed": 1}
    assert counter._peers == {}, "no address kept for a closed connection"


def test_a_connection_closed_before_its_address_was_read_is_not_guessed(monitored) -> None:
    control, counter, noted = monitored
    port = int(control.last_endpoint.rsplit(b":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as peer:
        peer.sendall(NULL_GREETING)
        while peer.recv(4096):  # the broker's greeting, then its close: over before the monitor is read at all
            pass
    counters = {"handshakes_ok": 0, "handshakes_failed": 0}
    closed = drain_until(counter, counters, lambda: noted, "the refused greeting")
    assert noted == [(UNKNOWN_ADDRESS, ("no-curve", "control"))] and len(closed) == 1


def test_a_closed_counter_leaves_the_contexts_io_thread_free() -> None:
    """libzmq's I/O thread sends each monitor event with a blocking send: once a monitor socket is closed, the next
    event of a socket still monitored waits forever, and every socket of the context with it (a memory reset found
    its control port still taken for good: the listener's close waited behind the event). A closed counter stops
    its monitors first: a connection is still answered and the port binds again."""
    ctx = zmq.Context()
    control = ctx.socket(zmq.ROUTER)
    control.linger = 0
    port = control.bind_to_random_port("tcp://127.0.0.1")
    HandshakeCounter([control], closes_of=control, refused=RefusedHandshakes()).close()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as peer:
        greeting = peer.recv(64)  # ZMTP's signature, sent by the I/O thread after it reported ACCEPTED
    assert greeting[:1] == b"\xff", greeting
    control.close(linger=0)
    again = ctx.socket(zmq.ROUTER)
    again.linger = 0

    def bound() -> bool:
        try:
            again.bind(f"tcp://127.0.0.1:{port}")
        except zmq.ZMQError:
            return False
        return True

    wait_for(bound, WAIT_S, "the port to bind again")
    again.close()
    ctx.term()  # only once the I/O thread is known free: a stuck one would hang here


FULL_MONITOR = """
import socket, zmq
from zddrl.broker.auth import HandshakeCounter
from zddrl.broker.zap import RefusedHandshakes
ctx = zmq.Context()
control = ctx.socket(zmq.ROUTER)
control.linger = 0
port = control.bind_to_random_port("tcp://127.0.0.1")
counter = HandshakeCounter([control], closes_of=control, refused=RefusedHandshakes())
made = timeouts = 0
while made < 1500 and timeouts < 6:  # a full queue stops libzmq's accepts: the connects then time out in a row
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        made, timeouts = made + 1, 0
    except OSError:
        timeouts += 1
counter.close()
control.close(linger=0)
ctx.term()
print("closed after", made, "connections")
"""


def test_a_counter_whose_monitors_are_full_closes() -> None:
    """A monitor nobody read for a while (~700 connections: its queue's 2,000 events) holds libzmq's I/O thread in
    a blocking send under the socket's monitor lock, which ``disable_monitor`` also takes (holding the GIL: the
    whole process stops, hence a process of its own here): the counter reads what is queued first, so its close
    returns (a broker's stop after a standby's wait, or a flood of connections, could hang there)."""
    done = subprocess.run(
        [sys.executable, "-c", FULL_MONITOR], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0 and "closed after" in done.stdout, done.stderr[-2000:]
    assert int(done.stdout.split()[2]) >= 700, f"the queue was never full: {done.stdout}"


# ---------------------------------------------------------------------------------------------- a real broker


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    for role, name in [("broker", "b"), ("learner", "l"), ("actor", "a"), ("monitor", "m")]:
        new_key(root, role, name)
    return root


def refused_lines(procs: Procs) -> list[str]:
    return [line for line in procs.log("broker").splitlines() if " refused " in line and "handshake" in line]


@pytest.mark.slow
def test_a_burst_of_strangers_handshakes_is_refused_logged_once_and_the_broker_serves_on(
    procs: Procs, tmp_path: Path, keys: Path, bus: Bus
) -> None:
    broker = BrokerHandle(procs, tmp_path).start("--keys", str(keys))
    server_key = zmq.auth.load_certificate(str(keys / "broker" / "b.key"))[0]
    public, secret = zmq.curve_keypair()
    strangers = []
    for i in range(60):  # each a new connection that never retries: one handshake each
        sock = bus.socket(zmq.DEALER, reconnect_ivl=-1)
        if i % 3:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, public, secret
        sock.connect(broker.connect)
        strangers.append(sock)
    monitor = credentials(keys, "monitor", "m")

    def counted() -> dict | None:
        body = request_status(broker.connect, WAIT_S, bus.ctx, credentials=monitor)
        b = body["broker"] if body is not None else {}
        return b if b.get("zap_denied", 0) >= 40 and b.get("handshakes_failed", 0) >= 60 else None

    b = wait_for(counted, WAIT_S * 2, "60 refused handshakes counted")
    assert isinstance(b, dict) and b["zap_denied"] == 40 and b["handshakes_failed"] == 60, b
    lines = refused_lines(procs)
    assert len(lines) == 1, lines  # the first at once; the rest wait for the interval's line
    assert re.search(r"refused 1 handshake: 1 from (127\.0\.0\.1|an unknown address) \(", lines[0]), lines[0]
    if "CURVE key" in lines[0]:
        assert f"{public.decode()[:8]}..." in lines[0]
