"""The closed bus against a real `zddrl broker --keys`: a stranger (no key, a key not on the list, a key of the
wrong role) gets nothing in and nothing out, and the broker's counters say so; a member's role and peer id come
from its key. Issue 13's attacks, each on real sockets."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import zmq

from broker_clients import WAIT_S, cli, learner_hello, parameters, run_spec, trajectory
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl import protocol as P
from zddrl.keys import Credentials, credentials, new_key
from zddrl.transport.signatures import signed_hello, signed_params
from zddrl.transport.status import request_status

SILENCE_MS = 1500
"""How long a refused client listens for an answer that must not come."""


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    for role, name in [("broker", "b"), ("learner", "l"), ("learner", "l2"), ("actor", "a"), ("actor", "b")]:
        new_key(root, role, name)
    new_key(root, "monitor", "m")
    return root


def outsider(root: Path, keys: Path, name: str) -> Credentials:
    """An actor key made in a directory of its own, next to the broker's real public key (the broker has not
    listed it)."""
    new_key(root, "actor", name)
    (root / "broker").mkdir()
    shutil.copy(keys / "broker" / "b.key", root / "broker")
    shutil.copytree(keys / "learners", root / "learners", ignore=shutil.ignore_patterns("*.key_secret", "*.sign"))
    return credentials(root, "actor")


@pytest.fixture
def stranger(tmp_path: Path, keys: Path) -> Credentials:
    return outsider(tmp_path / "stranger", keys, "x")


@pytest.fixture
def closed(procs: Procs, tmp_path: Path, keys: Path) -> BrokerHandle:
    return BrokerHandle(procs, tmp_path).start("--keys", str(keys))


def who(keys: Path, role: str, name: str) -> Credentials:
    return credentials(keys, role, name)


def counters(broker: BrokerHandle, bus: Bus, keys: Path) -> dict:
    body = request_status(broker.connect, WAIT_S, bus.ctx, credentials=who(keys, "monitor", "m"))
    assert body is not None, "no status for the monitor key"
    return body["broker"]


def dealer(bus: Bus, creds: Credentials | None, endpoint: str, kind: int = zmq.DEALER) -> zmq.Socket:
    sock = bus.socket(kind)
    if creds is not None:
        creds.apply(sock)
    sock.connect(endpoint)
    return sock


def ask(sock: zmq.Socket, msg: P.Message) -> P.Message | None:
    sock.send_multipart(P.encode(msg), zmq.NOBLOCK)
    return P.decode(sock.recv_multipart()) if sock.poll(SILENCE_MS) else None


def link(bus: Bus, broker: BrokerHandle, creds: Credentials, hello: P.Hello):
    return bus.link(broker.connect, hello, credentials=creds)


@pytest.mark.slow
def test_a_client_without_a_listed_key_is_never_answered(
    closed: BrokerHandle, bus: Bus, keys: Path, stranger: Credentials
) -> None:
    status = P.StatusRequest(peer_id="status")
    no_key = dealer(bus, None, closed.connect)
    assert no_key.send_multipart(P.encode(status)) is None and not no_key.poll(SILENCE_MS), "answered without a key"
    unlisted = dealer(bus, stranger, closed.connect)
    assert ask(unlisted, P.Hello(role="actor", peer_id="actor-9", num_envs=1)) is None
    # Nor do its trajectories count as received: the PUSH never completes its handshake either.
    push = dealer(bus, stranger, f"tcp://127.0.0.1:{closed.bound_ports['trajectories']}", zmq.PUSH)
    push.send_multipart(P.encode(trajectory("run", "actor-9", 0)), zmq.NOBLOCK)
    c = wait_for(
        lambda: (lambda c: c if c["handshakes_failed"] >= 1 and c["zap_denied"] >= 2 else None)(
            counters(closed, bus, keys)
        ),
        WAIT_S,
        "the refused handshakes to be counted",
    )
    assert c["received"] == 0 and c["control_malformed"] == 0
    assert request_status(closed.connect, WAIT_S, bus.ctx, credentials=who(keys, "monitor", "m"))["members"] == {}


@pytest.mark.slow
def test_the_params_port_admits_actor_keys_only(closed: BrokerHandle, bus: Bus, keys: Path) -> None:
    params = f"tcp://127.0.0.1:{closed.bound_ports['params']}"
    before = counters(closed, bus, keys)
    subs = [
        dealer(bus, creds, params, zmq.SUB) for creds in (None, who(keys, "monitor", "m"), who(keys, "learner", "l"))
    ]
    wait_for(
        lambda: (lambda c: c["handshakes_failed"] >= before["handshakes_failed"] + 1 and c["zap_denied"] >= 2)(
            counters(closed, bus, keys)
        ),
        WAIT_S,
        f"{len(subs)} refused subscribers",
    )
    actor = dealer(bus, who(keys, "actor", "a"), params, zmq.SUB)
    actor.setsockopt(zmq.SUBSCRIBE, b"")
    wait_for(lambda: counters(closed, bus, keys)["handshakes_ok"] > before["handshakes_ok"] + 1, WAIT_S, "the actor's")


@pytest.mark.slow
def test_a_key_joins_only_as_its_own_role(closed: BrokerHandle, bus: Bus, keys: Path) -> None:
    for creds, role in [(who(keys, "actor", "a"), "learner"), (who(keys, "monitor", "m"), "actor")]:
        sock = dealer(bus, creds, closed.connect)
        reply = ask(sock, P.Hello(role=role, peer_id=f"{role}-0", num_envs=1))
        assert isinstance(reply, P.Reject) and reply.reason.startswith(P.REFUSED_PREFIX), reply
        assert f"may not join as {role}" in reply.reason
    sock = dealer(bus, who(keys, "actor", "a"), closed.connect)
    assert isinstance(ask(sock, P.Hello(role="actor", peer_id="actor-0", num_envs=1)), P.Welcome)
    # Monitor events reach the broker's loop on their own socket: the three handshakes may be counted a poll late.
    c = wait_for(
        lambda: (lambda c: c if c["handshakes_ok"] >= 3 else None)(counters(closed, bus, keys)), WAIT_S, "handshakes"
    )
    assert c["auth_refused"] == 2


@pytest.mark.slow
def test_a_live_peer_id_is_taken_over_by_the_same_key_only(closed: BrokerHandle, bus: Bus, keys: Path) -> None:
    owner = link(bus, closed, who(keys, "actor", "a"), P.Hello(role="actor", peer_id="actor-0", num_envs=1))
    assert owner.wait_welcome(WAIT_S) is not None
    thief = dealer(bus, who(keys, "actor", "b"), closed.connect)
    reply = ask(thief, P.Hello(role="actor", peer_id="actor-0", num_envs=1))
    assert isinstance(reply, P.Reject) and "held by a member that joined with another key" in reply.reason
    # The same key may (a restarted actor host): the broker only judges the process, as on an open bus.
    again = dealer(bus, who(keys, "actor", "a"), closed.connect)
    assert isinstance(ask(again, P.Hello(role="actor", peer_id="actor-0", num_envs=1)), P.Welcome)
    assert counters(closed, bus, keys)["auth_refused"] == 1


@pytest.mark.slow
def test_a_trajectory_naming_another_keys_actor_is_dropped_as_forged(
    closed: BrokerHandle, bus: Bus, keys: Path
) -> None:
    victim = link(bus, closed, who(keys, "actor", "a"), P.Hello(role="actor", peer_id="actor-0", num_envs=1))
    forger = link(bus, closed, who(keys, "actor", "b"), P.Hello(role="actor", peer_id="actor-1", num_envs=1))
    assert victim.wait_welcome(WAIT_S) and forger.wait_welcome(WAIT_S)
    shard = link(bus, closed, who(keys, "learner", "l"), P.Hello(role="learner", peer_id="learner-0"))
    assert shard.wait_welcome(WAIT_S) is not None
    data = shard.socket(zmq.DEALER)
    data.setsockopt(zmq.IDENTITY, shard.data_identity)
    data.connect(shard.endpoint("learners"))
    data.send_multipart(P.encode(P.Credit(peer_id="learner-0", credit=8)))
    wait_for(lambda: counters(closed, bus, keys)["credit"] == 8, WAIT_S, "the shard's credit")
    push = forger.socket(zmq.PUSH)
    push.connect(forger.endpoint("trajectories"))
    push.send_multipart(P.encode(trajectory("", "actor-0", 0)))
    c = wait_for(
        lambda: (lambda c: c if c["received"] == 1 else None)(counters(closed, bus, keys)), WAIT_S, "the forgery"
    )
    assert c["dropped"]["forged_sender"] == 1 and c["forwarded"] == 0 and c["accounted"]
    assert not data.poll(200), "a forged trajectory reached the learner"
    data.close(linger=0)
    push.close(linger=0)


@pytest.mark.slow
def test_a_learners_data_stream_cannot_be_taken_by_another_key(closed: BrokerHandle, bus: Bus, keys: Path) -> None:
    """Attack: a DEALER on the learners port that takes the real learner's identity (its peer id is public, and
    ROUTER_HANDOVER hands an identity to whoever asks). On a closed bus the data identity is a secret of the
    learner's welcome: the thief gets nothing, and what it says is not obeyed."""
    learner = who(keys, "learner", "l")
    assert learner.signer is not None
    hello = signed_hello(learner_hello("learner-0", "run-a", run_spec()), learner.signer)
    shard = link(bus, closed, learner, hello)
    assert shard.wait_welcome(WAIT_S) is not None
    assert len(shard.data_identity) == P.DATA_IDENTITY_BYTES and shard.data_identity != b"learner-0"
    data = shard.socket(zmq.DEALER)
    data.setsockopt(zmq.IDENTITY, shard.data_identity)
    data.connect(shard.endpoint("learners"))
    thief = bus.socket(zmq.DEALER, identity=b"learner-0")
    who(keys, "learner", "l2").apply(thief)
    thief.connect(shard.endpoint("learners"))
    thief.send_multipart(P.encode(P.Credit(peer_id="learner-0", credit=5)))
    data.send_multipart(P.encode(signed_params(parameters("run-a", 0), learner.signer)))
    data.send_multipart(P.encode(P.Credit(peer_id="learner-0", credit=3)))
    wait_for(lambda: counters(closed, bus, keys)["credit"] == 3, WAIT_S, "the real shard's credit, and only it")
    actor = link(bus, closed, who(keys, "actor", "a"), P.Hello(role="actor", peer_id="actor-0", num_envs=1))
    assert actor.wait_welcome(WAIT_S) is not None
    push = actor.socket(zmq.PUSH)
    push.connect(actor.endpoint("trajectories"))
    for seq in range(3):
        push.send_multipart(P.encode(trajectory("run-a", "actor-0", seq)))
    got = [P.decode(data.recv_multipart()) for _ in range(3) if data.poll(int(WAIT_S * 1000))]
    assert [m.seq for m in got] == [0, 1, 2]
    thief_got = [P.decode(thief.recv_multipart()) for _ in range(5) if thief.poll(200)]
    assert not any(isinstance(m, P.Trajectory) for m in thief_got), "a trajectory reached another key"
    assert counters(closed, bus, keys)["forwarded"] == 3


@pytest.mark.slow
def test_a_reachable_bind_without_keys_refuses_to_start(procs: Procs, tmp_path: Path) -> None:
    refused = cli("broker", "--bind", "tcp://0.0.0.0:*")
    assert refused.returncode != 0
    err = refused.stderr.strip().splitlines()[-1]
    assert "without keys" in err and "--insecure" in err and "--keys" in err, refused.stderr
    ready = tmp_path / "ready.json"
    proc = procs.start("broker", "broker", "--bind", "tcp://0.0.0.0:*", "--insecure", "--ready-file", str(ready))
    wait_for(lambda: ready.exists() or proc.poll() is not None, 20, "the insecure broker to bind")
    assert proc.poll() is None
    assert "INSECURE" in procs.log("broker")


@pytest.mark.slow
def test_a_client_with_a_refused_key_says_so(closed: BrokerHandle, bus: Bus, stranger: Credentials) -> None:
    refused = link(bus, closed, stranger, P.Hello(role="actor", peer_id="actor-9", num_envs=1))
    wait_for(lambda: refused.handshakes.failures >= 1, WAIT_S, "the client to see its handshake refused")
    assert refused.welcome is None


@pytest.mark.slow
def test_keys_added_and_removed_take_effect_without_a_restart(closed: BrokerHandle, bus: Bus, keys: Path) -> None:
    late = outsider(keys.parent / "late", keys, "c")  # made elsewhere, then its public file copied in
    shutil.copy(keys.parent / "late" / "actors" / "c.key", keys / "actors" / "c.key")
    newcomer = link(bus, closed, late, P.Hello(role="actor", peer_id="actor-5", num_envs=1))
    assert newcomer.wait_welcome(WAIT_S) is not None, "a key added to the directory was not admitted"
    victim = link(bus, closed, who(keys, "actor", "b"), P.Hello(role="actor", peer_id="actor-1", num_envs=1))
    assert victim.wait_welcome(WAIT_S) is not None
    (keys / "actors" / "b.key").unlink()  # revoked: its member goes, its open connection is refused from now on
    wait_for(lambda: victim.refused is not None, WAIT_S, "the revoked actor to be refused")
    body = request_status(closed.connect, WAIT_S, bus.ctx, credentials=who(keys, "monitor", "m"))
    assert set(body["members"]) == {"actor-5"} and "revoked" in victim.refused


@pytest.mark.slow
def test_a_strangers_endless_message_is_cut_off_at_the_handshake(closed: BrokerHandle, bus: Bus, keys: Path) -> None:
    """Attack: one connection streaming frames marked "more" that never end grew an open broker by 832 MB in 3 s.
    On a closed bus the stranger never gets past the greeting: libzmq closes the connection at the mechanism."""
    before = rss_mib(closed.proc.pid)
    sent = 0
    with socket.create_connection(("127.0.0.1", int(closed.connect.rsplit(":", 1)[1])), timeout=WAIT_S) as raw:
        # ZMTP 3.0 greeting with the NULL mechanism, then a READY command, then frames with the MORE flag forever.
        raw.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
        raw.sendall(b"\x04\x1c\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER")
        frame = b"\x03" + (1 << 20).to_bytes(8, "big") + b"x" * (1 << 20)  # a 1 MiB long frame, more follows
        try:
            while sent < 200:
                raw.sendall(frame)
                sent += 1
        except OSError:  # the broker closed the connection
            pass
    assert sent < 200, "the broker kept reading a stranger's endless message"
    c = wait_for(
        lambda: (lambda c: c if c["handshakes_failed"] >= 1 else None)(counters(closed, bus, keys)), WAIT_S, "a count"
    )
    assert c["control_malformed"] == 0 and rss_mib(closed.proc.pid) - before < 32


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")
