"""`python -m benchmarks relay`: trajectory throughput through a relay vs straight to the root.

`zddrl bench bus`'s workers (zddrl/bench/common.py: a sender that joins as an actor and pushes as fast as its
HWM lets it, a receiver that is a learner shard's DataChannel with its credit policy) on real processes:

    direct   sender -> root broker -> receiver
    relay    sender -> relay (zddrl.broker.Broker with an upstream) -> root broker -> receiver

Both paths run side by side on their own processes; only one sender is on at a time, in short windows whose order
alternates, so machine noise hits both alike; the figure is the median of the per-window-pair relay/direct ratios of
messages/s, and each broker's CPU time per message (which hardly moves when other work loads the machine).
docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import json
import signal
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import click

from zddrl.bench import common as C
from zddrl.proc import free_ports
from zddrl.transport.status import request_status

WARMUP_S = 0.3
DRAIN_S = 0.3


def relay_main(ports: list[int], upstream: str) -> None:
    """A relay under ``upstream`` on the given control/trajectory/learner/params ports."""
    C.setup_worker("bench-relay")
    from zddrl.broker.broker import Broker
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
    relay = Broker(config)
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
    cpu = {
        f"{k}_cpu_us": round((after - before) / n * 1e6, 1)
        for k in lane.pids
        if (before := cpu0[k]) is not None and (after := cpu1[k]) is not None
    }
    return {"msgs_per_s": (n1 - n0) / max(t1 - t0, 1e-9), **cpu}


def _version(control: str) -> int:
    body = request_status(control, 1.0)
    return -1 if body is None else body["broker"]["policy_version"]


def _accounting(control: str) -> dict:
    body = request_status(control, 2.0)
    b = body["broker"] if body is not None else {}
    return {k: b.get(k) for k in ("received", "forwarded", "accounted", "accounted_subtree")}


@click.command("relay")
@click.option(
    "--payload", type=click.IntRange(1024), default=65536, show_default=True, help="Trajectory payload bytes."
)
@click.option("--seconds", type=click.FloatRange(0.05), default=1.0, show_default=True, help="Seconds per window.")
@click.option("--windows", type=click.IntRange(1), default=6, show_default=True, help="Windows per path, alternating.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def relay(payload: int, seconds: float, windows: int, as_json: bool) -> None:
    """Messages/s through a relay over straight to the root, side by side, and each broker's CPU per message."""
    with C.Workers() as workers:
        lanes = [start_lane(workers, path, payload) for path in ("direct", "relay")]
        ratios, rows = [], []
        for w in range(windows):
            order = lanes if w % 2 == 0 else lanes[::-1]
            got = {lane.path: measure(workers, lane, seconds) for lane in order}
            ratios.append(got["relay"]["msgs_per_s"] / got["direct"]["msgs_per_s"])
            rows.append({"window": w, **got, "ratio": round(ratios[-1], 3)})
        accounting = {f"{lane.path}/{k}": _accounting(c) for lane in lanes for k, c in lane.controls.items()}
    report = {
        "payload": payload,
        "relay_over_direct_median": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        "cpu_us_per_msg_median": {f"{p}/{k}": statistics.median(r[p][k] for r in rows) for p, k in _CPU_KEYS},
        "windows": rows,
        "accounting": accounting,
    }
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo(f"relay / direct, messages/s at {payload} B: median {report['relay_over_direct_median']}x")
    click.echo(f"  per window: {report['ratios']}")
    for key, value in report["cpu_us_per_msg_median"].items():
        click.echo(f"  {key}: {value:.0f} us of CPU per message")
    click.echo(f"  accounted: {all(a.get('accounted') for a in accounting.values())}")


_CPU_KEYS = (("direct", "root_cpu_us"), ("relay", "root_cpu_us"), ("relay", "relay_cpu_us"))
