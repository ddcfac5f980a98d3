"""A second learner, for another run, while one is live: refused with advice for a learner (not the actors'
--actor-id advice), and counted by the broker as a refused hello, not as a malformed message."""

from __future__ import annotations

from pathlib import Path

from broker_clients import WAIT_S, Shard, counters, learner_hello, run_spec
from conftest import BrokerHandle, Bus, Procs, wait_for


def test_a_second_learner_is_refused_as_a_learner(procs: Procs, bus: Bus, tmp_path: Path) -> None:
    # A long heartbeat interval: the live learner is never silent long enough to be taken over during the test.
    profile = tmp_path / "slow-beats.toml"
    profile.write_text("[broker]\nheartbeat_interval_s = 5.0\n")
    broker = BrokerHandle(procs, tmp_path).start("--profile", str(profile))
    Shard(bus, broker, "learner-0", "run-a", run_spec())  # the live learner (host "", pid 0)

    second = bus.link(broker.connect, learner_hello("learner-0", "run-b", run_spec(), host="elsewhere", pid=4242))
    wait_for(lambda: second.refused, WAIT_S, "the second learner to be refused")

    why = second.refused or ""
    assert "another learner (run 'run-a'" in why and "stop that learner first, or use another broker" in why, why
    assert "--actor-id" not in why
    c = counters(broker, bus)
    assert c["hello_id_in_use"] == 1 and c["control_malformed"] == 0, c
    assert c.get("runs_refused", 0) == 0
    log = procs.log("broker")
    assert "refused a hello of learner learner-0: another learner" in log and "malformed" not in log, log[-2000:]
