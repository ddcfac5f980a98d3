"""Parameters: late joiners get the cached version at once; the latest version wins.

The broker runs as a real `zddrl broker` process, driven over raw pyzmq sockets by the test-side clients of
tests/broker_clients.py. Every wait is on a condition with a deadline; the fixtures clean up every socket, link
and process.
"""

from __future__ import annotations

import pytest
import zmq

from broker_clients import WAIT_S, counters, recv_control, start_run, status
from conftest import BrokerHandle, Bus, wait_for
from zddrl import protocol as P

pytestmark = pytest.mark.slow  # every test here starts real zddrl processes

# ------------------------------------------------------------------------------------------------
# 4. Parameters: late joiners get the cached version at once; latest wins
# ------------------------------------------------------------------------------------------------


def test_late_subscriber_gets_cached_params_and_latest_wins(broker: BrokerHandle, bus: Bus) -> None:
    learner = start_run(bus, broker)
    learner.publish(2)
    wait_for(lambda: counters(broker, bus)["policy_version"] == 2, WAIT_S, "version 2")
    learner.publish(1)  # older than what is out: must not be re-published
    wait_for(lambda: counters(broker, bus).get("params_stale") == 1, WAIT_S, "the stale version to be counted")
    b = counters(broker, bus)
    assert b["policy_version"] == 2 and b["params_published"] == 2

    # A late joiner: hello on control -> welcome, then the cached version 2 right behind it.
    control = bus.socket(zmq.DEALER)
    control.connect(broker.connect)
    control.send_multipart(P.encode(P.Hello(role="actor", peer_id="late-actor")))
    welcome = recv_control(control)
    assert isinstance(welcome, P.Welcome) and welcome.run_id == "run-a" and welcome.run is not None
    snapshot = recv_control(control, 2000)
    assert isinstance(snapshot, P.Parameters) and snapshot.policy_version == 2
    assert P.param_hash(snapshot.arrays["flat"]) == snapshot.param_hash
    assert counters(broker, bus)["params_published"] == 2, "the late joiner needed no new publish"

    # Its SUB: once subscribed (a publish gets through), a stale version is never broadcast.
    sub = bus.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{welcome.ports['params']}")
    version = 2
    while True:  # PUB/SUB subscriptions take a moment to propagate: publish until one lands
        version += 1
        assert version < 200, "the SUB never received a broadcast"
        learner.publish(version)
        if sub.poll(100):
            break
    learner.publish(1)
    learner.publish(version + 1)
    seen = []
    while not seen or seen[-1] < version + 1:  # the probing loop's broadcasts, then version + 1
        seen.append(recv_control(sub).policy_version)
    assert 1 not in seen and seen == sorted(set(seen)), f"broadcast versions {seen}: a stale one went out"
    wait_for(lambda: counters(broker, bus).get("params_stale") == 2, WAIT_S, "the second stale version")


def test_actor_link_never_goes_back_to_an_older_version(broker: BrokerHandle, bus: Bus) -> None:
    learner = start_run(bus, broker)
    learner.publish(3)
    wait_for(lambda: counters(broker, bus)["policy_version"] == 3, WAIT_S, "version 3")
    link = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-0"), subscribe_params=True)
    got = link.wait_params(newer_than=-1, timeout_s=WAIT_S)
    assert got is not None and got.policy_version == 3, "late joiner: the cached version at once"
    seen = [3]
    for v in (1, 2, 4, 0, 5):  # 1, 2, 0 are stale at the broker
        learner.publish(v)
        if v > seen[-1]:
            got = link.wait_params(newer_than=seen[-1], timeout_s=WAIT_S)
            assert got is not None and got.policy_version == v
            seen.append(v)
    wait_for(lambda: counters(broker, bus).get("params_stale") == 3, WAIT_S, "three stale versions counted")
    assert link.latest_params().policy_version == 5 and link.params_rejected == 0
    # The broker sees the version the actor acts with through its heartbeats.
    wait_for(
        lambda: status(broker, bus)["members"]["actor-0"]["policy_version"] == 5,
        WAIT_S,
        "the actor's heartbeat to report version 5",
    )
