"""`zddrl status` against a real broker: table, JSON, a dead broker, a refused duplicate peer id.

The broker runs as a real `zddrl broker` process, driven over raw pyzmq sockets by the test-side clients of
tests/broker_clients.py. Every wait is on a condition with a deadline; the fixtures clean up every socket, link
and process.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import zmq

from broker_clients import WAIT_S, ProfiledBroker, Pusher, cli, counters, recv_control, start_run, status
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl import protocol as P
from zddrl.proc import free_ports
from zddrl.transport.link import hello_fields

pytestmark = pytest.mark.slow  # every test here starts real zddrl processes

# ------------------------------------------------------------------------------------------------
# 9. `zddrl status`
# ------------------------------------------------------------------------------------------------


def test_status_cli_table_json_and_dead_broker(broker: BrokerHandle, bus: Bus) -> None:
    learner = start_run(bus, broker)
    actor = Pusher(bus, broker, "actor-0")
    actor.link.send(P.Stats(peer_id="actor-0", role="actor", stats={"sps": 1234.0, "comm_share": 0.25}))
    learner_stats = {"policy_version": 0, "updates": 0, "return_mean_20": None, "lag/actor-0": 1, "dropped_late": 0}
    learner.link.send(P.Stats(peer_id="learner-0", role="learner", stats=learner_stats))
    wait_for(
        lambda: (
            status(broker, bus)["members"]["actor-0"]["stats"].get("sps") == 1234.0
            and status(broker, bus)["members"]["learner-0"]["stats"] == learner_stats
        ),
        WAIT_S,
        "both stats",
    )

    table = cli("status", "--connect", broker.connect)
    assert table.returncode == 0, table.stderr
    assert "run run-a" in table.stdout and "[ok]" in table.stdout
    assert "trajectories: received 0 = forwarded 0" in table.stdout
    rows = {ln.split()[0]: ln.split() for ln in table.stdout.splitlines() if ln.startswith(("actor-0", "learner-0"))}
    assert rows["actor-0"][1] == "actor" and "1234" in rows["actor-0"] and "25%" in rows["actor-0"]
    assert rows["learner-0"][1] == "learner"
    with pytest.raises(json.JSONDecodeError):
        json.loads(table.stdout)

    as_json = cli("status", "--connect", broker.connect, "--json")
    assert as_json.returncode == 0, as_json.stderr
    body = json.loads(as_json.stdout)
    assert body["broker"]["ports"] == broker.bound_ports and set(body["members"]) == {"actor-0", "learner-0"}

    (dead,) = free_ports(1)
    t0 = time.monotonic()
    out = cli("status", "--connect", f"tcp://127.0.0.1:{dead}", "--timeout", "0.5")
    assert out.returncode != 0
    assert f"no answer from a broker at tcp://127.0.0.1:{dead} within 0.5 s" in out.stderr
    assert time.monotonic() - t0 < 10


def test_a_second_live_process_with_the_same_peer_id_is_refused(procs: Procs, broker: BrokerHandle) -> None:
    """Two actors started with the same --actor-id: the second exits with a clear error, the first keeps its id."""
    first = procs.start("actor-a", "actor", "--connect", broker.connect, "--actor-id", "0")
    wait_for(
        lambda: "actor-0" in json.loads(cli("status", "--connect", broker.connect, "--json").stdout)["members"],
        WAIT_S,
        "the first actor to join",
    )
    second = procs.start("actor-b", "actor", "--connect", broker.connect, "--actor-id", "0")
    assert procs.exit_or_dump(second, WAIT_S, "broker") != 0
    assert "peer id 'actor-0' is in use by pid" in procs.log("actor-b")
    body = json.loads(cli("status", "--connect", broker.connect, "--json").stdout)
    assert body["members"]["actor-0"]["pid"] == first.pid and first.poll() is None
    assert not any("replaced by" in d["reason"] for d in body.get("departures", []))


def test_a_holder_whose_beat_is_late_is_asked_about_again_then_taken_over(
    procs: Procs, tmp_path: Path, bus: Bus
) -> None:
    """A hello for an id whose holder has been silent for one interval (late, or killed a moment ago) is refused
    without ending the client, which asks again at its next heartbeat and takes the id once the holder has missed a
    beat (two intervals): neither a live holder's late beat nor a process restarted at once after a kill loses."""
    broker = ProfiledBroker(procs, tmp_path, heartbeat_interval_s=3.0).start()  # a late beat: 3-6 s of silence
    holder = bus.socket(zmq.DEALER)
    holder.connect(broker.connect)
    holder.send_multipart(P.encode(P.Hello(role="actor", peer_id="actor-0", host="h1", pid=1)))
    assert isinstance(recv_control(holder), P.Welcome)  # and it never beats again, like a killed process
    wait_for(
        lambda: status(broker, bus)["members"]["actor-0"]["last_seen_s"] >= 3.2, WAIT_S, "the holder's beat to be late"
    )
    second = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-0", **hello_fields()))
    assert second.wait_welcome(WAIT_S) is not None and second.refused is None, "asked again, then welcomed"
    assert counters(broker, bus)["hello_id_in_use"] >= 1, "refused, not for good: its link asked again"
    body = status(broker, bus)
    assert body["members"]["actor-0"]["pid"] == hello_fields()["pid"]
    assert any(d["reason"].startswith("replaced by pid") for d in body["departures"]), body["departures"]
    assert "its heartbeat is late: asking again at the next one" in procs.log("broker")
