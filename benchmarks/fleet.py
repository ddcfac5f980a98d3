"""`python -m benchmarks fleet`: one real broker under a fleet of simulated actors, from one actor to a thousand.

For each fleet size N, on a fresh broker process: a learner stub (benchmarks.fleet_stub) joins and publishes
version 0, then N simulated actors (benchmarks.fleet_sim: each its own identity, control DEALER, params SUB and
trajectories PUSH; ACTORS_PER_WORKER of them per worker process, each worker reporting its own ``host``) join.
Two windows follow:

* **control plane only**: every actor joined, heartbeating and sending stats once a second as `zddrl actor` does
  (``--no-stats``: heartbeats alone), no data. The broker's CPU share here is what the fleet's membership costs
  it (heartbeats both ways, stats and their health checks, liveness, fleet bookkeeping); divided by N, what one
  actor costs. Goal: 1,024 actors under 10 % of one core, the per-actor cost flat in N.
* **data**: the actors send CartPole rollouts at ``--rate`` trajectories/s over the whole fleet (round robin
  within each worker among actors with credit; ``--rate 0``: as fast as the credit allows), each following the
  broker's actor-side credit (at most ``max_in_flight`` = 2 uncredited). Throughput and send -> learner receipt
  latency are read at the stub; the broker's CPU share and per-trajectory cost over the same window.

Then the actors stop, everything sent is drained, and the accounting is checked: every trajectory sent was
received by the broker, ``received == forwarded + dropped + in_flight``, and every forwarded one reached the stub.
With ``--proxy`` (the default) the largest fleet's data window runs once more through a `zmq.proxy` forwarder
instead of the broker (no control plane, no credit), at the same offered load: the forwarders' CPU per trajectory
side by side.

CPU shares are of one core, summed over a process's threads (libzmq's I/O thread too, also shown on its own)
from /proc/PID/task/*/schedstat.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import click
import numpy as np
from loguru import logger

from benchmarks.fleet_report import format_report, proxy_comparison, scaling
from benchmarks.fleet_sim import SLOTS, T_STEPS, S, worker_fds, worker_main
from benchmarks.fleet_stub import MAX_IN_FLIGHT, broker_fds, broker_main, learner_main, proxy_learner_main, proxy_main
from zddrl.bench import common as C
from zddrl.proc import free_ports
from zddrl.transport.status import request_status

DEFAULT_ACTORS = "1,4,16,64,256,1024"
ACTORS_PER_WORKER = 256
"""Actors per worker process (and per ``host`` in their hellos: the broker takes 1,024 per host)."""
DEFAULT_RATE = 1000.0
"""Trajectories/s offered by the whole fleet in the data window: the same load at every N, so that what changes
with N is the fleet's size, not the work (on 2 cores the sims, broker and stub share the machine)."""
SETTLE_S, SETTLE_PER_ACTOR_S, SETTLE_MAX_S = 0.25, 0.001, 1.5
"""After the last actor holds version 0, until the join burst (welcomes, snapshots, fleet messages) is over."""
WARMUP_S = 0.5
"""After sending starts, before the data window: queues fill to their steady state."""
JOIN_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 20.0
STATUS_COUNTERS = (
    "hello_limited",
    "hello_over_cap",
    "control_malformed",
    "control_unroutable",
    "expired_or_left",
    "params_snapshots",
    "fleet_sent",
    "heartbeat_interval_s",
)
"""Broker counters reported per N (zero or near it in a healthy run), and the heartbeat interval it chose."""


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of a process in MiB (VmRSS); None if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError):
        pass
    return None


def check_nofile(actors: int, per_worker: int) -> None:
    """Fail early, with what to do, if the hard RLIMIT_NOFILE cannot hold the broker's or a worker's sockets."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return
    for who, needed in (
        (f"the broker with {actors} actors (3 sockets each)", broker_fds(actors)),
        (f"a worker process with {min(actors, per_worker)} actors", worker_fds(min(actors, per_worker))),
    ):
        if needed > hard:
            raise click.ClickException(
                f"{who} needs about {needed} file descriptors, but RLIMIT_NOFILE's hard limit is {hard}: raise it "
                "(ulimit -Hn as root, limits.conf) or pass fewer --actors"
            )


@dataclass
class Sample:
    """The fleet at one instant: CPU seconds of each process group and the workers' summed counters."""

    t: float
    broker_cpu: float
    broker_zmq_cpu: float
    """Of which libzmq's I/O and reaper threads."""
    sims_cpu: float
    learner_cpu: float
    counts: np.ndarray

    def count(self, name: str) -> float:
        return float(self.counts[S[name]])


def _cpu(pid: int | None) -> float:
    return sum(thread_cpu(pid))


def thread_cpu(pid: int | None) -> tuple[float, float]:
    """(its own threads, libzmq's background threads) CPU seconds of a process, from each thread's schedstat
    (nanoseconds: /proc/PID/stat counts 10 ms ticks, too coarse for a broker at 1 % over a few seconds). Falls
    back to /proc/PID/stat, all in the first figure."""
    own = zmq_threads = 0.0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            if name.startswith("ZMQbg"):
                zmq_threads += ns / 1e9
            else:
                own += ns / 1e9
    except (OSError, ValueError, IndexError):
        return C.cpu_seconds(pid) or 0.0, 0.0
    return own, zmq_threads


class FleetRig:
    """The broker, the learner stub and the simulated actors' workers of one fleet size."""

    def __init__(
        self, workers: C.Workers, actors: int, per_worker: int, rate: float, proxy: bool = False, stats: bool = True
    ) -> None:
        self.workers, self.actors, self.rate, self.proxy, self.stats = workers, actors, rate, proxy, stats
        self.sizes = [min(per_worker, actors - first) for first in range(0, actors, per_worker)]
        self.run_id = f"bench-fleet-{uuid.uuid4().hex[:8]}"
        self.mode = C.shared_mode()
        self.counts = [C.SPAWN.RawArray("d", len(SLOTS)) for _ in self.sizes]
        self.sim_pids: list[int] = []
        self.join_s = 0.0
        self.join_broker_cpu_s = 0.0

    def start(self) -> None:
        """The forwarder (the broker, or zmq.proxy with ``proxy``) and the stub, then the actors; returns once every
        actor holds version 0 and the join burst has settled."""
        ports = free_ports(4)
        self.control = endpoint = f"tcp://127.0.0.1:{ports[0]}"
        self.conn, child = C.SPAWN.Pipe()
        if self.proxy:  # the stub takes what the forwarder's backend pushes
            self.broker_pid = self.workers.start("fleet-proxy", proxy_main, ports[0], ports[1], self.actors).pid
            back = f"tcp://127.0.0.1:{ports[1]}"
            self.learner_pid = self.workers.start("fleet-proxy-learner", proxy_learner_main, back, child).pid
        else:
            self.broker_pid = self.workers.start("fleet-broker", broker_main, ports, self.actors).pid
            self.learner_pid = self.workers.start("fleet-learner", learner_main, endpoint, self.run_id, child).pid
            self.workers.wait(self._broker_ready, 60, "the broker and its learner (credit, version 0)")
        t0, cpu0 = time.monotonic(), _cpu(self.broker_pid)
        first = 0
        for w, (size, counts) in enumerate(zip(self.sizes, self.counts)):
            rate = self.rate * size / self.actors
            args = (endpoint, w, first, size, counts, self.mode, rate, self.proxy, self.stats)
            self.sim_pids.append(self.workers.start(f"fleet-sim-{w}", worker_main, *args).pid)
            first += size
        timeout = JOIN_TIMEOUT_S + self.actors * 0.02
        self.workers.wait(lambda: self.sample().count("ready") >= self.actors, timeout, f"{self.actors} actors")
        self.join_s = time.monotonic() - t0
        self.join_broker_cpu_s = _cpu(self.broker_pid) - cpu0
        time.sleep(min(SETTLE_MAX_S, SETTLE_S + SETTLE_PER_ACTOR_S * self.actors))

    def _broker_ready(self) -> bool:
        body = request_status(self.control, 1.0)
        if body is None:
            return False
        learner = body["members"].get("fleet-learner", {})
        return bool(body["broker"]["policy_version"] == 0 and learner.get("credit", 0) > 0)

    def sample(self) -> Sample:
        counts = np.sum([np.frombuffer(c, dtype=np.float64) for c in self.counts], axis=0)
        own, zmq_threads = thread_cpu(self.broker_pid)
        return Sample(
            time.monotonic(),
            own + zmq_threads,
            zmq_threads,
            sum(_cpu(pid) for pid in self.sim_pids),
            _cpu(self.learner_pid),
            counts,
        )

    def window(self, seconds: float) -> tuple[Sample, Sample]:
        self.workers.check()
        a = self.sample()
        time.sleep(seconds)
        b = self.sample()
        self.workers.check()
        return a, b

    def drain(self) -> bool:
        """Stop sending; True once every trajectory sent was credited back (read by the broker) and reached the
        stub."""
        self.mode.value = 0
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            s = self.sample()
            credited = self.proxy or s.count("sent") == s.count("credited")  # no credit on the proxy path
            if credited and self.stub_report()["received"] == s.count("sent"):
                return True
            time.sleep(0.1)
        return False

    def stub_report(self) -> dict[str, Any]:
        self.conn.send("report")
        if not self.conn.poll(10):
            raise TimeoutError("the learner stub did not report within 10 s")
        report: dict[str, Any] = self.conn.recv()
        return report


def _rates(a: Sample, b: Sample, actors: int) -> dict[str, Any]:
    """What the fleet cost over the window from ``a`` to ``b``: CPU shares of one core, control messages/s."""
    dt = b.t - a.t

    def per_s(*names: str) -> float:
        return round(sum(b.count(n) - a.count(n) for n in names) / dt, 1)

    broker = (b.broker_cpu - a.broker_cpu) / dt
    to_broker = per_s("hello_out", "heartbeat_out", "stats_out")
    from_broker = per_s("heartbeat_in", "credit_in", "welcome_in", "params_in", "reject_in")
    return {
        "window_s": round(dt, 3),
        "broker_cpu_share": round(broker, 4),
        "broker_zmq_cpu_share": round((b.broker_zmq_cpu - a.broker_zmq_cpu) / dt, 4),
        "broker_cpu_us_per_actor_s": round(broker / actors * 1e6, 1),
        "sims_cpu_share": round((b.sims_cpu - a.sims_cpu) / dt, 3),
        "learner_cpu_share": round((b.learner_cpu - a.learner_cpu) / dt, 3),
        "control_msgs_per_s": round(to_broker + from_broker, 1),
        "control_to_broker_per_s": to_broker,
        "control_from_broker_per_s": from_broker,
        "heartbeats_per_s": per_s("heartbeat_out", "heartbeat_in"),
        "hellos_per_s": per_s("hello_out"),
        "stats_per_s": per_s("stats_out"),
        "credits_per_s": per_s("credit_in"),
        "reconnects": int(b.count("reconnects") - a.count("reconnects")),
        "rejects": int(b.count("reject_in") - a.count("reject_in")),
    }


def _data_figures(a: Sample, b: Sample, actors: int, stub: dict[str, Any]) -> dict[str, Any]:
    rates = _rates(a, b, actors)
    t, lat = stub["t_recv"], stub["latency_s"]
    inside = (t >= a.t) & (t <= b.t)
    received = int(inside.sum())
    dt = b.t - a.t
    lat_ms = lat[inside] * 1e3 if received else np.zeros(1)
    broker_cpu = rates["broker_cpu_share"] * dt
    return {
        **rates,
        "sent_per_s": round((b.count("sent") - a.count("sent")) / dt, 1),
        "trajectories_per_s": round(received / dt, 1),
        "env_steps_per_s": round(received * T_STEPS * 4 / dt, 1),
        "latency_ms": {q: round(float(np.percentile(lat_ms, p)), 3) for q, p in (("p50", 50), ("p99", 99))}
        | {"max": round(float(lat_ms.max()), 3)},
        "broker_cpu_us_per_traj": round(broker_cpu / received * 1e6, 1) if received else None,
        "send_again": int(b.count("send_again") - a.count("send_again")),
    }


def _accounting(rig: FleetRig, drained: bool, stub: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    body = request_status(rig.control, 5.0)
    if body is None:
        raise RuntimeError("the broker did not answer the final status request")
    br = body["broker"]
    sent = int(rig.sample().count("sent"))
    dropped = sum(br["dropped"].values())
    accounting = {
        "sent": sent,
        "received": br["received"],
        "forwarded": br["forwarded"],
        "dropped": {k: v for k, v in br["dropped"].items() if v},
        "in_flight": br["in_flight"],
        "accounted": br["accounted"] and br["received"] == br["forwarded"] + dropped + br["in_flight"],
        "stub_received": stub["received"],
        "stub_actors": stub["peers"],
        "drained": drained,
        "all_delivered": drained and sent == br["received"] == br["forwarded"] == stub["received"],
    }
    counters = {k: br.get(k) for k in STATUS_COUNTERS} | {"actors_joined": br["members_by_role"]["actor"]}
    return accounting, counters


def run_point(actors: int, seconds: float, rate: float, per_worker: int, stats: bool = True) -> dict[str, Any]:
    """One fleet size on fresh processes: join, control-only window, data window, drain, accounting."""
    with C.Workers() as workers:
        rig = FleetRig(workers, actors, per_worker, rate, stats=stats)
        rig.start()
        control = _rates(*rig.window(seconds), actors)
        rss_idle = rss_mb(rig.broker_pid)
        rig.mode.value = 1
        time.sleep(WARMUP_S)
        a, b = rig.window(seconds)
        rss_data = rss_mb(rig.broker_pid)
        drained = rig.drain()
        stub = rig.stub_report()
        data = _data_figures(a, b, actors, stub)
        accounting, counters = _accounting(rig, drained, stub)
    if data["trajectories_per_s"]:  # what a trajectory costs on top of the fleet's heartbeats
        extra = data["broker_cpu_share"] - control["broker_cpu_share"]
        data["broker_cpu_us_per_traj_above_control"] = round(extra / data["trajectories_per_s"] * 1e6, 1)
    row = {
        "actors": actors,
        "workers": len(rig.sizes),
        "join_s": round(rig.join_s, 3),
        "join_broker_cpu_ms_per_actor": round(rig.join_broker_cpu_s / actors * 1e3, 3),
        "broker_rss_mb": {"control": rss_idle, "data": rss_data},
        "control_only": control,
        "data": data,
        "accounting": accounting,
        "broker_counters": counters,
    }
    logger.info(
        f"{actors:5d} actors: control-only broker {control['broker_cpu_share']:.1%} of a core; data "
        f"{data['trajectories_per_s']:.0f} traj/s p50 {data['latency_ms']['p50']:.2f} ms p99 "
        f"{data['latency_ms']['p99']:.2f} ms, broker {data['broker_cpu_share']:.1%}; accounted "
        f"{accounting['accounted']}, all delivered {accounting['all_delivered']}"
    )
    return row


def run_proxy_point(actors: int, seconds: float, per_worker: int, rate: float) -> dict[str, Any]:
    """The same actors pushing at ``rate`` through `zmq.proxy` (no control plane, no credit)."""
    with C.Workers() as workers:
        rig = FleetRig(workers, actors, per_worker, rate, proxy=True)
        rig.start()
        rig.mode.value = 1
        time.sleep(WARMUP_S)
        a, b = rig.window(seconds)
        rss = rss_mb(rig.broker_pid)
        drained = rig.drain()
        stub = rig.stub_report()
    data = _data_figures(a, b, actors, stub)
    sent = int(b.count("sent")) if not drained else int(rig.sample().count("sent"))
    return {
        "actors": actors,
        "trajectories_per_s": data["trajectories_per_s"],
        "latency_ms": data["latency_ms"],
        "forwarder_cpu_share": data["broker_cpu_share"],
        "forwarder_cpu_us_per_traj": data["broker_cpu_us_per_traj"],
        "sims_cpu_share": data["sims_cpu_share"],
        "learner_cpu_share": data["learner_cpu_share"],
        "forwarder_rss_mb": rss,
        "all_delivered": drained and sent == stub["received"],
    }


def run_bench(
    actor_counts: list[int], seconds: float, rate: float, per_worker: int, proxy: bool = True, stats: bool = True
) -> dict[str, Any]:
    check_nofile(max(actor_counts), per_worker)
    t0, load = time.monotonic(), [round(x, 2) for x in os.getloadavg()]  # before any worker runs
    points = [run_point(n, seconds, rate, per_worker, stats) for n in actor_counts]
    comparison = None
    if proxy:  # the largest fleet again, through zmq.proxy at the same offered load
        largest = max(points, key=lambda p: p["actors"])
        comparison = proxy_comparison(largest, run_proxy_point(largest["actors"], seconds, per_worker, rate))
    return {
        "bench": "fleet",
        "settings": {
            "actors": actor_counts,
            "seconds": seconds,
            "rate": rate,
            "actors_per_worker": per_worker,
            "max_in_flight": MAX_IN_FLIGHT,
            "stats": stats,
            "rollout": "CartPole, 32 steps x 4 envs",
            "cpus": os.cpu_count(),
            "load_avg_at_start": load,
        },
        "points": points,
        "scaling": scaling(points),
        "proxy_comparison": comparison,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _actor_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if not items or any(not 1 <= v <= 10_000 for v in items):
        raise click.BadParameter("actor counts must be in 1..10000 (the broker's cap)")
    return items


@click.command("fleet")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--actors", "actor_counts", default=DEFAULT_ACTORS, show_default=True, callback=_actor_list, help="Fleet sizes."
)
@click.option(
    "--seconds",
    type=click.FloatRange(0.2, 120),
    default=4.0,
    show_default=True,
    help="Each measurement window (control-only, then data) per fleet size.",
)
@click.option(
    "--rate",
    type=click.FloatRange(0, 1e6),
    default=DEFAULT_RATE,
    show_default=True,
    help="Trajectories/s the whole fleet offers in the data window; 0: as fast as the credit allows.",
)
@click.option(
    "--actors-per-worker",
    "per_worker",
    type=click.IntRange(1, 1024),
    default=ACTORS_PER_WORKER,
    show_default=True,
    help="Simulated actors per worker process (each worker is one host to the broker: at most 1,024).",
)
@click.option(
    "--proxy/--no-proxy",
    default=True,
    show_default=True,
    help="Also the largest fleet's data window through zmq.proxy (no control plane, no credit) at the same --rate.",
)
@click.option(
    "--stats/--no-stats",
    default=True,
    show_default=True,
    help="Actors send a stats message with every heartbeat, as `zddrl actor` does once a second.",
)
def fleet(
    as_json: bool, actor_counts: list[int], seconds: float, rate: float, per_worker: int, proxy: bool, stats: bool
) -> None:
    """One broker under 1 to 1,024 simulated actors: control-plane cost, throughput, latency, memory."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    report = run_bench(actor_counts, seconds, rate, per_worker, proxy, stats)
    click.echo(json.dumps(report) if as_json else format_report(report))
