"""The broker and the learner stub of `python -m benchmarks fleet`, each in its own spawned process.

The stub is a learner shard reduced to its bus: it joins as a learner (announcing the run), publishes version 0,
and takes trajectories on a shard's ``DataChannel`` (the real credit policy), returning credit as fast as it
receives. For each trajectory it notes the receipt time and ``now - info["t_send"]``: the actors stamp the send
time on the monotonic clock, which on Linux is one clock for every process of the machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from benchmarks.fleet_sim import FD_MARGIN, SOCKETS_PER_ACTOR, raise_nofile
from zddrl import protocol as P
from zddrl.bench import common as C
from zddrl.config import BusConfig

LEARNER_ID = "fleet-learner"
MAX_IN_FLIGHT = BusConfig.max_in_flight
"""The run's ``bus.max_in_flight``: BusConfig's default, what an actor may have uncredited."""
RUN_SPEC = {"name": "bench-fleet"}
"""The run spec, passed on unread; its hello's ``bus`` says async: actors never wait for a new version (the stub
publishes only version 0)."""
RECV_TIMEOUT_MS = 50
REPORT_CHECK_EVERY = 256
"""Trajectories between two looks at the parent's pipe while data flows."""


def broker_fds(actors: int) -> int:
    """Descriptors a broker needs for ``actors``: one TCP connection per actor socket (control, SUB, PUSH)."""
    return actors * SOCKETS_PER_ACTOR + FD_MARGIN


def broker_main(ports: list[int], actors: int) -> None:
    """A real broker (``Broker`` through its Python API, as `zddrl bench bus` runs it) with room for ``actors``."""
    raise_nofile(broker_fds(actors), f"the broker with {actors} actors")
    C.broker_main(ports)


def proxy_main(front_port: int, back_port: int, actors: int) -> None:
    """The reference forwarder (`zddrl bench bus`'s zmq.proxy) with room for ``actors`` connections."""
    raise_nofile(broker_fds(actors), f"the zmq.proxy forwarder with {actors} actors")
    C.proxy_main(front_port, back_port)


def version_zero(run_id: str) -> P.Parameters:
    flat = np.zeros(16, np.float32)
    return P.Parameters(
        run_id=run_id,
        peer_id=LEARNER_ID,
        policy_version=0,
        param_hash=P.param_hash(flat),
        layout=[["w", "float32", [int(flat.size)], 0]],
        arrays={"flat": flat},
        meta={"rollout_len": 32},
    )


def learner_main(control: str, run_id: str, conn: Any) -> None:
    """Join, announce the run, publish version 0, then receive and time trajectories until the process ends.

    ``conn`` (a Pipe end): on "report" it sends back what was received so far (``received``, ``peers``,
    ``t_recv`` and ``latency_s`` arrays)."""
    C.setup_worker("bench-fleet-learner")
    from zddrl.transport.channel import DataChannel
    from zddrl.transport.link import BrokerLink, hello_fields

    bus = {"sync": False, "max_staleness": BusConfig.max_staleness, "max_in_flight": MAX_IN_FLIGHT}
    hello = P.Hello(role="learner", peer_id=LEARNER_ID, run_id=run_id, run=RUN_SPEC, bus=bus, **hello_fields())
    link = BrokerLink(control, hello).start()
    if link.wait_welcome(30, need_run=True) is None:
        raise RuntimeError(f"no welcome with a run from the broker at {control}")
    assert link.welcome is not None
    channel = DataChannel(link, LEARNER_ID, link.welcome.max_message_bytes)
    channel.send(version_zero(run_id))

    def receive() -> P.Message | None:
        msg = channel.recv(RECV_TIMEOUT_MS)
        if isinstance(msg, P.Trajectory):
            channel.ack()
        return msg

    try:
        _time_trajectories(receive, conn)
    finally:
        link.close()


def proxy_learner_main(endpoint: str, conn: Any) -> None:
    """The receiving end of the zmq.proxy path: a PULL connected to the forwarder's backend, the same timing."""
    ctx = C.setup_worker("bench-fleet-proxy-learner")
    sock = C.socket_of(ctx, zmq.PULL, RCVHWM=C.HWM)
    sock.connect(endpoint)

    def receive() -> P.Message | None:
        if not sock.poll(RECV_TIMEOUT_MS):
            return None
        return P.decode(sock.recv_multipart(copy=False))

    _time_trajectories(receive, conn)


def _time_trajectories(receive: Callable[[], P.Message | None], conn: Any) -> None:
    """Note each trajectory's receipt time and latency; answer the parent's "report" on ``conn``."""
    t_recv: list[float] = []
    latency: list[float] = []
    peers: set[str] = set()
    while True:
        msg = receive()
        if isinstance(msg, P.Trajectory):
            now = time.monotonic()
            t_recv.append(now)
            latency.append(now - float(msg.info["t_send"]))
            peers.add(msg.peer_id)
            if len(t_recv) % REPORT_CHECK_EVERY:
                continue
        if conn.poll() and conn.recv() == "report":
            conn.send(
                {
                    "received": len(t_recv),
                    "peers": len(peers),
                    "t_recv": np.array(t_recv),
                    "latency_s": np.array(latency),
                }
            )
