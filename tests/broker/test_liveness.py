"""Liveness: clients survive a broker SIGKILL and restart; silent members expire; bye, monitors.

The broker runs as a real `zddrl broker` process, driven over raw pyzmq sockets by the test-side clients of
tests/broker_clients.py. Every wait is on a condition with a deadline; the fixtures clean up every socket, link
and process.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from broker_clients import (
    WAIT_S,
    ProfiledBroker,
    Pusher,
    collect,
    counters,
    recv_control,
    start_run,
    status,
    trajectory,
)
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl import protocol as P

pytestmark = pytest.mark.slow  # every test here starts real zddrl processes


@pytest.fixture
def fast_broker(procs: Procs, tmp_path: Path) -> ProfiledBroker:
    """Heartbeats every 0.2 s, expiry after 3 missed beats (0.6 s)."""
    return ProfiledBroker(procs, tmp_path, heartbeat_interval_s=0.2, heartbeat_liveness=3).start()


# ------------------------------------------------------------------------------------------------
# 7. Broker killed and restarted on the same ports
# ------------------------------------------------------------------------------------------------


def test_clients_reconnect_after_broker_sigkill_and_restart(broker: BrokerHandle, bus: Bus) -> None:
    learner = start_run(bus, broker, run_id="run-k")
    actor = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-0"), subscribe_params=True)
    assert actor.wait_params(-1, WAIT_S) is not None
    gen_actor, gen_learner = actor.generation, learner.link.generation

    broker.proc.kill()
    broker.proc.wait(timeout=WAIT_S)
    broker.start()  # same ports

    wait_for(
        lambda: actor.generation > gen_actor and learner.link.generation > gen_learner,
        20,
        "both links to be welcomed by the new broker",
    )
    wait_for(lambda: counters(broker, bus)["run_id"] == "run-k", WAIT_S, "the learner's re-hello to restore the run")
    assert actor.welcome.run_id == "run-k"
    assert actor.latest_params().policy_version == 0, "same run: the actor keeps what it holds"
    wait_for(lambda: {"learner-0", "actor-0"} <= set(status(broker, bus)["members"]), WAIT_S, "both members")

    # Resume: the shard reopens its data channel, re-publishes and grants; data flows again.
    learner.sock.close(linger=0)
    learner.sock = bus.socket(zmq.DEALER, identity=b"learner-0", rcvhwm=0)
    learner.sock.connect(learner.link.endpoint("learners"))
    learner.publish(1)
    learner.grant(4)
    got = actor.wait_params(newer_than=0, timeout_s=WAIT_S)
    assert got is not None and got.policy_version == 1
    push = bus.socket(zmq.PUSH)
    push.connect(actor.endpoint("trajectories"))
    push.send_multipart(P.encode(trajectory("run-k", "actor-0", 0, version=1)))
    collect([learner], 1, regrant=False)
    assert counters(broker, bus)["forwarded"] == 1


def test_learner_credit_restarts_with_a_control_rehello(broker: BrokerHandle, bus: Bus) -> None:
    shard = start_run(bus, broker)
    shard.grant(5)
    wait_for(lambda: status(broker, bus)["members"]["learner-0"]["credit"] == 5, WAIT_S, "the grant")
    # The shard's control session is replaced (its link timed out and said hello again): the broker
    # cannot know what the shard will re-grant, so credit starts from zero and the shard grants again
    # after the welcome (as DataChannel.regrant does); the window is never counted twice.
    control = bus.socket(zmq.DEALER)
    control.connect(broker.connect)
    control.send_multipart(P.encode(P.Hello(role="learner", peer_id="learner-0", run_id="run-a")))
    assert isinstance(recv_control(control), P.Welcome)
    assert status(broker, bus)["members"]["learner-0"]["credit"] == 0
    shard.grant(5)
    wait_for(lambda: status(broker, bus)["members"]["learner-0"]["credit"] == 5, WAIT_S, "the new grant")
    actor = Pusher(bus, broker, "actor-0")
    for seq in range(5):
        assert actor.send(trajectory("run-a", "actor-0", seq))
    collect([shard], 5, regrant=False)


# ------------------------------------------------------------------------------------------------
# 8. Liveness
# ------------------------------------------------------------------------------------------------


def test_silent_member_expires_and_unknown_heartbeats_get_rehello(fast_broker: ProfiledBroker, bus: Bus) -> None:
    broker = fast_broker
    alive = bus.link(broker.connect, P.Hello(role="actor", peer_id="alive"))  # heartbeats on its own
    welcome = alive.wait_welcome(WAIT_S)
    assert welcome.heartbeat_interval_s == 0.2 and welcome.heartbeat_liveness == 3
    ghost = bus.socket(zmq.DEALER)
    ghost.connect(broker.connect)
    ghost.send_multipart(P.encode(P.Hello(role="actor", peer_id="ghost")))
    assert isinstance(recv_control(ghost), P.Welcome)
    silent_since = time.monotonic()
    assert "ghost" in status(broker, bus)["members"]
    wait_for(lambda: "ghost" not in status(broker, bus)["members"], WAIT_S, "the silent member to expire")
    assert time.monotonic() - silent_since >= 0.2 * 3
    assert "alive" in status(broker, bus)["members"], "a heartbeating member must not expire"
    assert counters(broker, bus)["expired_or_left"] == 1

    ghost.send_multipart(P.encode(P.Heartbeat(peer_id="ghost", policy_version=0)))
    while True:  # skip the broker's own heartbeats sent before the expiry
        msg = recv_control(ghost)
        if not isinstance(msg, P.Heartbeat):
            break
    assert isinstance(msg, P.Reject) and msg.rehello

    stranger = bus.socket(zmq.DEALER)
    stranger.connect(broker.connect)
    stranger.send_multipart(P.encode(P.Heartbeat(peer_id="stranger")))
    msg = recv_control(stranger)
    assert isinstance(msg, P.Reject) and msg.rehello


def test_bye_removes_the_member_at_once(broker: BrokerHandle, procs: Procs, bus: Bus) -> None:
    link = bus.link(broker.connect, P.Hello(role="actor", peer_id="leaver"))
    assert link.wait_welcome(WAIT_S)
    assert "leaver" in status(broker, bus)["members"]
    link.close("done for today")
    # Expiry would take 3-4 s; the bye is handled at once.
    wait_for(lambda: "leaver" not in status(broker, bus)["members"], 2.0, "the bye to remove the member")
    assert "actor leaver left: done for today" in procs.log("broker")


def test_monitor_role_is_welcomed(broker: BrokerHandle, bus: Bus) -> None:
    link = bus.link(broker.connect, P.Hello(role="monitor", peer_id="mon"))
    assert link.wait_welcome(WAIT_S) is not None
    assert status(broker, bus)["members"]["mon"]["role"] == "monitor"
