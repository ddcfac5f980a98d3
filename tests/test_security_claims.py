"""Claims of docs/security.md that no other test held: what crosses the wire of a closed bus is ciphertext and a
changed byte is never read, a revoked key's open connections are refused and counted, each key role is admitted
on the sockets the doc names, the broker's sockets carry the documented bounds, and what the root keeps of a
relay's reports is bounded. End-to-end claims run a real `zddrl broker --keys` on 127.0.0.1."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from broker_clients import WAIT_S, in_process_broker, learner_hello, parameters, run_spec, trajectory
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl import protocol as P
from zddrl.broker.auth import DOMAINS, _AllowList
from zddrl.broker.sockets import open_sockets
from zddrl.brokerconf import BrokerConfig
from zddrl.keys import Credentials, credentials, new_key
from zddrl.transport.signatures import signed_hello, signed_params
from zddrl.transport.status import request_status

SILENCE_MS = 1500
"""How long a client listens for an answer that must not come."""
MARKER = "plaintext-marker-5b1f"
"""A string a client sends and a status reply carries back: it must never cross the wire readable."""


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    for role, name in [("broker", "b"), ("learner", "l"), ("actor", "a"), ("actor", "b"), ("monitor", "m")]:
        new_key(root, role, name)
    return root


@pytest.fixture
def closed(procs: Procs, tmp_path: Path, keys: Path) -> BrokerHandle:
    return BrokerHandle(procs, tmp_path).start("--keys", str(keys))


def who(keys: Path, role: str, name: str) -> Credentials:
    return credentials(keys, role, name)


def counters(broker: BrokerHandle, bus: Bus, keys: Path) -> dict:
    body = request_status(broker.connect, WAIT_S, bus.ctx, credentials=who(keys, "monitor", "m"))
    assert body is not None, "no status for the monitor key"
    return body


def dealer(bus: Bus, creds: Credentials, endpoint: str, kind: int = zmq.DEALER) -> zmq.Socket:
    sock = bus.socket(kind)
    creds.apply(sock)
    sock.connect(endpoint)
    return sock


def ask(sock: zmq.Socket, msg: P.Message) -> P.Message | None:
    sock.send_multipart(P.encode(msg), zmq.NOBLOCK)
    return P.decode(sock.recv_multipart()) if sock.poll(SILENCE_MS) else None


def handshaken(bus: Bus, creds: Credentials, endpoint: str) -> zmq.Socket:
    """A DEALER of ``creds`` connected to ``endpoint`` once its CURVE handshake has succeeded."""
    sock = bus.socket(zmq.DEALER)
    creds.apply(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(endpoint)
    try:
        assert monitor.poll(int(WAIT_S * 1000)), f"no CURVE handshake with {endpoint}"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
    return sock


class Tap:
    """A TCP forwarder between clients and one broker port (the network between hosts): it records every byte each
    way and, once ``tamper`` is set, flips one bit in each chunk a client sends."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.up = bytearray()
        self.down = bytearray()
        self.tamper = threading.Event()
        self.corrupted = 0
        self._peer: dict[socket.socket, socket.socket] = {}
        self._clients: set[socket.socket] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            readable, _, _ = select.select([self.listener, *self._peer], [], [], 0.05)
            for sock in readable:
                if sock is self.listener:
                    client, _ = sock.accept()
                    server = socket.create_connection(("127.0.0.1", self.target_port))
                    self._peer[client], self._peer[server] = server, client
                    self._clients.add(client)
                elif sock in self._peer:
                    self._forward(sock)

    def _forward(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        if sock in self._clients:
            self.up += data
            if self.tamper.is_set():
                changed = bytearray(data)
                changed[len(changed) // 2] ^= 0x01
                data, self.corrupted = bytes(changed), self.corrupted + 1
        else:
            self.down += data
        try:
            self._peer[sock].sendall(data)
        except OSError:
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        other = self._peer.pop(sock, None)
        for s in (sock, other):
            if s is not None:
                self._peer.pop(s, None)
                self._clients.discard(s)
                s.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in [*self._peer, self.listener]:
            sock.close()


@pytest.fixture
def tap(closed: BrokerHandle) -> Iterator[Tap]:
    t = Tap(closed.ports[0])
    try:
        yield t
    finally:
        t.close()


@pytest.mark.slow
def test_what_crosses_the_wire_is_ciphertext_both_ways(closed: BrokerHandle, tap: Tap, bus: Bus, keys: Path) -> None:
    hello = P.Hello(role="actor", peer_id="actor-0", host=MARKER, num_envs=1)
    assert MARKER.encode() in b"".join(P.encode(hello)), "the marker is plain in the message as encoded"
    actor = bus.link(tap.endpoint, hello, credentials=who(keys, "actor", "a"))
    assert actor.wait_welcome(WAIT_S) is not None
    body = request_status(tap.endpoint, WAIT_S, bus.ctx, credentials=who(keys, "monitor", "m"))
    assert body is not None and "actor-0" in body["members"] and MARKER in repr(body), "the reply carries it back"
    assert len(tap.up) > 1000 and len(tap.down) > 1000, "the tap saw the traffic"
    for readable in (MARKER.encode(), b"actor-0", b"members"):
        assert readable not in tap.up and readable not in tap.down, f"{readable!r} crossed the wire readable"


@pytest.mark.slow
def test_a_message_changed_on_the_wire_is_never_read(closed: BrokerHandle, tap: Tap, bus: Bus, keys: Path) -> None:
    sock = handshaken(bus, who(keys, "actor", "a"), tap.endpoint)
    tap.tamper.set()  # from here on every chunk the client sends has one bit flipped
    assert ask(sock, P.Hello(role="actor", peer_id="actor-3", num_envs=1)) is None, "a changed hello was answered"
    assert tap.corrupted >= 1
    body = counters(closed, bus, keys)
    assert "actor-3" not in body["members"] and body["broker"]["control_malformed"] == 0, "it reached the broker"


@pytest.mark.slow
def test_a_revoked_keys_open_connections_are_refused_and_counted(closed: BrokerHandle, bus: Bus, keys: Path) -> None:
    learner = who(keys, "learner", "l")
    assert learner.signer is not None
    shard = bus.link(
        closed.connect,
        signed_hello(learner_hello("learner-0", "run-a", run_spec()), learner.signer),
        credentials=learner,
    )
    assert shard.wait_welcome(WAIT_S) is not None
    data = shard.socket(zmq.DEALER)
    data.setsockopt(zmq.IDENTITY, shard.data_identity)
    data.connect(shard.endpoint("learners"))
    data.send_multipart(P.encode(P.Credit(peer_id="learner-0", credit=8)))
    wait_for(lambda: counters(closed, bus, keys)["broker"]["credit"] == 8, WAIT_S, "the shard's credit")
    data.send_multipart(P.encode(signed_params(parameters("run-a", 0), learner.signer)))
    doomed = who(keys, "actor", "b")
    victim = bus.link(closed.connect, P.Hello(role="actor", peer_id="actor-1", num_envs=1), credentials=doomed)
    assert victim.wait_welcome(WAIT_S) is not None
    push = dealer(bus, doomed, f"tcp://127.0.0.1:{closed.bound_ports['trajectories']}", zmq.PUSH)
    push.send_multipart(P.encode(trajectory("run-a", "actor-1", 0)))
    assert data.poll(int(WAIT_S * 1000)), "the key's trajectory did not arrive before the revocation"
    assert isinstance(P.decode(data.recv_multipart()), P.Trajectory)
    control = handshaken(bus, doomed, closed.connect)  # an open control connection of the key, no member

    (keys / "actors" / "b.key").unlink()
    wait_for(lambda: victim.refused is not None, WAIT_S, "the revoked key's member to be told")
    assert "revoked" in (victim.refused or "")
    before = counters(closed, bus, keys)["broker"]
    push.send_multipart(P.encode(trajectory("run-a", "actor-1", 1)))
    again = ask(control, P.Hello(role="actor", peer_id="actor-1", num_envs=1))
    assert isinstance(again, P.Reject) and "revoked" in again.reason, again
    wait_for(
        lambda: counters(closed, bus, keys)["broker"]["received"] == before["received"] + 1,
        WAIT_S,
        "the revoked key's trajectory to be counted",
    )
    c = counters(closed, bus, keys)["broker"]
    assert c["dropped"].get("forged_sender", 0) == before["dropped"].get("forged_sender", 0) + 1, c["dropped"]
    assert c["auth_refused"] > before["auth_refused"] and c["accounted"]
    late = [P.decode(data.recv_multipart()) for _ in range(5) if data.poll(300)]
    assert not any(isinstance(m, P.Trajectory) for m in late), "a revoked key's trajectory reached the learner"


ADMITTED = {
    "learner": {"control", "learners"},
    "actor": {"control", "trajectories", "params"},
    "monitor": {"control"},
    "relay": {"control", "trajectories", "params"},
    "replay": {"control", "learners"},
}
"""The sockets docs/security.md says each key role is admitted on."""


@pytest.mark.parametrize("role", sorted(ADMITTED))
def test_each_key_role_is_admitted_on_the_sockets_the_doc_names_only(role: str) -> None:
    public, _ = zmq.curve_keypair()
    allow = _AllowList({public: (role, "k")})
    admitted = {d for d in DOMAINS if allow.judge(d.encode(), z85.decode(public)) == (f"{role}:k", None)}
    assert admitted == ADMITTED[role]


def test_the_broker_sockets_carry_the_documented_bounds() -> None:
    ctx = zmq.Context()
    s = open_sockets(ctx, BrokerConfig(bind="tcp://127.0.0.1:*"))
    try:
        framing, mib = 4096, 1 << 20
        assert s.control.getsockopt(zmq.MAXMSGSIZE) == mib + framing
        assert s.trajectories.getsockopt(zmq.MAXMSGSIZE) == 256 * mib + framing
        assert s.learners.getsockopt(zmq.MAXMSGSIZE) == 256 * mib + framing
        assert s.params.getsockopt(zmq.MAXMSGSIZE) == 256 + framing
        assert s.control.getsockopt(zmq.SNDHWM) == 1000
        assert s.learners.getsockopt(zmq.RCVHWM) == 10_000
    finally:
        for sock in (s.control, s.trajectories, s.learners, s.params):
            sock.close(linger=0)
        ctx.term()


def test_what_the_root_keeps_of_relays_reports_is_bounded() -> None:
    with in_process_broker() as b:
        for i in range(40):
            identity, peer_id = f"session-{i}".encode(), f"relay-{i}"
            b.handle_control(identity, P.encode(P.Hello(role="relay", peer_id=peer_id, host=f"rack{i}", pid=i + 1)))
            counters = {f"c{n}": n for n in range(100)} | {"k" * 65: 1}
            msg = P.Subtree(peer_id=peer_id, seq=1, full=True, actors={}, counters=counters)
            b.handle_control(identity, P.encode(msg))
        assert len(b.subtrees.relays) == 40
        for view in b.subtrees.relays.values():
            assert len(view.counters) == 64 and max(len(k) for k in view.counters) <= 64
        assert len(b.subtrees.status()) == 32
        too_big = P.Subtree(
            peer_id="relay-0", seq=2, full=True, actors={}, counters={"x": 1}, left=["a" * P.MAX_HEADER_BYTES]
        )
        with pytest.raises(P.ProtocolError):
            P.decode(P.encode(too_big))


def test_the_status_limits_are_the_documented_ones() -> None:
    """docs/security.md "Bounded resources" and docs/protocol.md (status_request) give these numbers: the limits the
    broker builds must be them (the rate tests drive the buckets with values of their own)."""
    from zddrl.broker import limits as L

    status = L.Limits().status
    assert (L.STATUS_BURST, L.STATUS_RATE_PER_S) == (10, 2.0)
    assert (L.STATUS_TOTAL_BURST, L.STATUS_TOTAL_RATE_PER_S) == (200, 100.0)
    assert (L.STATUS_TOTAL_BURST_BYTES, L.STATUS_TOTAL_BYTES_PER_S) == (16 << 20, 8 << 20)
    assert status.rate_per_s == L.STATUS_RATE_PER_S and status.burst == L.STATUS_BURST
    doc = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    assert "per connection 10 at once, then 2 per second; all connections together 100 per second" in doc
    assert "8 MiB of replies per second (16 MiB at once)" in doc
