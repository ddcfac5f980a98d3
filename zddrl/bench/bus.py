"""`zddrl bench bus`: what the bus costs, next to what ZeroMQ alone does on the same machine.

Three measurements, each against a reference measured in the same run:

* trajectory throughput actor -> forwarder -> learner for several payload sizes, through the
  zddrl broker, a plain ``zmq.proxy`` forwarder and a direct PUSH->PULL pair. Each round of each
  payload runs on fresh processes; paths alternate within a round (their order rotates), so machine
  noise hits all of them alike; medians are reported and the broker/proxy ratio is the median of
  per-round ratios;
* with ``--ipc``, another path: the same broker on the local bus (ipc sockets in an owner-only directory, what
  `zddrl train` uses), in the same rounds, so what ipc costs or saves against loopback TCP is a ratio measured side
  by side (local/broker);
* with ``--secure``, a fourth path: the same broker on a closed bus (CURVE on every hop, keys checked by ZAP),
  in the same rounds, so the cost of encryption is a ratio measured side by side (secure/broker);
* latency of a parameter broadcast (learner -> broker -> N subscribers holding the verified
  version), on the open bus and with ``--secure`` on the closed one (signed versions), and what a signature
  costs alone (zddrl.bench.broadcast);
* encode + decode of a trajectory (1 MiB, the target, and 8 MiB): zddrl raw frames vs pickle vs
  msgpack-numpy, in this process before any worker starts (zddrl.bench.codec).

Senders, receivers and the broker use the real zddrl code (protocol.encode/decode, BrokerLink,
Broker, and on the broker path the learner's DataChannel with its credit policy).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

import click
from loguru import logger

from zddrl.bench import common as C
from zddrl.bench.broadcast import run_broadcast, run_signing
from zddrl.bench.bus_report import RATIO_FROM_BYTES, RATIO_TARGET, format_report, size_label, targets
from zddrl.bench.codec import CODEC_SIZES, run_codec
from zddrl.config import ipc_endpoint, private_bus_dir
from zddrl.ops.train import throwaway_keys
from zddrl.proc import free_ports
from zddrl.transport.channel import WINDOW_BYTES
from zddrl.transport.status import request_status

PATHS = ("direct", "proxy", "broker")
SECURE = "secure"
"""The broker path on a closed bus (``--secure``)."""
DIRECT_CURVE = "direct-curve"
"""With ``--secure``: the direct PUSH -> PULL pair with CURVE, what encryption costs ZeroMQ alone on one hop."""
LOCAL = "local"
"""With ``--ipc``: the broker path on the local bus (ipc sockets in an owner-only directory)."""
DEFAULT_PAYLOADS = f"4096,65536,1048576,8388608,{C.PIXEL_ROLLOUT_BYTES}"
"""The last: an Atari rollout (128 x 8 envs of 4x84x84 uint8 frames, 29 MB; common.pixel_rollout_arrays)."""
FIRST_MSG_TIMEOUT_S = 20.0
DRAIN_QUIET_S = 0.15
"""A lane counts as drained once its receiver saw nothing new for this long."""
MIN_WINDOW_MSGS = 3
CARTPOLE_PARAM_BYTES = 4 * 9_155
"""Parameter bytes of examples/cartpole_ppo.toml's actor-critic (4 -> 64 -> 64 -> 2 and -> 1): the smallest
signature the bench times."""
WARMUP_S = 0.2
"""After a rig's untimed first pass (run_throughput) its connections are warm: a short warm-up per measurement does."""


def _ep(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


# --------------------------------------------------------------------------------------------
# Trajectory throughput
# --------------------------------------------------------------------------------------------


@dataclass
class Lane:
    path: str
    mode: Any
    counters: C.Counters
    forwarder_pid: int | None = None


class ThroughputRig:
    """Sender, forwarder and receiver of every path, started together and driven through shared memory.

    Idle lanes cost nothing (their workers block or sleep), so all three stay up and measurements can
    alternate between paths without process start-up in between.
    """

    def __init__(
        self,
        workers: C.Workers,
        payloads: list[int],
        broker_spec: str,
        window: int = C.CREDIT_WINDOW,
        keys_dir: str | None = None,
        bus_dir: str | None = None,
    ) -> None:
        self.workers = workers
        self.keys_dir = keys_dir
        self.bus_dir = bus_dir
        """A local bus's directory: the ``local`` path runs next to the others."""
        """A closed bus's keys: the ``secure`` path runs next to the others."""
        self.window = window
        self.payloads = payloads
        self.broker_spec = broker_spec
        self.run_id = f"bench-bus-{uuid.uuid4().hex[:8]}"
        self.lanes: dict[str, Lane] = {}
        self.controls: dict[str, str] = {}
        """Control endpoint of each broker path."""

    @property
    def paths(self) -> tuple[str, ...]:
        return paths_of(self.keys_dir, self.bus_dir)

    def start(self) -> None:
        ports = free_ports(12)  # one call, so no two sockets are offered the same port
        self._start_lane("direct", _ep(ports[0]), _ep(ports[0]), None)
        if self.keys_dir:
            self._start_lane(DIRECT_CURVE, _ep(ports[11]), _ep(ports[11]), None, self.keys_dir)
        proxy = self.workers.start("proxy", C.proxy_main, ports[1], ports[2])
        self._start_lane("proxy", _ep(ports[1]), _ep(ports[2]), None).forwarder_pid = proxy.pid
        self._start_broker("broker", ports[3:7], None)
        if self.keys_dir:
            self._start_broker(SECURE, ports[7:11], self.keys_dir)
        if self.bus_dir:
            self._start_broker(LOCAL, [], None, self.bus_dir)
        for path in self.controls:
            self.workers.wait(
                partial(self._broker_ready, path), 60, f"the {path} broker, its learner (credit, version 0), its actor"
            )

    def _start_broker(self, path: str, ports: list[int], keys_dir: str | None, bus_dir: str | None = None) -> None:
        """A broker path: on ``ports`` (control, trajectories, learners, params), or on the local bus in ``bus_dir``."""
        bind = ipc_endpoint(bus_dir) if bus_dir else ""
        broker = self.workers.start(f"{path}-broker", C.broker_main, ports, self.broker_spec, keys_dir, bind)
        self.controls[path] = bind or _ep(ports[0])
        send_to, receive_at = (
            (ipc_endpoint(bus_dir, n) for n in ("trajectories", "learners")) if bus_dir else map(_ep, ports[1:3])
        )
        lane = self._start_lane(path, send_to, receive_at, self.controls[path], keys_dir)
        lane.forwarder_pid = broker.pid

    def _start_lane(
        self, path: str, send_to: str, receive_at: str, control: str | None, keys_dir: str | None = None
    ) -> Lane:
        lane = Lane(path, C.shared_mode(), C.Counters())
        self.workers.start(
            f"{path}-receiver",
            C.receiver_main,
            path,
            receive_at,
            control,
            self.run_id,
            lane.counters,
            self.window,
            keys_dir,
        )
        self.workers.start(
            f"{path}-sender", C.sender_main, send_to, control, self.run_id, self.payloads, lane.mode, keys_dir
        )
        self.lanes[path] = lane
        return lane

    def _status(self, path: str, timeout_s: float) -> dict[str, Any] | None:
        creds = C.client_credentials(self.keys_dir, "monitor") if path == SECURE else None
        return request_status(self.controls[path], timeout_s, credentials=creds)

    def _broker_ready(self, path: str) -> bool:
        body = self._status(path, 1.0)
        if body is None:
            return False
        members = body["members"]
        return (
            body["broker"]["policy_version"] == 0
            and C.SENDER_ID in members
            and members.get(C.LEARNER_ID, {}).get("credit", 0) > 0
        )

    def broker_counters(self) -> list[dict[str, Any]]:
        """Each broker's accounting (one per broker path)."""
        out = []
        for path in self.controls:
            body = self._status(path, 2.0) or {"broker": {}}
            out.append({k: body["broker"].get(k) for k in ("received", "forwarded", "dropped", "accounted")})
        return out

    def measure(self, path: str, index: int, seconds: float) -> dict[str, Any]:
        """Receiver-side rate of payload ``index`` over ``seconds``, after a warm-up.

        Also the forwarder's CPU time per message: unlike rates, it hardly moves when other
        processes load the machine, so it shows what a change to the broker buys even on a busy box.
        """
        lane = self.lanes[path]
        start = lane.counters.read()[0]
        lane.mode.value = index + 1
        try:
            self.workers.wait(
                lambda: lane.counters.read()[0] >= start + 2, FIRST_MSG_TIMEOUT_S, f"the first {path} messages"
            )
            time.sleep(min(WARMUP_S, seconds))  # page faults of the new size, queues filling up
            n0, b0, t0 = lane.counters.read()
            cpu0 = C.cpu_seconds(lane.forwarder_pid)
            time.sleep(seconds)
            # Rates run from the first to the last message seen: at least a few of them.
            self.workers.wait(
                lambda: lane.counters.read()[0] >= n0 + MIN_WINDOW_MSGS,
                FIRST_MSG_TIMEOUT_S,
                f"{path} messages in the window",
            )
            n1, b1, t1 = lane.counters.read()
            cpu1 = C.cpu_seconds(lane.forwarder_pid)
        finally:
            lane.mode.value = 0
            self._drain(lane)
        cpu = None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / (n1 - n0) * 1e6
        return {"msgs_per_s": (n1 - n0) / (t1 - t0), "mb_per_s": (b1 - b0) / (t1 - t0) / 1e6, "cpu_us": cpu}

    def _drain(self, lane: Lane) -> None:
        """Wait until what the stopped sender left queued has arrived, so payloads never mix."""
        deadline = time.monotonic() + FIRST_MSG_TIMEOUT_S
        last, quiet_since = lane.counters.read()[0], time.monotonic()
        while time.monotonic() - quiet_since < DRAIN_QUIET_S and time.monotonic() < deadline:
            time.sleep(0.01)
            now = lane.counters.read()[0]
            if now != last:
                last, quiet_since = now, time.monotonic()


def paths_of(keys_dir: str | None, bus_dir: str | None) -> tuple[str, ...]:
    """The paths measured: always PATHS; with keys the closed ones, with a local bus's directory the local one."""
    return PATHS + ((DIRECT_CURVE, SECURE) if keys_dir else ()) + ((LOCAL,) if bus_dir else ())


def run_throughput(
    payloads: list[int],
    rounds: int,
    seconds: float,
    broker_spec: str,
    window: int = C.CREDIT_WINDOW,
    keys_dir: str | None = None,
    bus_dir: str | None = None,
) -> tuple[list[dict], list[dict], dict]:
    """Every round of every payload on a fresh set of processes and connections.

    Fresh per payload: one set of processes for all payloads measured 1 MiB on kernel socket buffers and heaps
    that the 8 MiB rounds had grown (receive buffers autotuned to 32 MiB, the broker's heap doubled), a state no
    run of 1 MiB rollouts reaches and one that cost the broker path more than the proxy. Fresh per round: how a
    set of processes lands on the two cores moved the 1 MiB ratio by +-10% from one set to the next, far more
    than rounds within a set differ, so each round draws its own (docs/benchmarks.md).
    """
    paths = paths_of(keys_dir, bus_dir)
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {(p, b): [] for p in paths for b in payloads}
    counters = []
    for size in payloads:
        for r in range(rounds):
            with C.Workers() as workers:
                rig = ThroughputRig(workers, [size], broker_spec, window, keys_dir, bus_dir)
                rig.start()
                shift = r % len(paths)  # every path takes every position in the order
                order = paths[shift:] + paths[:shift]
                for path in order:  # untimed: new connections and heaps grow to the payload's size first
                    rig.measure(path, 0, seconds / 2)
                for path in order:
                    figures = rig.measure(path, 0, seconds)
                    samples[(path, size)].append(figures)
                    logger.info(
                        f"round {r + 1}/{rounds} {size_label(size):>7} {path:<6} {figures['msgs_per_s']:10.0f} "
                        f"msgs/s {figures['mb_per_s']:8.1f} MB/s"
                    )
                counters += rig.broker_counters()
    results = [_result_row(path, size, samples[(path, size)]) for size in payloads for path in paths]
    return results, _ratios(samples, payloads), _summed(counters)


def _summed(counters: list[dict[str, Any]]) -> dict[str, Any]:
    """One line of broker counters over the brokers of every round (each accounted for on its own)."""
    dropped: dict[str, int] = {}
    for c in counters:
        for reason, n in (c.get("dropped") or {}).items():
            dropped[reason] = dropped.get(reason, 0) + n
    return {
        "brokers": len(counters),
        "received": sum(c.get("received") or 0 for c in counters),
        "forwarded": sum(c.get("forwarded") or 0 for c in counters),
        "dropped": dropped,
        "accounted": bool(counters) and all(c.get("accounted") is True for c in counters),
    }


def _result_row(path: str, size: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    cpu = [s["cpu_us"] for s in rounds if s["cpu_us"] is not None]
    return {
        "path": path,
        "payload_bytes": size,
        "msgs_per_s": round(statistics.median(s["msgs_per_s"] for s in rounds), 1),
        "mb_per_s": round(statistics.median(s["mb_per_s"] for s in rounds), 2),
        "forwarder_cpu_us_per_msg": round(statistics.median(cpu), 1) if cpu else None,
        "rounds_msgs_per_s": [round(s["msgs_per_s"], 1) for s in rounds],
    }


def _ratios(samples: dict[tuple[str, int], list[dict[str, float]]], payloads: list[int]) -> list[dict]:
    """Per payload, medians of per-round ratios: paths measured seconds apart share the noise."""

    def ratio(a: str, b: str, size: int) -> float:
        pairs = zip(samples[(a, size)], samples[(b, size)])
        return round(statistics.median(x["msgs_per_s"] / y["msgs_per_s"] for x, y in pairs), 3)

    rows = []
    for size in payloads:
        row: dict[str, Any]
        row = {
            "payload_bytes": size,
            "broker_over_proxy": ratio("broker", "proxy", size),
            "broker_over_direct": ratio("broker", "direct", size),
            "proxy_over_direct": ratio("proxy", "direct", size),
        }
        if (SECURE, size) in samples:
            row["secure_over_broker"] = ratio(SECURE, "broker", size)
            row["curve_over_direct"] = ratio(DIRECT_CURVE, "direct", size)
        if (LOCAL, size) in samples:
            row["local_over_broker"] = ratio(LOCAL, "broker", size)
        targeted = size >= RATIO_FROM_BYTES
        row["target"] = RATIO_TARGET if targeted else None
        row["met"] = row["broker_over_proxy"] >= RATIO_TARGET if targeted else None
        rows.append(row)
    return rows


def run_bench(
    payloads: list[int],
    rounds: int,
    seconds: float,
    sizes: list[int],
    counts: list[int],
    broker_spec: str = C.DEFAULT_BROKER,
    window: int = C.CREDIT_WINDOW,
    secure: bool = False,
    ipc: bool = False,
) -> dict[str, Any]:
    t0 = time.monotonic()
    codec = [row for size in CODEC_SIZES for row in run_codec(size)]  # first: no workers to disturb it
    key_dir = throwaway_keys() if secure else None
    keys_dir = str(key_dir) if key_dir is not None else None
    bus_dir = private_bus_dir() if ipc else None
    try:
        results, ratios, counters = run_throughput(
            payloads, rounds, seconds, broker_spec, window, keys_dir, str(bus_dir) if bus_dir else None
        )
        broadcast = []
        for bus_keys in [None, keys_dir] if keys_dir else [None]:
            with C.Workers() as workers:
                broadcast += run_broadcast(workers, sizes, counts, broker_spec, bus_keys)
        signing = run_signing(keys_dir, [CARTPOLE_PARAM_BYTES, *sizes]) if keys_dir else []
    finally:
        if key_dir is not None:
            shutil.rmtree(key_dir, ignore_errors=True)
        if bus_dir is not None:
            shutil.rmtree(bus_dir, ignore_errors=True)
    if counters.get("dropped") and sum(counters["dropped"].values()):
        logger.warning(f"the broker dropped trajectories during the bench: {counters['dropped']}")
    return {
        "bench": "bus",
        "settings": {
            "seconds": seconds,
            "rounds": rounds,
            "payloads": payloads,
            "hwm": C.HWM,
            "credit_window": window,
            "window_bytes": WINDOW_BYTES,
            "broker": broker_spec,
            "cpus": os.cpu_count(),
            "secure": secure,
            "ipc": ipc,
        },
        "results": results,
        "ratios": ratios,
        "broadcast": broadcast,
        "signing": signing,
        "codec": codec,
        "targets": targets(ratios, codec),
        "broker_counters": counters,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        items = [int(float(v)) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of numbers") from None
    low, high = {"payloads": (2048, 1 << 28), "sizes": (1024, 1 << 28)}.get(param.name, (1, 16))
    if not items or any(not low <= v <= high for v in items):
        raise click.BadParameter(f"values must be in {low}..{high}")
    return items


@click.command("bus")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--seconds",
    type=click.FloatRange(0.05, 60),
    default=0.6,
    show_default=True,
    help="Measurement window per path, payload and round.",
)
@click.option(
    "--rounds",
    type=click.IntRange(1, 20),
    default=5,
    show_default=True,
    help="Repeats (medians kept): many short rounds ride out bursts of machine noise.",
)
@click.option(
    "--payloads",
    default=DEFAULT_PAYLOADS,
    show_default=True,
    callback=_int_list,
    help=f"Trajectory payload sizes in bytes, comma-separated ({C.PIXEL_ROLLOUT_BYTES}: an Atari rollout, uint8).",
)
@click.option(
    "--broadcast-sizes",
    "sizes",
    default="100000,40000000",
    show_default=True,
    callback=_int_list,
    help="Parameter buffer sizes in bytes, comma-separated.",
)
@click.option(
    "--subscribers",
    "counts",
    default="1,4",
    show_default=True,
    callback=_int_list,
    help="Subscriber counts for the broadcast, comma-separated.",
)
@click.option(
    "--broker-impl",
    default=C.DEFAULT_BROKER,
    show_default=True,
    hidden=True,
    help="module:Class of the broker to measure (for prototypes).",
)
@click.option(
    "--credit-window",
    "window",
    type=click.IntRange(1, 1 << 20),
    default=C.CREDIT_WINDOW,
    show_default=True,
    hidden=True,
    help="Most credit the bench learner grants (the learner's sync-mode window by default).",
)
@click.option(
    "--secure",
    is_flag=True,
    help="Also the broker on a closed bus (CURVE, signed parameters), side by side with the open one.",
)
@click.option(
    "--ipc",
    is_flag=True,
    help="Also the broker on the local bus (ipc sockets, `zddrl train`'s default), side by side with loopback TCP.",
)
def bus(
    as_json: bool,
    seconds: float,
    rounds: int,
    payloads: list[int],
    sizes: list[int],
    counts: list[int],
    broker_impl: str,
    window: int,
    secure: bool,
    ipc: bool,
) -> None:
    """Bus throughput (broker vs zmq.proxy vs direct), parameter broadcast latency, codec speed."""
    # SIGTERM must unwind like Ctrl-C so that the finally blocks stop every worker process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    report = run_bench(payloads, rounds, seconds, sizes, counts, broker_impl, window, secure, ipc)
    click.echo(json.dumps(report) if as_json else format_report(report))
