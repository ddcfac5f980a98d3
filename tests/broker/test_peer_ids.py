"""Peer ids belong to keys on a closed bus (broker/guard.py, docs/security.md "Peer ids and keys"), each rule on
real CURVE sockets: an id names its role; the key that held an id takes it back at once after its process died,
while a squatter with another key is refused; no other key takes it until its holder's departure window ends;
caps per key, not per reported host; a monitor's welcome carries no run and its departure reserves nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from broker_clients import WAIT_S, ProfiledBroker, learner_hello, run_spec, running
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl import protocol as P
from zddrl.broker import limits
from zddrl.broker.broker import Broker
from zddrl.config import BrokerConfig
from zddrl.keys import Credentials, credentials, new_key
from zddrl.transport.signatures import signed_hello
from zddrl.transport.status import request_status

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent.parent
ANSWER_MS = 3000


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    for role, name in [("broker", "b"), ("learner", "l"), ("learner", "l2"), ("actor", "a"), ("actor", "b")]:
        new_key(root, role, name)
    for name in ("m", "m2"):
        new_key(root, "monitor", name)
    return root


def who(keys: Path, role: str, name: str) -> Credentials:
    return credentials(keys, role, name)


def ask(bus: Bus, endpoint: str, creds: Credentials, hello: P.Hello) -> P.Message | None:
    """One hello on a fresh connection; the broker's first answer (None: none within ANSWER_MS)."""
    sock = bus.socket(zmq.DEALER)
    creds.apply(sock)
    sock.connect(endpoint)
    sock.send_multipart(P.encode(hello))
    answer = P.decode(sock.recv_multipart()) if sock.poll(ANSWER_MS) else None
    sock.close(linger=0)
    bus.sockets.remove(sock)
    return answer


def refused(answer: P.Message | None, final: bool, *words: str) -> bool:
    if not isinstance(answer, P.Reject) or answer.reason.startswith(P.REFUSED_PREFIX) != final:
        return False
    return all(w in answer.reason for w in words)


def broker_counters(broker: BrokerHandle, bus: Bus, keys: Path) -> dict:
    body = request_status(broker.connect, WAIT_S, bus.ctx, credentials=who(keys, "monitor", "m"))
    assert body is not None, "no status for the monitor key"
    return body


def test_a_key_claims_ids_of_its_own_role_only(procs: Procs, tmp_path: Path, bus: Bus, keys: Path) -> None:
    broker = BrokerHandle(procs, tmp_path).start("--keys", str(keys))
    squats = [
        (who(keys, "actor", "a"), P.Hello(role="actor", peer_id="learner-0", num_envs=1)),
        (who(keys, "monitor", "m"), P.Hello(role="monitor", peer_id="learner-0")),
        (who(keys, "monitor", "m"), P.Hello(role="monitor", peer_id="actor-3")),
        (who(keys, "monitor", "m"), P.Hello(role="monitor", peer_id="dashboard")),  # no role's id: not a monitor's
        (who(keys, "learner", "l"), P.Hello(role="learner", peer_id="actor-3")),
        (who(keys, "actor", "a"), P.Hello(role="actor", peer_id="replay-0", num_envs=1)),
    ]
    for creds, hello in squats:
        answer = ask(bus, broker.connect, creds, hello)
        assert refused(answer, True, repr(hello.peer_id)), (hello, answer)
    assert broker_counters(broker, bus, keys)["broker"]["auth_refused"] == len(squats)
    assert isinstance(
        ask(bus, broker.connect, who(keys, "actor", "a"), P.Hello(role="actor", peer_id="actor-3")), P.Welcome
    )


def test_a_monitor_is_welcomed_with_no_run_and_reserves_nothing(
    procs: Procs, tmp_path: Path, bus: Bus, keys: Path
) -> None:
    """A monitor reads status and nothing else: its welcome has no run spec, seal, bus or data ports, even while a
    run is on; `zddrl status` with its key works; its id is free for another monitor key as soon as it leaves."""
    broker = BrokerHandle(procs, tmp_path).start("--keys", str(keys))
    learner = who(keys, "learner", "l")
    assert learner.signer is not None
    run = bus.link(broker.connect, signed_hello(learner_hello("learner-0", "run-a", run_spec()), learner.signer),
                   credentials=learner)  # fmt: skip
    assert run.wait_welcome(WAIT_S) is not None
    actor_welcome = ask(bus, broker.connect, who(keys, "actor", "a"), P.Hello(role="actor", peer_id="actor-0"))
    assert isinstance(actor_welcome, P.Welcome) and actor_welcome.run is not None  # the run is on
    monitor = bus.link(
        broker.connect, P.Hello(role="monitor", peer_id="monitor-0"), credentials=who(keys, "monitor", "m")
    )
    welcome = monitor.wait_welcome(WAIT_S)
    assert welcome is not None and welcome.peer_id == "monitor-0"
    assert welcome.run is None and welcome.run_id == "" and welcome.run_signer == "" and welcome.run_signature == b""
    assert welcome.bus is None and welcome.ports == {} and welcome.data_identity == b""
    body = broker_counters(broker, bus, keys)
    assert set(body["members"]) == {"learner-0", "actor-0", "monitor-0"}
    status = subprocess.run(
        [sys.executable, "-m", "zddrl", "status", "--connect", broker.connect, "--keys", str(keys), "--key", "m"],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert status.returncode == 0 and "learner-0" in status.stdout, status.stderr
    monitor.close("done")
    wait_for(lambda: "monitor-0" not in broker_counters(broker, bus, keys)["members"], WAIT_S, "the monitor's bye")
    again = ask(bus, broker.connect, who(keys, "monitor", "m2"), P.Hello(role="monitor", peer_id="monitor-0"))
    assert isinstance(again, P.Welcome), again


LEARNER_CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
from broker_clients import learner_hello, run_spec
from zddrl.keys import credentials
from zddrl.transport.link import BrokerLink, hello_fields
from zddrl.transport.signatures import signed_hello
creds = credentials({keys!r}, "learner", "l")
hello = signed_hello(learner_hello("learner-0", "run-a", run_spec(), **hello_fields()), creds.signer)
link = BrokerLink({connect!r}, hello, credentials=creds).start()
assert link.wait_welcome(30) is not None
print("welcomed", flush=True)
time.sleep(600)
"""


class Squatter:
    """Says hello as ``peer_id`` with keys that are not its holder's, on a fresh connection each time, until
    stopped; every answer is kept."""

    def __init__(self, bus: Bus, endpoint: str, tries: list[tuple[Credentials, P.Hello]]) -> None:
        self.bus, self.endpoint, self.tries = bus, endpoint, tries
        self.answers: list[P.Message | None] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for creds, hello in self.tries:
                sock = self.bus.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                creds.apply(sock)
                sock.connect(self.endpoint)
                sock.send_multipart(P.encode(hello))
                self.answers.append(P.decode(sock.recv_multipart()) if sock.poll(ANSWER_MS) else None)
                sock.close(linger=0)
            self.stop.wait(0.02)

    def close(self) -> list[P.Message | None]:
        self.stop.set()
        self.thread.join(timeout=WAIT_S)
        return self.answers


def test_a_killed_learners_key_takes_its_id_back_at_once_while_a_squatter_is_refused(
    procs: Procs, tmp_path: Path, bus: Bus, keys: Path
) -> None:
    """kill -9 of a learner, then its restart (the same key, another process) says hello as learner-0 at once: it
    is welcomed, long before a heartbeat interval of silence (5 s here) could explain it, because the broker saw
    the dead process's connection close; squatters with another learner key and an actor key, trying learner-0
    the whole time, are refused and counted."""
    broker = ProfiledBroker(procs, tmp_path, heartbeat_interval_s=5.0).start("--keys", str(keys))
    child = subprocess.Popen(
        [sys.executable, "-c", LEARNER_CHILD.format(tests=str(TESTS), keys=str(keys), connect=broker.connect)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "welcomed"
        learner = who(keys, "learner", "l")
        assert learner.signer is not None
        squatter = Squatter(
            bus,
            broker.connect,
            [
                (who(keys, "learner", "l2"), learner_hello("learner-0", host="squat", pid=1)),
                (who(keys, "actor", "a"), P.Hello(role="actor", peer_id="learner-0", host="squat", pid=2)),
            ],
        )
        wait_for(lambda: len(squatter.answers) >= 4, WAIT_S, "the squatter's first tries")
        killed = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=WAIT_S)
        restart = bus.link(
            broker.connect,
            signed_hello(
                learner_hello("learner-0", "run-a", run_spec(), host="learner-host", pid=4242), learner.signer
            ),
            credentials=learner,
        )
        welcome = restart.wait_welcome(WAIT_S)
        took_s = time.monotonic() - killed
        assert welcome is not None and restart.refused is None, restart.refused
        print(f"\nkill -9 of learner-0 to its restart welcomed, a squatter trying its id: {took_s * 1000:.0f} ms")
        assert took_s < 2.0, "the restart waited for the dead session's silence"
        time.sleep(0.3)  # the squatter tries the restarted learner's id too
        answers = squatter.close()
    finally:
        child.kill()
        child.wait()
    assert answers and not any(isinstance(a, P.Welcome) for a in answers), answers
    assert all(isinstance(a, P.Reject) for a in answers), answers
    body = broker_counters(broker, bus, keys)
    assert body["members"]["learner-0"]["pid"] == 4242
    assert body["broker"]["auth_refused"] >= len(answers)
    (departure,) = [d for d in body["departures"] if d["member"] == "learner-0"]
    assert departure["reason"].startswith("replaced by pid 4242"), departure


def test_no_other_key_takes_an_id_before_its_holders_departure_window_ends(
    procs: Procs, tmp_path: Path, bus: Bus, keys: Path
) -> None:
    """An actor that left (bye) keeps its id for its key for heartbeat interval x liveness (1 s here): another key
    is refused with a reject that is not final (its client asks again), the holder's key is not; after the window
    the other key may take it."""
    broker = ProfiledBroker(procs, tmp_path, heartbeat_interval_s=0.2, heartbeat_liveness=5).start("--keys", str(keys))
    hello = P.Hello(role="actor", peer_id="actor-7", num_envs=1, host="h1", pid=11)
    owner = bus.link(broker.connect, hello, credentials=who(keys, "actor", "a"))
    assert owner.wait_welcome(WAIT_S) is not None
    owner.close("bye")
    wait_for(lambda: "actor-7" not in broker_counters(broker, bus, keys)["members"], WAIT_S, "the bye")
    left = time.monotonic()
    other = P.Hello(role="actor", peer_id="actor-7", num_envs=1, host="h2", pid=22)
    answer = ask(bus, broker.connect, who(keys, "actor", "b"), other)
    assert time.monotonic() - left < 1.0, "too slow to try within the window"
    assert refused(answer, False, "departure window", "asking again"), answer
    again = bus.link(broker.connect, hello, credentials=who(keys, "actor", "a"))  # its own key: at once
    assert again.wait_welcome(WAIT_S) is not None and again.refused is None
    assert refused(ask(bus, broker.connect, who(keys, "actor", "b"), other), True, "another key")  # held, live
    again.close("bye")
    left = time.monotonic()
    patient = bus.link(broker.connect, other, credentials=who(keys, "actor", "b"))  # waits the window out
    assert patient.wait_welcome(WAIT_S) is not None and patient.refused is None
    assert time.monotonic() - left > 0.8, "welcomed inside the window"
    assert broker_counters(broker, bus, keys)["broker"]["auth_refused"] >= 3


def test_caps_are_per_key_not_per_reported_host(bus: Bus, keys: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a closed bus the per-host cap (which trusts the host a hello names) gives way to a cap per key."""
    monkeypatch.setitem(limits.MAX_MEMBERS_PER_KEY, "actor", 3)
    monkeypatch.setattr(limits, "MAX_ACTORS_PER_HOST", 2)
    broker = Broker(BrokerConfig(bind="tcp://127.0.0.1:*", keys=str(keys), heartbeat_interval_s=5.0))
    with running(broker) as endpoint:
        a, b = who(keys, "actor", "a"), who(keys, "actor", "b")

        def hello(i: int, host: str) -> P.Hello:
            return P.Hello(role="actor", peer_id=f"actor-{i}", num_envs=1, host=host, pid=i)

        for i in range(3):  # three naming one host, with one key: past the per-host cap, within the key's
            assert isinstance(ask(bus, endpoint, a, hello(i, "same")), P.Welcome), i
        over = ask(bus, endpoint, a, hello(3, "elsewhere"))  # another host name does not help
        assert refused(over, True, "at most 3 members with one actor key ('a')"), over
        assert isinstance(ask(bus, endpoint, b, hello(4, "same")), P.Welcome)  # another key has its own share
        assert broker.counters["hello_over_cap"] == 1
