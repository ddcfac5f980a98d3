"""What a broker's death costs its clients, against real `zddrl broker` processes on loopback (issue 27 item 6).

* A broker killed and restarted on its ports welcomes each client once: the heartbeats the clients queued while it
  was down all come back "send hello first", and only the first of them gets a hello.
* Clients with a fallback list move to the next broker one heartbeat interval after a kill -9 (the socket monitor
  sees the connection close), not after interval x liveness of silence.
* A client refused at the handshake (no keys on a closed bus) says so, and `zddrl status` says so at once.
* The broker's line for a trajectory of an actor it expired says that the actor expired.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import zmq
from loguru import logger

from broker_clients import WAIT_S, ProfiledBroker, cli, start_run, status, trajectory
from conftest import Bus, Procs, wait_for
from zddrl import protocol as P
from zddrl.keys import new_key
from zddrl.transport.link import BrokerLink

pytestmark = pytest.mark.slow  # real zddrl processes

INTERVAL_S = 0.5
LIVENESS = 20
"""Silence of 10 s before a client gives a broker up: long enough for a restart on a loaded machine, and far
above the one interval that a closed connection takes."""
CLIENTS = 4


def profiled(procs: Procs, tmp_path: Path, name: str, *options: str) -> ProfiledBroker:
    folder = tmp_path / name
    folder.mkdir()
    return ProfiledBroker(procs, folder, heartbeat_interval_s=INTERVAL_S, heartbeat_liveness=LIVENESS).start(*options)


def actors(bus: Bus, connect: str) -> list[BrokerLink]:
    links = [bus.link(connect, P.Hello(role="actor", peer_id=f"actor-{i}")) for i in range(CLIENTS)]
    wait_for(lambda: all(link.generation == 1 for link in links), WAIT_S, "every actor's welcome")
    return links


def test_a_restarted_broker_welcomes_each_client_once(procs: Procs, tmp_path: Path, bus: Bus) -> None:
    broker = profiled(procs, tmp_path, "broker")
    links = actors(bus, broker.connect)
    assert [link.hellos for link in links] == [1] * CLIENTS
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGKILL)
    broker.proc.wait(timeout=WAIT_S)
    time.sleep(4 * INTERVAL_S)  # the scenario, not a wait: down for four beats, which the clients queue
    broker.start()  # same ports
    wait_for(lambda: all(link.generation >= 2 for link in links), 20, "every actor's welcome by the restarted broker")
    seen = [link.generation for link in links]
    while True:  # until no client was welcomed again for three intervals (a second welcome would come within one)
        time.sleep(3 * INTERVAL_S)
        now = [link.generation for link in links]
        if now == seen:
            break
        seen = now
    assert [link.generation for link in links] == [2] * CLIENTS, "one welcome per client after the restart"
    assert [link.hellos for link in links] == [2] * CLIENTS, "one hello per client after the restart"
    assert sum(link.hellos_held for link in links) >= CLIENTS, "the queued heartbeats were rejected, unanswered"
    assert {f"actor-{i}" for i in range(CLIENTS)} <= set(status(broker, bus)["members"])


def test_clients_move_to_the_next_broker_one_interval_after_a_kill(procs: Procs, tmp_path: Path, bus: Bus) -> None:
    a, b = profiled(procs, tmp_path, "a"), profiled(procs, tmp_path, "b")
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="WARNING")
    try:
        links = actors(bus, f"{a.connect},{b.connect}")
        assert a.proc is not None
        a.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        moved: dict[int, float] = {}

        def all_moved() -> bool:
            for i, link in enumerate(links):
                if i not in moved and link.generation == 2 and link.connect == b.connect:
                    moved[i] = time.monotonic() - killed
            return len(moved) == CLIENTS

        wait_for(all_moved, 2 * INTERVAL_S * LIVENESS, "every actor's welcome by b", interval_s=0.005)
    finally:
        logger.remove(sink)
    took = max(moved.values())
    print(f"\nkill -9 of broker a to the last of {CLIENTS} actors welcomed by b: {took:.2f} s")
    # One interval, then the join on b; silence alone would take INTERVAL_S x LIVENESS = 10 s.
    assert INTERVAL_S <= min(moved.values()) and took < INTERVAL_S + 2.5, moved
    moving = [line for line in lines if line.startswith(f"broker at {a.connect} silent; moving to the broker at")]
    assert len(moving) == CLIENTS and all("(no connection to it for" in line for line in moving), moving


@pytest.fixture
def closed(procs: Procs, tmp_path: Path) -> tuple[ProfiledBroker, Path]:
    keys = tmp_path / "keys"
    for role, name in [("broker", "b"), ("learner", "l"), ("actor", "a"), ("monitor", "m")]:
        new_key(keys, role, name)
    return profiled(procs, tmp_path, "closed", "--keys", str(keys)), keys


def test_a_client_without_keys_on_a_closed_bus_says_its_handshake_was_refused(
    closed: tuple[ProfiledBroker, Path], bus: Bus
) -> None:
    broker, _ = closed
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="ERROR")
    try:
        started = time.monotonic()
        link = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-0"))
        wait_for(lambda: link.handshakes.refused, WAIT_S, "the refused handshake")
        took = time.monotonic() - started
    finally:
        logger.remove(sink)
    assert took < 2.0, f"the refusal was known {took:.1f} s after the start"
    assert "wants keys" in link.handshakes.refused and "--keys" in link.handshakes.refused
    assert any("refused the handshake" in line and "--keys" in line for line in lines), lines
    assert link.welcome is None


def test_status_without_keys_on_a_closed_bus_says_so_at_once(closed: tuple[ProfiledBroker, Path]) -> None:
    broker, keys = closed
    started = time.monotonic()
    out = cli("status", "--connect", broker.connect, "--timeout", "15")
    took = time.monotonic() - started
    assert out.returncode != 0 and "no answer" not in out.stderr, out.stderr
    assert f"the broker at {broker.connect} refused the handshake" in out.stderr and "--keys" in out.stderr
    assert took < 10, f"took {took:.1f} s: the refusal must not wait for the 15 s timeout"
    ok = cli("status", "--connect", broker.connect, "--keys", str(keys), "--json")
    assert ok.returncode == 0, ok.stderr


def test_a_trajectory_of_an_expired_actor_is_dropped_as_such(procs: Procs, tmp_path: Path, bus: Bus) -> None:
    folder = tmp_path / "fast"
    folder.mkdir()
    broker = ProfiledBroker(procs, folder, heartbeat_interval_s=0.2, heartbeat_liveness=3).start()
    start_run(bus, broker).grant(100)  # the broker reads trajectories only while a learner holds credit
    ghost = bus.socket(zmq.DEALER)
    ghost.connect(broker.connect)
    ghost.send_multipart(P.encode(P.Hello(role="actor", peer_id="ghost")))
    wait_for(lambda: "ghost" in status(broker, bus)["members"], WAIT_S, "the ghost to join")
    wait_for(lambda: "ghost" not in status(broker, bus)["members"], WAIT_S, "the silent ghost to expire")
    push = bus.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{broker.bound_ports['trajectories']}")
    seq = 0

    def dropped_as_expired() -> bool:  # past the grace after expiry (interval x liveness), its data is no one's
        nonlocal seq
        seq += 1
        push.send_multipart(P.encode(trajectory("run-a", "ghost", seq)))
        return "dropped a trajectory from 'ghost': that actor expired" in procs.log("broker")

    wait_for(dropped_as_expired, WAIT_S, "the expired actor's drop line", interval_s=0.2)
    line = next(ln for ln in procs.log("broker").splitlines() if "from 'ghost': that actor expired" in ln)
    assert "silent for" in line and "must" in line and "hello" in line
