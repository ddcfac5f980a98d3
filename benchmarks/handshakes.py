"""`python -m benchmarks handshakes`: a closed-bus run's versions/s and the broker's CPU, quiet and under a flood of
failed CURVE handshakes from a stranger.

A real closed-bus run on loopback (``zddrl broker --keys``, ``zddrl learner`` with examples/cartpole_ppo.toml and
one ``zddrl actor``, each its own process) trains while a flood process of its own opens ``--rate`` new connections
a second to the broker's control port, each with a CURVE key the broker does not list (``--kind unlisted``), with no
CURVE at all (``nokey``), or alternating (``mixed``). Each connection is a fresh socket that never reconnects and is
closed after ``HOLD_S``, so the broker sees one handshake per connection. Quiet and flooded windows alternate, so
the machine's other load hits both alike; the figures are the medians over windows: the run's versions/s (the
broker's ``policy_version``), the broker process's CPU (``/proc/PID/stat``: all its threads, libzmq's I/O thread and
the ZAP handler included) and the failed handshakes it counted per second. The broker's log lines about refused
handshakes during the run are counted too (they are to be few: aggregated per peer address and interval).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import click
import zmq
import zmq.auth

from zddrl.bench.common import cpu_seconds
from zddrl.keys import credentials, new_key
from zddrl.proc import free_ports
from zddrl.transport.status import request_status

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "cartpole_ppo.toml"
HOLD_S = 1.0
"""How long the flood keeps each connection before closing it (a refused handshake ends well within it)."""
START_S = 120.0
"""The longest the run may take to publish its first versions."""
SPAWN = mp.get_context("spawn")
KINDS = ("unlisted", "nokey", "mixed")


def flood_main(endpoint: str, server_key: bytes, kind: str, rate: float, on: Any, made: Any) -> None:
    """Open ``rate`` connections a second to ``endpoint`` while ``on.value``; count them in ``made``."""
    ctx = zmq.Context()
    public, secret = zmq.curve_keypair()  # a key no broker lists
    open_socks: deque[tuple[float, zmq.Socket]] = deque()
    period, next_at, n = 1.0 / rate, time.monotonic(), 0
    try:
        while on.value >= 0:
            now = time.monotonic()
            while open_socks and now - open_socks[0][0] > HOLD_S:
                open_socks.popleft()[1].close(linger=0)
            if on.value == 0:
                next_at = now + period
                time.sleep(0.01)
                continue
            if now < next_at:
                time.sleep(min(next_at - now, 0.01))
                continue
            next_at += period
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one handshake per connection, as a new client makes it
            if kind == "unlisted" or (kind == "mixed" and n % 2 == 0):
                sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, public, secret
            sock.connect(endpoint)
            open_socks.append((now, sock))
            n += 1
            made.value = n
    finally:
        for _, sock in open_socks:
            sock.close(linger=0)
        ctx.term()


def make_keys(root: Path) -> None:
    for role, name in [("broker", "b"), ("learner", "l"), ("actor", "a"), ("monitor", "m")]:
        new_key(root, role, name)


def start_run(keys: Path, work: Path) -> tuple[dict[str, subprocess.Popen], str]:
    """Broker, learner and actor of a closed-bus CartPole run, each logging to ``work/NAME.log``; returns the
    processes and the control endpoint."""
    port, traj, learners, params = free_ports(4)
    endpoint = f"tcp://127.0.0.1:{port}"
    ports = ["--trajectory-port", str(traj), "--learner-port", str(learners), "--params-port", str(params)]
    endless = ["--set", "train.until_return=1e9", "--set", "train.max_steps=1000000000"]
    endless += ["--set", "train.max_seconds=100000"]
    learner = ["learner", str(CONFIG), "--connect", endpoint, "--run-dir", str(work / "run"), *endless]
    commands = {
        "broker": ["broker", "--bind", endpoint, "--insecure", *ports],
        "learner": learner,
        "actor": ["actor", "--connect", endpoint],
    }
    procs: dict[str, subprocess.Popen] = {}
    for name, args in commands.items():
        with open(work / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "zddrl", "--log-level", "INFO", *args, "--keys", str(keys)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    return procs, endpoint


def status(endpoint: str, keys: Path) -> dict[str, Any]:
    body = request_status(endpoint, 5.0, credentials=credentials(keys, "monitor", "m"))
    if body is None:
        raise click.ClickException(f"no status from the broker at {endpoint}")
    return body["broker"]


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads by kind: its main thread, libzmq's I/O threads, its other threads (the
    ZAP handler's, in the broker)."""
    out = dict.fromkeys(("main", "zmq_io", "other"), 0.0)
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # a thread that ended meanwhile
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        kind = "main" if tid == str(pid) else "zmq_io" if name.startswith("ZMQbg/IO") else "other"
        out[kind] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def window(endpoint: str, keys: Path, pids: dict[str, int], seconds: float) -> dict[str, float]:
    """versions/s, each process's CPU (cores: the broker's, the learner's, the actor's, the flood's; the broker's
    by thread) and the broker's failed handshakes per second over ``seconds``."""
    b0, cpu0, t0 = status(endpoint, keys), {k: cpu_seconds(p) for k, p in pids.items()}, time.monotonic()
    threads0 = thread_cpu(pids["broker"])
    time.sleep(seconds)
    b1, cpu1, t1 = status(endpoint, keys), {k: cpu_seconds(p) for k, p in pids.items()}, time.monotonic()
    threads1 = thread_cpu(pids["broker"])
    dt = t1 - t0
    return {
        "versions_per_s": round((b1["policy_version"] - b0["policy_version"]) / dt, 2),
        **{f"{k}_cpu": round(((cpu1[k] or 0.0) - (cpu0[k] or 0.0)) / dt, 3) for k in pids},
        **{f"broker_{k}_cpu": round((threads1[k] - threads0[k]) / dt, 3) for k in threads0},
        "failed_per_s": round((b1["handshakes_failed"] - b0["handshakes_failed"]) / dt, 1),
        "zap_denied_per_s": round((b1["zap_denied"] - b0["zap_denied"]) / dt, 1),
    }


def wait_versions(endpoint: str, keys: Path, procs: dict[str, subprocess.Popen], work: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                tail = (work / f"{name}.log").read_text(errors="replace")[-2000:]
                raise click.ClickException(f"{name} exited early (code {proc.returncode}):\n{tail}")
        body = request_status(endpoint, 2.0, credentials=credentials(keys, "monitor", "m"))
        if body is not None and body["broker"]["policy_version"] >= 5:
            return
        time.sleep(0.5)
    raise click.ClickException(f"the run published no 5 versions within {START_S:.0f} s")


def handshake_log_lines(log: Path) -> int:
    return sum("handshake" in line for line in log.read_text(errors="replace").splitlines())


def measure(rate: float, kind: str, seconds: float, windows: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="zddrl-handshakes-") as tmp:
        work = Path(tmp)
        keys = work / "keys"
        make_keys(keys)
        server_key = zmq.auth.load_certificate(str(keys / "broker" / "b.key"))[0]
        procs, endpoint = start_run(keys, work)
        broker_log = work / "broker.log"
        on, made = SPAWN.RawValue("i", 0), SPAWN.RawValue("l", 0)
        flood = SPAWN.Process(target=flood_main, args=(endpoint, server_key, kind, rate, on, made), daemon=True)
        rows: list[dict[str, Any]] = []
        try:
            wait_versions(endpoint, keys, procs, work)
            flood.start()
            pids = {**{name: proc.pid for name, proc in procs.items()}, "flood": flood.pid or 0}
            lines0 = handshake_log_lines(broker_log)
            for w in range(windows):
                for flooded in (False, True) if w % 2 == 0 else (True, False):
                    on.value = int(flooded)
                    time.sleep(HOLD_S if flooded else 2 * HOLD_S)  # the other phase's connections settle first
                    n0, t0 = made.value, time.monotonic()
                    got = window(endpoint, keys, pids, seconds)
                    got["made_per_s"] = round((made.value - n0) / (time.monotonic() - t0), 1)
                    rows.append({"window": w, "flood": flooded, **got})
            on.value = 0
            log_lines = handshake_log_lines(broker_log) - lines0
            accounting = status(endpoint, keys)
        finally:
            on.value = -1
            flood.join(timeout=5)
            if flood.is_alive():
                flood.kill()
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return report(rows, rate, kind, seconds, log_lines, accounting)


def report(
    rows: list[dict[str, Any]], rate: float, kind: str, seconds: float, log_lines: int, b: dict[str, Any]
) -> dict[str, Any]:
    def median(flooded: bool, key: str) -> float:
        return round(statistics.median(r[key] for r in rows if r["flood"] == flooded), 3)

    keys = [k for k in rows[0] if k not in ("window", "flood")]
    quiet = {k: median(False, k) for k in keys}
    flood = {k: median(True, k) for k in keys}
    return {
        "rate": rate,
        "kind": kind,
        "seconds_per_window": seconds,
        "quiet": quiet,
        "flood": flood,
        "versions_ratio": round(flood["versions_per_s"] / max(quiet["versions_per_s"], 1e-9), 3),
        "broker_handshake_log_lines": log_lines,
        "accounted": b.get("accounted"),
        "windows": rows,
    }


@click.command("handshakes")
@click.option("--rate", type=click.FloatRange(1), default=200.0, show_default=True, help="Connections a second.")
@click.option("--kind", type=click.Choice(KINDS), default="unlisted", show_default=True, help="The flood's keys.")
@click.option("--seconds", type=click.FloatRange(1), default=8.0, show_default=True, help="Seconds per window.")
@click.option("--windows", type=click.IntRange(1), default=3, show_default=True, help="Quiet/flood window pairs.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def handshakes(rate: float, kind: str, seconds: float, windows: int, as_json: bool) -> None:
    """A closed-bus run's versions/s and the broker's CPU, quiet and under a flood of refused handshakes."""
    result = measure(rate, kind, seconds, windows)
    if as_json:
        click.echo(json.dumps(result))
        return
    q, f = result["quiet"], result["flood"]
    click.echo(f"handshake flood: {rate:.0f} connections/s, {kind} keys, {windows} x {seconds:.0f} s per phase")
    click.echo(f"{'':24}{'quiet':>10}{'flood':>10}")
    for key, label in [
        ("versions_per_s", "versions/s"),
        ("broker_cpu", "broker CPU (cores)"),
        ("broker_main_cpu", "  its main thread"),
        ("broker_zmq_io_cpu", "  its libzmq I/O thread"),
        ("broker_other_cpu", "  its other threads (ZAP)"),
        ("learner_cpu", "learner CPU (cores)"),
        ("actor_cpu", "actor CPU (cores)"),
        ("flood_cpu", "flood CPU (cores)"),
        ("failed_per_s", "failed handshakes/s"),
        ("zap_denied_per_s", "ZAP denials/s"),
        ("made_per_s", "connections made/s"),
    ]:
        click.echo(f"{label:24}{q[key]:>10}{f[key]:>10}")
    click.echo(f"versions/s under the flood: {result['versions_ratio']}x the quiet run's")
    click.echo(f"broker log lines about handshakes: {result['broker_handshake_log_lines']}")
