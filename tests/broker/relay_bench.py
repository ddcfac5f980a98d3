"""Trajectory throughput through a relay vs straight to the root: ``python tests/broker/relay_bench.py``.

`zddrl bench bus`'s workers (zddrl/bench/common.py: a sender that joins as an actor and pushes as fast as its
HWM lets it, a receiver that is a learner shard's DataChannel with its credit policy) on real processes:

    direct   sender -> root broker -> receiver
    relay    sender -> relay (zddrl.broker.relay.Relay) -> root broker -> receiver

Both paths run side by side on their own processes; only one sender is on at a time, in short windows whose order
alternates, so machine noise hits both alike; the figure is the median of the per-window-pair relay/direct ratios of
messages/s, and each broker's CPU time per message (which hardly moves when other work loads the machine).
Not collected by pytest (a measurement, not a test); docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from zddrl.bench import common as C
from zddrl.ops.status import request_status
from zddrl.proc import free_ports

WARMUP_S = 0.3
DRAIN_S = 0.3


def relay_main(ports: list[int], upstream: str) -> None:
    """A relay under ``upstream`` on the given control/trajectory/learner/params ports."""
    C._setup("bench-relay")
    from zddrl.broker.relay import Relay
    from zddrl.config import BrokerConfig

    control, traj, learners, params = ports
    config = BrokerConfig(
        bind=f"tcp://127.0.0.1:{control}",
        trajectory_port=traj,
        learner_port=learners,
        params_port=params,
        upstream=upstream,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    relay = Relay(config)
    try:
        relay.bind()
        relay.run(stop)
    finally:
        relay.close()


def ep(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


@dataclass
class Lane:
    """One path's processes: its brokers' control endpoints and pids, the sender's switch, the receiver's count."""

    path: str
    controls: dict[str, str]
    pids: dict[str, int]
    mode: Any
    counters: Any


def start_lane(workers: C.Workers, path: str, payload: int) -> Lane:
    run_id = f"bench-relay-{uuid.uuid4().hex[:6]}"
    root, relay = free_ports(4), free_ports(4)
    lane = Lane(path, {"root": ep(root[0])}, {}, C.shared_mode(), C.Counters())
    lane.pids["root"] = workers.start(f"{path}-root", C.broker_main, root).pid
    workers.start(f"{path}-receiver", C.receiver_main, "broker", ep(root[2]), ep(root[0]), run_id, lane.counters)
    entry = root
    if path == "relay":
        lane.pids["relay"] = workers.start("relay", relay_main, relay, ep(root[0])).pid
        lane.controls["relay"] = entry_control = ep(relay[0])
        entry = relay
    workers.wait(lambda: _version(ep(root[0])) == 0, 60, f"{path}: the root's learner and version 0")
    if path == "relay":
        workers.wait(lambda: _version(entry_control) == 0, 60, "version 0 at the relay")
    workers.start(f"{path}-sender", C.sender_main, ep(entry[1]), ep(entry[0]), run_id, [payload], lane.mode)
    return lane


def measure(workers: C.Workers, lane: Lane, seconds: float) -> dict[str, Any]:
    """msgs/s over ``seconds`` with only this lane's sender on, and each broker's CPU microseconds per message."""
    start = lane.counters.read()[0]
    lane.mode.value = 1
    try:
        workers.wait(lambda: lane.counters.read()[0] >= start + 2, 60, f"the first {lane.path} messages")
        time.sleep(WARMUP_S)
        n0, _, t0 = lane.counters.read()
        cpu0 = {k: C.cpu_seconds(pid) for k, pid in lane.pids.items()}
        time.sleep(seconds)
        n1, _, t1 = lane.counters.read()
        cpu1 = {k: C.cpu_seconds(pid) for k, pid in lane.pids.items()}
    finally:
        lane.mode.value = 0
    time.sleep(DRAIN_S)  # what the sender left queued arrives before the other lane's window
    n = max(n1 - n0, 1)
    cpu = {f"{k}_cpu_us": round((cpu1[k] - cpu0[k]) / n * 1e6, 1) for k in lane.pids if cpu0[k] is not None}
    return {"msgs_per_s": (n1 - n0) / max(t1 - t0, 1e-9), **cpu}


def _version(control: str) -> int:
    body = request_status(control, 1.0)
    return -1 if body is None else body["broker"]["policy_version"]


def _accounting(control: str) -> dict:
    body = request_status(control, 2.0)
    b = body["broker"] if body is not None else {}
    return {k: b.get(k) for k in ("received", "forwarded", "accounted", "accounted_subtree")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payload", type=int, default=65536, help="trajectory payload bytes")
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per measuring window")
    parser.add_argument("--windows", type=int, default=6, help="windows per path, alternating between the paths")
    args = parser.parse_args()
    with C.Workers() as workers:
        lanes = [start_lane(workers, path, args.payload) for path in ("direct", "relay")]
        ratios, rows = [], []
        for w in range(args.windows):
            order = lanes if w % 2 == 0 else lanes[::-1]
            got = {lane.path: measure(workers, lane, args.seconds) for lane in order}
            ratios.append(got["relay"]["msgs_per_s"] / got["direct"]["msgs_per_s"])
            rows.append({"window": w, **got, "ratio": round(ratios[-1], 3)})
            print(json.dumps(rows[-1]))
        accounting = {f"{lane.path}/{k}": _accounting(c) for lane in lanes for k, c in lane.controls.items()}
    print(json.dumps({"accounting": accounting}))
    median = {f"{p}/{k}": statistics.median(r[p][k] for r in rows) for p, k in _CPU_KEYS}
    print(
        json.dumps(
            {
                "payload": args.payload,
                "relay_over_direct_median": round(statistics.median(ratios), 3),
                "ratios": [round(r, 3) for r in ratios],
                "cpu_us_per_msg_median": median,
            }
        )
    )


_CPU_KEYS = (("direct", "root_cpu_us"), ("relay", "root_cpu_us"), ("relay", "relay_cpu_us"))


if __name__ == "__main__":
    main()
