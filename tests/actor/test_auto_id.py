"""`zddrl actor --actor-id auto`: the broker hands out the lowest free actor id (broker/actor_ids.py), seeds follow
it; a restarted process of the same key gets its departed predecessor's id back, another key cannot take it in its
holder's departure window; a reconnecting process keeps its id; a relay refuses to assign ids."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import zmq

from broker_clients import WAIT_S, ProfiledBroker, Shard, run_spec, running, status
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl import protocol as P
from zddrl.broker.actor_ids import actor_number
from zddrl.broker.broker import Broker
from zddrl.config import BrokerConfig
from zddrl.keys import credentials, new_key
from zddrl.transport.link import hello_fields
from zddrl.transport.status import request_status

pytestmark = pytest.mark.slow  # real broker and actor processes

JOIN_S = 60.0
"""Actor processes import torch and gymnasium before their hello: slow on two shared cores."""
LIVENESS = 5
"""Heartbeats of 1 s a member may miss (its expiry, then its key's departure window, in seconds). The hellos that
must land inside a window are in-process links sent milliseconds after the condition they follow."""


def seeds_of(log: str) -> list[str]:
    """The first seed of each run an actor's log says it made envs for."""
    return re.findall(r"seeds (\d+)\.\.", log)


def members(broker: BrokerHandle, bus: Bus, creds=None) -> dict:
    body = request_status(broker.connect, WAIT_S, bus.ctx, credentials=creds)
    assert body is not None, "the broker did not answer a status request"
    return body["members"]


def test_auto_actors_get_ids_0_to_n_and_seeds_apart(
    procs: Procs, broker: BrokerHandle, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    Shard(bus, broker, "learner-0", "run-a", run_spec())  # a run: the actors make their envs, and log their seeds
    monkeypatch.setenv("ZDDRL_ACTOR_ID", "auto")  # the environment's way, as a Kubernetes Deployment says it
    actors = [procs.start(f"a{i}", "actor", "--connect", broker.connect, "--envs", "2") for i in range(3)]
    wait_for(lambda: {"actor-0", "actor-1", "actor-2"} <= set(status(broker, bus)["members"]), JOIN_S, "3 ids")
    pids = {m["pid"] for peer, m in status(broker, bus)["members"].items() if peer.startswith("actor-")}
    assert pids == {a.pid for a in actors}, "one id each"
    wait_for(lambda: all(seeds_of(procs.log(f"a{i}")) for i in range(3)), JOIN_S, "every actor's envs")
    firsts = {seeds_of(procs.log(f"a{i}"))[0] for i in range(3)}
    assert firsts == {"1", "1001", "2001"}, firsts  # env j of actor i is seeded 1 + 1000 i + j
    assert all("the broker assigned actor id" in procs.log(f"a{i}") for i in range(3))


def test_procs_with_auto_ids(procs: Procs, broker: BrokerHandle, bus: Bus) -> None:
    Shard(bus, broker, "learner-0", "run-a", run_spec())
    fleet = procs.start(
        "fleet", "actor", "--connect", broker.connect, "--envs", "2", "--actor-id", "auto", "--procs", "3"
    )
    wait_for(lambda: {"actor-0", "actor-1", "actor-2"} <= set(status(broker, bus)["members"]), JOIN_S, "3 ids")
    wait_for(lambda: len(seeds_of(procs.log("fleet"))) == 3, JOIN_S, "every child's envs")
    log = procs.log("fleet")
    assert "3 actor processes started, ids assigned by the broker" in log
    assert sorted(seeds_of(log), key=int) == ["1", "1001", "2001"], log[-3000:]
    assert fleet.poll() is None


def test_a_reconnecting_actor_keeps_its_id(procs: Procs, broker: BrokerHandle, bus: Bus) -> None:
    """The broker restarts (its members are gone): each actor says hello again with the id it had, and keeps it,
    whichever hello the new broker reads first."""
    actors = [procs.start(f"a{i}", "actor", "--connect", broker.connect, "--actor-id", "auto") for i in range(2)]
    wait_for(lambda: {"actor-0", "actor-1"} <= set(status(broker, bus)["members"]), JOIN_S, "2 ids")
    before = {peer: m["pid"] for peer, m in status(broker, bus)["members"].items()}
    assert broker.proc is not None
    broker.proc.kill()
    broker.proc.wait(timeout=WAIT_S)
    broker.start()  # same ports
    wait_for(lambda: {"actor-0", "actor-1"} <= set(status(broker, bus)["members"]), JOIN_S, "the actors back")
    after = {peer: m["pid"] for peer, m in status(broker, bus)["members"].items()}
    assert after == before and all(a.poll() is None for a in actors)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    for role, name in [("broker", "b"), ("learner", "l"), ("actor", "a"), ("actor", "b"), ("monitor", "m")]:
        new_key(root, role, name)
    return root


def test_a_restart_gets_its_id_back_and_another_key_waits_out_the_window(
    procs: Procs, tmp_path: Path, bus: Bus, keys: Path
) -> None:
    """Key a's actor process gets kill -9 (no bye). The other hellos are in-process links (``auto_id``, as an
    actor's), each sent the moment its condition holds: so the windows need only outlast milliseconds."""
    broker = ProfiledBroker(procs, tmp_path, heartbeat_liveness=LIVENESS).start("--keys", str(keys))
    monitor = credentials(keys, "monitor", "m")

    def auto(key: str) -> str:
        """The id the broker assigns to an ``auto_id`` hello of the actor key ``key``."""
        hello = P.Hello(role="actor", peer_id="", auto_id=True, **hello_fields())
        link = bus.link(broker.connect, hello, credentials=credentials(keys, "actor", key))
        assert link.wait_welcome(WAIT_S) is not None, link.refused or f"no welcome for key {key}"
        return link.peer_id

    first = procs.start("a-first", "actor", "--connect", broker.connect, "--actor-id", "auto", "--keys", str(keys),
                        "--key", "a")  # fmt: skip
    wait_for(lambda: members(broker, bus, monitor).get("actor-0", {}).get("pid") == first.pid, JOIN_S,
             "key a's actor as actor-0")  # fmt: skip
    assert auto("b") == "actor-1"

    first.kill()  # kill -9: no bye; actor-0 stays key a's for its departure window
    first.wait(timeout=WAIT_S)
    assert auto("b") == "actor-2", "key b's second actor: not actor-0"
    # A member whose connection closed may be a live process (a blip, a memory reset): only once it expired is
    # its id given to a hello that names none.
    wait_for(lambda: "actor-0" not in members(broker, bus, monitor), LIVENESS + WAIT_S, "actor-0's member to expire")
    assert auto("a") == "actor-0", "key a's restarted actor back on actor-0"
    assert set(members(broker, bus, monitor)) >= {"actor-0", "actor-1", "actor-2"}


def test_a_relay_refuses_to_assign_ids(bus: Bus) -> None:
    """A relay's ids would clash with its upstream's and its siblings': it refuses ``auto_id`` with one line."""
    with running(Broker(BrokerConfig(bind="tcp://127.0.0.1:*"))) as root:
        with running(Broker(BrokerConfig(bind="tcp://127.0.0.1:*", upstream=root))) as relay:
            sock = bus.socket(zmq.DEALER)
            sock.connect(relay)
            sock.send_multipart(P.encode(P.Hello(role="actor", peer_id="", auto_id=True, **hello_fields())))
            assert sock.poll(int(WAIT_S * 1000)), "no answer from the relay"
            answer = P.decode(sock.recv_multipart())
    assert isinstance(answer, P.Reject) and answer.reason.startswith(P.REFUSED_PREFIX), answer
    assert "relay" in answer.reason and "--actor-id N" in answer.reason


def test_actor_numbers() -> None:
    assert [actor_number(i) for i in ("actor-0", "actor-12", "actor-012", "actor--1", "actor-", "learner-0")] == [
        0, 12, None, None, None, None,
    ]  # fmt: skip
