"""An actor keeps to the run's window as the bus knows it (the welcome's ``bus.max_in_flight``), the value by which
the broker returns its credit (in batches of half of it). A run spec whose own value says otherwise does not make
the actor wait for the broker's next heartbeat tick: with a window of 1 against batches of 2, each trajectory's
credit came back only at the tick (0.8-0.9 s after it was read)."""

from __future__ import annotations

import statistics
import time

import zmq

from broker_clients import WAIT_S
from conftest import BrokerHandle, Bus, Procs
from zddrl import protocol as P
from zddrl.algos.model import ActorCritic, flatten_params
from zddrl.config import Config
from zddrl.envs import probe_spec
from zddrl.transport.params import split

TRAJECTORIES = 9


def test_an_actor_sends_within_the_buses_window_not_the_specs(procs: Procs, broker: BrokerHandle, bus: Bus) -> None:
    config = Config().replace({"algo.schedule": "async", "bus.max_in_flight": 1})
    window = {"sync": False, "max_staleness": 4, "max_in_flight": 4}  # credit goes back two trajectories at a time
    hello = P.Hello(role="learner", peer_id="learner-0", run_id="run-w", run=config.to_dict(), bus=window)
    link = bus.link(broker.connect, hello)
    assert link.wait_welcome(WAIT_S) is not None
    shard = bus.socket(zmq.DEALER, identity=b"learner-0", rcvhwm=0)
    shard.connect(link.endpoint("learners"))
    shard.send_multipart(P.encode(P.Credit(peer_id="learner-0", credit=1000)))
    flat, layout = flatten_params(ActorCritic(probe_spec(config.env.id), config.model))
    for msg in split(
        run_id="run-w", peer_id="learner-0", version=0, flat=flat, layout=layout, extras={},
        meta={"rollout_len": 4}, chunk_bytes=1 << 20, dtype="float32",
    ):  # fmt: skip
        shard.send_multipart(P.encode(msg))
    procs.start("actor", "actor", "--connect", broker.connect, "--actor-id", "0")

    arrivals: list[float] = []
    deadline = time.monotonic() + 3 * WAIT_S
    while len(arrivals) < TRAJECTORIES and time.monotonic() < deadline:
        if shard.poll(100) and isinstance(P.decode(shard.recv_multipart()), P.Trajectory):
            arrivals.append(time.monotonic())
    assert len(arrivals) == TRAJECTORIES, procs.log("actor")[-2000:]
    gaps = [b - a for a, b in zip(arrivals[1:], arrivals[2:])]  # from the second on: the actor is warm
    median_ms = statistics.median(gaps) * 1000
    print(f"median gap between trajectories: {median_ms:.1f} ms (gaps {[round(g * 1000) for g in gaps]} ms)")
    assert median_ms < 250, f"the actor waited for its credit: a median of {median_ms:.0f} ms between trajectories"
