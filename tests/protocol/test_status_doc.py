"""docs/protocol.md section 9 names every key of a real broker's status body, and every counter the broker has.

A real `zddrl broker` is driven through the conversations that make its body as full as it gets (a run,
parameters, a forwarded and a malformed trajectory, stats, a health warning, a departure); then every key
of the body, of each member row, health row and departure row must appear in section 9 (in backticks), and
every counter of zddrl.broker.report must be in the body from the start.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgpack
import numpy as np
import zmq

from broker_clients import WAIT_S, counters, status
from conftest import BrokerHandle, Bus, wait_for
from contract_clients import Control, Learner, trajectory, wire
from zddrl import protocol as P
from zddrl.broker.health import CHECKS
from zddrl.broker.report import BROKER_COUNTERS, RATES
from zddrl.broker.routing import DROP_REASONS
from zddrl.transport.params import split

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text(encoding="utf-8")
SECTION_9 = re.search(r"^## 9\. Status body\n(.*?)^## 10\. ", DOC, re.MULTILINE | re.DOTALL).group(1)
SECTION_8 = re.search(r"^## 8\. Drop reasons\n(.*?)^## 9\. ", DOC, re.MULTILINE | re.DOTALL).group(1)


def documented(key: str) -> bool:
    return f"`{key}`" in SECTION_9


def test_every_counter_is_documented_and_in_the_body_from_the_start(broker: BrokerHandle, bus: Bus) -> None:
    b = counters(broker, bus)  # a broker that has done nothing yet
    for key in (*BROKER_COUNTERS, *RATES, "credit", "fleet_seq", "fleet_actors", "accounted", "in_flight"):
        assert key in b, f"{key} is not in a fresh broker's status body"
        assert documented(key), f"{key} is not in docs/protocol.md section 9"
    assert set(b["dropped"]) == set(DROP_REASONS)
    for reason in DROP_REASONS:
        assert f"| `{reason}` |" in SECTION_8, reason
    for check in CHECKS:
        assert documented(check), check


def test_every_key_of_a_real_status_body_is_documented(broker: BrokerHandle, bus: Bus) -> None:
    learner = Learner(bus, broker)
    flat = np.arange(8, dtype=np.float32)
    (params,) = split(run_id="run-a", peer_id="learner-0", version=0, flat=flat, layout=[["w", "float32", [8], 0]])
    learner.send(params)
    learner.grant(10)
    wait_for(lambda: counters(broker, bus)["policy_version"] == 0, WAIT_S, "version 0")
    actor = Control(bus, broker, P.Hello(role="actor", peer_id="actor-0", host="node1", num_envs=1))
    push = bus.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{actor.welcome.ports['trajectories']}")
    push.send_multipart(wire(trajectory("run-a", "actor-0", 0)))
    good = wire(trajectory("run-a", "actor-0", 1))
    push.send_multipart([good[0], msgpack.packb({**msgpack.unpackb(good[1]), "bogus": 1}), *good[2:]])
    learner.trajectories(1)
    actor.send(
        P.Stats(
            peer_id="actor-0",
            role="actor",
            stats={"run_id": "run-a", "policy_version": 0, "param_hash": "f" * 16, "sps": 10.0},
        )
    )
    leaver = Control(bus, broker, P.Hello(role="monitor", peer_id="monitor-0"))
    leaver.send(P.Bye(peer_id="monitor-0", reason="done"))

    def full() -> dict | None:
        body = status(broker, bus)
        ready = (
            body["health"]
            and body["departures"]
            and body["broker"]["received"] == 2
            and "dropped_malformed" in body["members"].get("actor-0", {})
        )
        return body if ready else None

    body = wait_for(full, WAIT_S, "a health warning, a departure and both trajectories read")

    assert set(body) == {"broker", "members", "health", "departures"}
    assert all(documented(k) for k in body)
    undocumented = [k for k in body["broker"] if not documented(k)]
    assert not undocumented, f"broker keys missing from section 9: {undocumented}"
    assert set(body["broker"]["ports"]) == {"control", "trajectories", "learners", "params"}
    assert all(documented(k) for k in body["broker"]["ports"])
    rows = body["members"]
    assert set(rows) == {"learner-0", "actor-0"}
    for peer_id, row in rows.items():
        missing = [
            k
            for k in row
            if not (
                documented(k)
                or k.startswith("dropped_")
                and documented("dropped_<reason>")
                and k[len("dropped_") :] in DROP_REASONS
            )
        ]
        assert not missing, f"member row keys of {peer_id} missing from section 9: {missing}"
        assert {"host", "pid", "num_envs"} <= set(row) and "`host`, `pid`, `num_envs`" in SECTION_9
    for row in body["health"]:
        assert all(documented(k) for k in row), row
        assert row["check"] in CHECKS
    for row in body["departures"]:
        assert all(documented(k) for k in row), row
    assert rows["learner-0"]["policy_version"] == 0 and rows["actor-0"]["dropped_malformed"] == 1
