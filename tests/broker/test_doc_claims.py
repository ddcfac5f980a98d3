"""docs/protocol.md's claims about what a real broker answers, where a client written from the document alone would
otherwise guess: a message with arrays on control is dropped unanswered whoever sends it (5.2); an actor's
``auto_id`` hello may carry an empty peer id, and refused ``auto_id`` hellos count only ``auto_id_refused`` (5.1); a
re-hello from the process that holds an id keeps it with no departure recorded (5.1)."""

from __future__ import annotations

import dataclasses

import zmq

from broker_clients import WAIT_S, learner_hello, run_spec, status
from conftest import BrokerHandle, Bus, wait_for
from contract_clients import Control
from samples import traj
from zddrl import protocol as P


def first_answer(sock: zmq.Socket) -> P.Message:
    assert sock.poll(int(WAIT_S * 1000)), "no answer from the broker"
    return P.decode(sock.recv_multipart())


def test_a_trajectory_on_control_gets_no_answer_even_from_a_stranger(broker: BrokerHandle, bus: Bus) -> None:
    sock = bus.socket(zmq.DEALER)
    sock.connect(broker.connect)
    sock.send_multipart(P.encode(traj()))  # no hello: a kind with arrays, on the wrong socket
    sock.send_multipart(P.encode(P.Heartbeat(peer_id="stranger")))  # no arrays: "send hello first"
    sock.send_multipart(P.encode(P.StatusRequest(peer_id="status")))
    reject = first_answer(sock)  # the ROUTER answers in order: nothing came for the trajectory
    assert isinstance(reject, P.Reject) and reject.rehello and reject.reason == "unknown peer: send hello first"
    body = first_answer(sock)
    assert isinstance(body, P.Status)
    counted = body.body["broker"]
    assert counted["control_too_many_frames"] == 1 and counted["control_malformed"] == 1


def test_an_auto_id_hello_may_carry_an_empty_peer_id_and_a_refused_one_is_not_malformed(
    broker: BrokerHandle, bus: Bus
) -> None:
    actor = Control(bus, broker, P.Hello(role="actor", peer_id="", auto_id=True, host="h", pid=1))
    assert actor.welcome.peer_id == "actor-0"
    sock = bus.socket(zmq.DEALER)
    sock.connect(broker.connect)
    hello = learner_hello("learner-0", "run-1", run_spec())
    sock.send_multipart(P.encode(dataclasses.replace(hello, auto_id=True)))
    reject = first_answer(sock)
    assert isinstance(reject, P.Reject) and reject.reason.startswith(P.REFUSED_PREFIX) and not reject.rehello
    counted = status(broker, bus)["broker"]
    assert counted["auto_id_refused"] == 1 and counted["control_malformed"] == 0


def test_a_re_hello_of_the_same_process_keeps_its_id_with_no_departure(broker: BrokerHandle, bus: Bus) -> None:
    hello = P.Hello(role="actor", peer_id="actor-3", host="h", pid=7)
    first = Control(bus, broker, hello)
    again = Control(bus, broker, hello)  # a new connection of the same process (a reconnect), at once
    assert first.welcome.peer_id == again.welcome.peer_id == "actor-3"
    body = status(broker, bus)
    assert list(body["members"]) == ["actor-3"] and body["departures"] == []
    other = Control(bus, broker, P.Hello(role="actor", peer_id="actor-4", host="h", pid=8))
    other.send(P.Bye(peer_id="actor-4", reason="done"))
    left = wait_for(lambda: status(broker, bus)["departures"], WAIT_S, "the bye to be heard")  # another connection
    assert [d["member"] for d in left] == ["actor-4"]  # a departure is recorded, and listed so


def test_the_non_final_rejects_protocol_md_quotes_are_the_brokers() -> None:
    """10.1 step 5 quotes the reasons of the rejects without the "hello refused: " prefix that do not end a client's
    session: the late holder's (hello_id_in_use) and the departure window's (auth_refused)."""
    import inspect
    import re
    import time
    from pathlib import Path

    from zddrl.broker import guard
    from zddrl.broker.membership import Member, id_conflict

    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    step = doc[doc.index("5. On **reject** with `rehello: true`") :]
    step = step[: step.index("\n6. ")]
    holder = Member(peer_id="actor-1", role="actor", identity=b"x", host="a", pid=1)
    holder.last_seen = time.monotonic() - 1.5  # one to two intervals of 1 s: late, perhaps alive
    why, final = id_conflict(holder, P.Hello(role="actor", peer_id="actor-1", host="b", pid=2), 1.0)
    assert not final and not why.startswith(P.REFUSED_PREFIX)
    late = re.search(r"the reason ends `([^`]+)`", step)
    assert late and why.endswith(" ".join(late.group(1).split()))
    window = re.search(r"the reason says `peer id \.\.\. ([^`]+?) \(in about S s\); asking again`", step)
    assert window and " ".join(window.group(1).split()) in inspect.getsource(guard.Guard.window_refusal)
