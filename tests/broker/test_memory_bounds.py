"""Memory bounded per message and in total on every broker socket, for every role (docs/security.md, "Bounded
resources"), against real CURVE sockets and a real `zddrl broker --keys`: a frame over its socket's cap is never
buffered; a message of more frames than its socket allows is dropped and counted as soon as it is read; a
message that never ends grows the broker only to its memory budget, where the sockets are reset and an honest
run trains on; status replies nobody reads are bounded in total, the excess dropped and counted."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from broker_clients import WAIT_S, ProfiledBroker, learner_hello, run_spec
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl import protocol as P
from zddrl.broker import limits, sockets
from zddrl.broker.broker import Broker
from zddrl.broker.limits import UNREAD_BYTES_PER_KEY, UnreadReplies
from zddrl.broker.membership import Member
from zddrl.broker.memory import (
    REBIND_RETRY_S,
    RESET,
    RESET_SETTLE_S,
    RESET_SPACING_S,
    RESET_STORM,
    STORM,
    STUCK,
    MemoryBudget,
)
from zddrl.broker.sockets import MAX_FRAMES, BindError, drained
from zddrl.config import BrokerConfig
from zddrl.keys import Credentials, credentials, new_key
from zddrl.transport.signatures import signed_hello, signed_params
from zddrl.transport.status import request_status

pytestmark = pytest.mark.serial  # its figures need the machine to itself (tests/phases.py)

CARTPOLE = str(Path(__file__).resolve().parents[2] / "examples" / "cartpole_ppo.toml")
MIB = 1 << 20


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    for role, name in [("broker", "b"), ("learner", "l"), ("actor", "a"), ("monitor", "m"), ("monitor", "m2")]:
        new_key(root, role, name)
    return root


def who(keys: Path, role: str, name: str) -> Credentials:
    return credentials(keys, role, name)


def body(broker: BrokerHandle, bus: Bus, keys: Path, name: str = "m2") -> dict:
    got = request_status(broker.connect, WAIT_S, bus.ctx, credentials=who(keys, "monitor", name))
    assert got is not None, "no status for a monitor key"
    return got["broker"]


def body_if(broker: BrokerHandle, bus: Bus, keys: Path, name: str = "m2", timeout_s: float = WAIT_S) -> dict:
    """``body``, or {} for a request that got no answer (a reset of the broker's sockets cut its connection off, or
    its key's connections held too many replies unread)."""
    assert broker.proc is not None and broker.proc.poll() is None, broker.procs.log("broker")[-3000:]
    got = request_status(broker.connect, timeout_s, bus.ctx, credentials=who(keys, "monitor", name))
    return got["broker"] if got is not None else {}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Peak:
    """The highest RSS of ``pid`` while in use, sampled every 10 ms on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.mib = pid, rss_mib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.mib = max(self.mib, rss_mib(self.pid))
            except (FileNotFoundError, ProcessLookupError):
                return

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def client(bus: Bus, creds: Credentials, endpoint: str, kind: int = zmq.DEALER, **opts: int) -> zmq.Socket:
    sock = bus.socket(kind, sndhwm=0, **opts)
    creds.apply(sock)
    sock.connect(endpoint)
    return sock


def disconnected(bus: Bus, sock: zmq.Socket) -> zmq.Socket:
    """A monitor of ``sock`` that reports its connection dropped (by the broker)."""
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    bus.sockets.append(monitor)
    return monitor


def heartbeat_frames(peer_id: str) -> list[bytes]:
    return P.encode(P.Heartbeat(peer_id=peer_id))


# ---------------------------------------------------------------------------------------------------- the parts


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected loopback TCP pair (sender, receiver); the receiver's buffer small, so the sender's fills."""
    server = socket.create_server(("127.0.0.1", 0))
    receiver = socket.socket()
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    receiver.connect(server.getsockname())
    sender, _ = server.accept()
    server.close()
    sender.setblocking(False)
    try:
        yield sender, receiver
    finally:
        sender.close()
        receiver.close()


def fill(sock: socket.socket) -> int:
    """Write until the kernel takes no more (a peer that reads nothing); returns the bytes written."""
    sent = 0
    try:
        while True:
            sent += sock.send(b"x" * 65536)
    except BlockingIOError:
        return sent


@pytest.mark.skipif(sys.platform != "linux", reason="the kernel's send queue is read with Linux's TIOCOUTQ")
def test_unread_replies_are_bounded_in_all_and_per_key_and_forgotten_once_read(
    tcp_pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    sender, receiver = tcp_pair
    fd = sender.fileno()
    assert drained(fd), "nothing sent yet"
    sent = fill(sender)
    assert not drained(fd), "a peer that reads nothing leaves the send queue full"
    monkeypatch.setattr(limits, "UNREAD_BYTES", 3 * MIB)
    unread = UnreadReplies(drained)
    reply = 256 << 10
    admitted = 0
    while unread.admit(fd, b"conn-a", "monitor:m", reply, 0.0):
        admitted += 1
    assert admitted == 3 * MIB // (reply + limits.REPLY_OVERHEAD_BYTES) and unread.total <= 3 * MIB
    # Another connection, another key: the same total bound holds for all of them together.
    assert not unread.admit(fd, b"conn-b", "monitor:m2", 2 * MIB, 0.0)
    assert unread.admit(-1, b"in-process", "monitor:m", reply, 0.0), "a reply not from a socket is not watched"
    got = 0
    receiver.settimeout(5.0)
    while got < sent:
        got += len(receiver.recv(1 << 20))
    wait_for(lambda: drained(fd), WAIT_S, "the send queue to empty")
    assert unread.admit(fd, b"conn-a", "monitor:m", reply, 1.0), "a connection that read its replies holds none"
    assert unread.total == reply + limits.REPLY_OVERHEAD_BYTES and len(unread) == 1


def test_unread_replies_are_bounded_per_key() -> None:
    unread = UnreadReplies(lambda fd: False)  # nobody reads
    reply = 1 * MIB
    n = 0
    while unread.admit(100 + n, b"id", "monitor:m", reply, 0.0):
        n += 1
    assert n == UNREAD_BYTES_PER_KEY // (reply + limits.REPLY_OVERHEAD_BYTES)
    assert unread.admit(999, b"id", "monitor:m2", reply, 0.0), "another key has room of its own"
    unread.clear()
    assert unread.total == 0 and len(unread) == 0


def test_the_budget_resets_once_then_waits_until_the_resident_set_is_back_under() -> None:
    readings = iter([10, 150, 150, 150, 150, 90, 160])
    budget = MemoryBudget(limit=100, rss=lambda: next(readings))  # 10: the first reading, at construction
    assert budget.check(0.0) == RESET
    assert budget.check(0.1) == "", "libzmq frees a closed socket's buffers a little later"
    assert budget.check(RESET_SETTLE_S + 0.1) == STUCK, "still over once settled: not the sockets' memory"
    assert budget.check(RESET_SETTLE_S + 0.2) == "", "said once"
    assert budget.check(RESET_SETTLE_S + 0.3) == "" and budget.reset_at is None, "back under: armed again"
    assert budget.check(RESET_SETTLE_S + 0.4) == RESET
    assert budget.peak == 160


def test_resets_that_keep_coming_back_are_spaced_out() -> None:
    """The fleet's honest load over the budget: each reset frees, the fleet refills. Past RESET_STORM resets the
    budget says so once and waits longer and longer between two."""
    rss = [150]
    budget = MemoryBudget(limit=100, rss=lambda: rss[0])
    t = 0.0
    for _ in range(RESET_STORM):
        rss[0] = 150
        assert budget.check(t) == RESET
        rss[0] = 90  # the reset freed it
        assert budget.check(t + 1) == ""
        t += 2
    rss[0] = 150
    assert budget.check(t) == STORM
    last = t - 2
    assert budget.check(t + 1) == "" and budget.check(last + RESET_SPACING_S - 1) == "", "spaced out"
    assert budget.check(last + RESET_SPACING_S) == RESET
    last += RESET_SPACING_S
    rss[0] = 90
    budget.check(last + 1)
    rss[0] = 150
    assert budget.check(last + 2 * RESET_SPACING_S - 1) == "", "the next wait is twice the last"
    assert budget.check(last + 2 * RESET_SPACING_S) == RESET


@pytest.fixture
def bound() -> Iterator[Broker]:
    b = Broker(BrokerConfig(bind="tcp://127.0.0.1:*"))
    b.bind()
    yield b
    b.close()


def test_a_reset_forgets_the_members_descriptors_and_gives_no_live_id_away(bound: Broker) -> None:
    member = Member(peer_id="actor-0", role="actor", identity=b"a", host="h1", pid=1)
    member.user, member.conn_fd = "actor:a", 9
    bound.membership.admit(member)
    bound.resets.reset(0.0)
    assert member.conn_fd == -1, "a reused descriptor is never read as this member's"
    assert member.conn_closed and bound.counters["memory_resets"] == 1
    fresh = P.Hello(role="actor", peer_id="", auto_id=True, host="h2", pid=2)
    assert bound.joining.actor_ids.assign(fresh, "actor:a") == "actor-1", "actor-0's process still runs"


def test_a_port_that_does_not_bind_again_is_retried_with_a_back_off(
    bound: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = dict(bound.ports)
    real = sockets.open_sockets
    failures = [2]

    def flaky(*args, **kwargs):
        if failures[0]:
            failures[0] -= 1
            raise BindError("port taken")
        return real(*args, **kwargs)

    monkeypatch.setattr(sockets, "open_sockets", flaky)
    bound.resets.reset(0.0)  # does not raise: the broker's loop runs on
    budget = bound.memory
    assert bound.counters["memory_rebind_failed"] == 1 and budget.rebind_at == REBIND_RETRY_S
    bound.replies.send(b"gone", P.Reject(reason="x"))  # a stand-in socket takes what the broker sends meanwhile
    bound.resets.check(REBIND_RETRY_S - 0.01)
    assert bound.counters["memory_rebind_failed"] == 1, "not before its time"
    bound.resets.check(REBIND_RETRY_S)
    assert bound.counters["memory_rebind_failed"] == 2 and budget.rebind_at == 3 * REBIND_RETRY_S, "twice the wait"
    bound.resets.check(3 * REBIND_RETRY_S)
    assert budget.rebind_at is None and bound.counters["memory_rebind_failed"] == 2
    endpoint = bound.sockets.control.getsockopt_string(zmq.LAST_ENDPOINT)
    assert endpoint.endswith(f":{ports['control']}"), "bound again on its port"


# ---------------------------------------------------------------------------------------------------- real brokers


def test_a_frame_over_its_sockets_cap_is_never_buffered(procs: Procs, tmp_path: Path, bus: Bus, keys: Path) -> None:
    """Control frames are headers (at most 1 MiB), trajectory frames at most max_message_bytes (1 MiB here): a 64 MiB
    frame on either closes its connection unread. The params socket reads subscriptions, of a few bytes: one of
    64 KiB closes its connection as well (the attacker's own libzmq, not the broker, fails with a bigger one)."""
    broker = ProfiledBroker(procs, tmp_path, max_message_bytes=MIB).start("--keys", str(keys))
    pid = broker.proc.pid
    _, traj_port, _, params_port = broker.ports
    big = memoryview(bytearray(64 * MIB))
    message = [*heartbeat_frames("x"), big]
    attacks = [
        (who(keys, "monitor", "m"), broker.connect, zmq.DEALER, message),
        (who(keys, "actor", "a"), f"tcp://127.0.0.1:{traj_port}", zmq.PUSH, message),
        (who(keys, "actor", "a"), f"tcp://127.0.0.1:{params_port}", zmq.XSUB, [b"\x01" + bytes(64 << 10)]),
    ]
    before = rss_mib(pid)
    with Peak(pid) as peak:
        for creds, endpoint, kind, frames in attacks:
            sock = client(bus, creds, endpoint, kind)
            monitor = disconnected(bus, sock)
            sock.send_multipart(frames, copy=False)
            assert monitor.poll(int(WAIT_S * 1000)), (
                f"the broker kept the connection of a frame over its cap ({endpoint})"
            )
    assert peak.mib - before < 32, f"the broker grew by {peak.mib - before:.0f} MiB for frames over their caps"
    c = body(broker, bus, keys)
    assert c["control_malformed"] == 0 and c["received"] == 0, "nothing of them reached the broker's code"


def test_a_message_of_more_frames_than_its_socket_allows_is_dropped_and_counted(
    procs: Procs, tmp_path: Path, bus: Bus, keys: Path
) -> None:
    broker = BrokerHandle(procs, tmp_path).start("--keys", str(keys))
    _, _, learner_port, _ = broker.ports
    control = client(bus, who(keys, "monitor", "m"), broker.connect)
    control.send_multipart([*heartbeat_frames("monitor-0"), *[b"x"] * MAX_FRAMES["control"]])
    learners = client(bus, who(keys, "learner", "l"), f"tcp://127.0.0.1:{learner_port}")
    learners.send_multipart([*heartbeat_frames("learner-0"), *[b"x"] * MAX_FRAMES["learners"]])
    c = wait_for(
        lambda: (
            (b := body(broker, bus, keys))["control_too_many_frames"] == 1 and b["learner_too_many_frames"] == 1 and b
        ),
        WAIT_S,
        "both messages counted",
    )
    assert c["control_malformed"] == 1 and c["learner_malformed"] == 1, "malformed, of which they are a part"
    # As many frames as the socket allows: a message like any other, served.
    control.send_multipart(P.encode(P.StatusRequest(peer_id="status")))
    assert control.poll(int(WAIT_S * 1000)) and isinstance(P.decode(control.recv_multipart()), P.Status)


def test_status_replies_nobody_reads_are_bounded_in_total(procs: Procs, tmp_path: Path, bus: Bus, keys: Path) -> None:
    """Attack: 40 connections asking for status and reading nothing queued 457 MB in a minute. Now what they hold
    unread is at most UNREAD_BYTES_PER_KEY with one key; the rest is dropped unsent and counted, and a monitor of
    another key still gets its status."""
    broker = BrokerHandle(procs, tmp_path).start("--keys", str(keys))
    pid = broker.proc.pid
    stats = {f"figure/{i:06d}": "v" * 256 for i in range((60 << 10) // 272)}
    for i in range(8):  # monitors with big stats: a status body of ~130 KB
        link = bus.link(broker.connect, P.Hello(role="monitor", peer_id=f"monitor-{i}"),
                        credentials=who(keys, "monitor", "m"))  # fmt: skip
        assert link.wait_welcome(WAIT_S) is not None
        link.send(P.Stats(peer_id=f"monitor-{i}", role="monitor", stats=stats))
    wait_for(lambda: body(broker, bus, keys)["members_total"] == 8, WAIT_S, "eight monitors")
    socks = [client(bus, who(keys, "monitor", "m"), broker.connect, rcvhwm=1, rcvbuf=4096) for _ in range(40)]
    request = P.encode(P.StatusRequest(peer_id="hoard"))
    before = rss_mib(pid)
    end = time.monotonic() + 6.0  # 40 x 5 replies/s of ~130 KB: ~150 MB asked for, ~4x the bound below
    with Peak(pid) as peak:
        while time.monotonic() < end:
            for sock in socks:
                sock.send_multipart(request, zmq.NOBLOCK)
            time.sleep(0.2)
        honest = body(broker, bus, keys, "m2")  # another key's monitor, during the hoard
    grown = peak.mib - before
    assert grown < UNREAD_BYTES_PER_KEY / MIB + 24, f"the broker grew by {grown:.0f} MiB"
    assert honest["replies_unread"] > 0, "the excess is dropped and counted"
    assert 0 < honest["memory"]["unread_bytes"] <= limits.UNREAD_BYTES
    for sock in socks:
        sock.close(linger=0)
    # Closed connections hold nothing: their replies are forgotten at the broker's next tick.
    released = wait_for(lambda: body_if(broker, bus, keys, "m", 1.0), WAIT_S, "an answer to the hoarding key")
    assert released["memory"]["unread_bytes"] < MIB


def test_snapshots_to_a_member_that_reads_nothing_stop_at_what_it_holds(
    procs: Procs, tmp_path: Path, bus: Bus, keys: Path
) -> None:
    """Attack: an actor key's member that reads nothing and says at every heartbeat that it is behind was sent the
    whole version at every heartbeat interval. Now a member whose connection has not taken its last snapshot gets
    no other (``snapshots_unread``)."""
    broker = ProfiledBroker(procs, tmp_path, heartbeat_interval_s=0.1, heartbeat_liveness=100)
    broker.start("--keys", str(keys))
    learner = who(keys, "learner", "l")
    assert learner.signer is not None
    shard = bus.link(broker.connect, signed_hello(learner_hello("learner-0", "run-a", run_spec()), learner.signer),
                     credentials=learner)  # fmt: skip
    assert shard.wait_welcome(WAIT_S) is not None
    data = shard.socket(zmq.DEALER)
    data.setsockopt(zmq.IDENTITY, shard.data_identity)
    data.connect(shard.endpoint("learners"))
    flat = np.zeros(1 << 16, np.float32)  # 256 KiB: more than a send queue holds for a peer that reads nothing
    head = P.Parameters(run_id="run-a", peer_id="learner-0", policy_version=0, param_hash=P.param_hash(flat),
                        layout=[["w", "float32", [1 << 16], 0]], arrays={"flat": flat})  # fmt: skip
    data.send_multipart(P.encode(signed_params(head, learner.signer)))
    wait_for(lambda: body(broker, bus, keys)["policy_version"] == 0, WAIT_S, "version 0")
    actor = client(bus, who(keys, "actor", "a"), broker.connect, rcvhwm=1, rcvbuf=4096)
    actor.send_multipart(P.encode(P.Hello(role="actor", peer_id="actor-0", num_envs=1)))
    behind = P.encode(P.Heartbeat(peer_id="actor-0", policy_version=-1))
    end = time.monotonic() + 2.0
    while time.monotonic() < end:  # 20 heartbeat intervals, each of which used to send the version again
        actor.send_multipart(behind, zmq.NOBLOCK)
        time.sleep(0.05)
    c = body(broker, bus, keys)
    assert c["snapshots_unread"] >= 10 and c["params_snapshots"] <= 6, c  # 20 before


def test_a_many_frame_message_over_the_budget_resets_the_sockets_and_the_run_trains_on(
    procs: Procs, tmp_path: Path, bus: Bus, keys: Path
) -> None:
    """A key holder's message of 600 frames of 1 MiB grew the broker by all of it: libzmq holds the frames until
    the last one arrives, each within the control socket's frame cap. At the memory budget the broker closes and
    binds its sockets again, which frees them (the rest of the message goes with the connection); the learner and
    both actors reconnect, say hello again, and training goes on."""
    limit_mib = 256
    broker = ProfiledBroker(procs, tmp_path, memory_limit_mib=limit_mib).start("--keys", str(keys))
    pid = broker.proc.pid
    run = ["--keys", str(keys), "--run-dir", str(tmp_path / "run")]
    sets = ["--set", "train.max_steps=100000000", "--set", "train.until_return=1e9", "--set", "train.max_seconds=600"]
    learner = procs.start("learner", "learner", CARTPOLE, "--connect", broker.connect, *run, *sets)
    actors = [
        procs.start(f"actor-{i}", "actor", "--connect", broker.connect, "--keys", str(keys), "--actor-id", str(i))
        for i in range(2)
    ]
    wait_for(lambda: body(broker, bus, keys)["policy_version"] >= 3, 120, "the run to publish version 3")
    sock = client(bus, who(keys, "monitor", "m"), broker.connect)
    frame = memoryview(bytearray(MIB - 8192))  # one buffer, sent 600 times without a copy
    with Peak(pid) as peak:
        sock.send_multipart([*heartbeat_frames("monitor-x"), *[frame] * 600], copy=False)
        c = wait_for(lambda: (b := body_if(broker, bus, keys)).get("memory_resets", 0) >= 1 and b, 60, "a reset")
        version = c["policy_version"]
    assert c["memory_resets"] == 1 and c["control_too_many_frames"] == 0, "the message was never read whole"
    assert peak.mib < limit_mib + 160, f"the broker reached {peak.mib:.0f} MiB with a budget of {limit_mib}"
    wait_for(lambda: rss_mib(pid) < limit_mib, WAIT_S, "the memory to be freed")
    after = wait_for(
        lambda: (b := body(broker, bus, keys))["policy_version"] >= version + 10 and b, 120, "ten more versions"
    )
    assert after["members_by_role"]["actor"] == 2 and after["members_by_role"]["learner"] == 1
    assert after["accounted"] and after["memory_resets"] == 1
    assert learner.poll() is None and all(a.poll() is None for a in actors), "nobody died of the reset"
    assert rss_mib(pid) < limit_mib
