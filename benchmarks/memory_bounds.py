"""`python -m benchmarks.memory_bounds`: the broker's memory under a key holder's memory attacks, measured on a real
closed-bus run (a broker, a learner and two actors with keys, CartPole).

Three attacks, one after another, each with the key it needs (docs/security.md, "Bounded resources"):

* ``frames``: one multipart message of ``--frames`` frames of ``--frame-mib`` MiB each, on the control socket with
  a monitor key and on the trajectories socket with an actor key;
* ``many``: the same on the control socket with frames just under its frame cap (many small frames, one message);
* ``hoard``: ``--conns`` connections asking for status ``--rate`` times a second each and reading nothing, for
  ``--hoard-s`` seconds.

Per attack: the broker's RSS before, its peak during, and after (``--settle-s`` later); the broker's counters that
say what it did; the versions the learner published meanwhile (the run must keep training).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import zmq

from zddrl import protocol as P
from zddrl.keys import Credentials, credentials, new_key
from zddrl.proc import free_ports
from zddrl.transport.link import BrokerLink
from zddrl.transport.status import request_status

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "cartpole_ppo.toml"
MIB = 1 << 20
WAIT_S = 60.0
COUNTERS = (
    "control_unroutable",
    "status_refused",
    "replies_unread",
    "snapshots_unread",
    "control_too_many_frames",
    "memory_resets",
    "handshakes_ok",
    "received",
)
"""The broker's counters shown after each attack (those that exist: the code before these bounds lacks some)."""


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` (VmRSS), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class Peak:
    """Samples a process's RSS every 20 ms on a thread while in use: ``peak`` is the highest seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_mib(self.pid))

    def __enter__(self) -> Peak:
        self.peak = rss_mib(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Run:
    """A closed-bus run: keys, `zddrl broker --keys`, a learner and two actors on CartPole, all stopped on exit."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.keys = tmp, tmp / "keys"
        for role, name in [("broker", "b"), ("learner", "l"), ("actor", "a"), ("monitor", "m")]:
            new_key(self.keys, role, name)
        self.ports = free_ports(4)
        self.connect = f"tcp://127.0.0.1:{self.ports[0]}"
        self.procs: list[subprocess.Popen] = []
        self.ctx = zmq.Context()

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "zddrl", *args]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        log.close()
        self.procs.append(proc)
        return proc

    def up(self, profile: Path | None) -> None:
        ready = self.tmp / "ready.json"
        ports = [f"--{n}-port={p}" for n, p in zip(("trajectory", "learner", "params"), self.ports[1:])]
        more = ["--profile", str(profile)] if profile else []
        keys = ["--keys", str(self.keys)]
        self.broker = self.start(
            "broker", "broker", *keys, "--bind", self.connect, *ports, "--ready-file", str(ready), *more
        )
        wait(lambda: ready.exists() or self.broker.poll() is not None, "the broker to bind")
        sets = ["train.max_steps=1000000000", "train.until_return=1e9", "train.max_seconds=3600"]
        sets_args = [a for s in sets for a in ("--set", s)]
        run_dir = str(self.tmp / "run")
        self.start(
            "learner", "learner", str(CONFIG), "--connect", self.connect, *keys, "--run-dir", run_dir, *sets_args
        )
        for i in range(2):
            self.start(f"actor-{i}", "actor", "--connect", self.connect, *keys, "--actor-id", str(i))
        wait(lambda: self.version() >= 5, "the run to publish version 5")

    def who(self, role: str) -> Credentials:
        return credentials(self.keys, role)

    def status(self) -> dict[str, Any]:
        body = request_status(self.connect, 5.0, self.ctx, credentials=self.who("monitor"))
        return body["broker"] if body else {}

    def body(self) -> dict[str, Any]:
        return request_status(self.connect, 5.0, self.ctx, credentials=self.who("monitor")) or {}

    def version(self) -> int:
        return int(self.status().get("policy_version", -1))

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.ctx.destroy(linger=0)


def wait(condition: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


@contextmanager
def measured(run: Run, name: str, out: dict[str, Any], settle_s: float) -> Iterator[None]:
    """RSS before, peak during and ``settle_s`` after the block; counters and versions around it."""
    pid = run.broker.pid
    before, v0, t0 = rss_mib(pid), run.version(), time.monotonic()
    with Peak(pid) as peak:
        yield
        time.sleep(settle_s)
    counters = run.status()
    elapsed = time.monotonic() - t0
    out[name] = {
        "rss_before_mib": round(before, 1),
        "rss_peak_mib": round(peak.peak, 1),
        "rss_after_mib": round(rss_mib(pid), 1),
        "versions_per_s": round((int(counters.get("policy_version", -1)) - v0) / elapsed, 2),
        "broker_alive": run.broker.poll() is None,
        **{k: counters.get(k) for k in COUNTERS if k in counters},
    }
    print(f"{name}: {json.dumps(out[name])}", file=sys.stderr, flush=True)


def send_frames(run: Run, role: str, port: int, kind: int, frames: int, frame_bytes: int, hold_s: float) -> None:
    """One multipart message of ``frames`` frames of ``frame_bytes`` on ``port`` with ``role``'s key; the socket
    stays open ``hold_s`` (the broker may hold the frames until the message ends: it never does here)."""
    sock = run.ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    run.who(role).apply(sock)
    sock.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # the handshake
    payload = memoryview(bytearray(frame_bytes))
    header = P.encode(P.Heartbeat(peer_id=f"{role}-x"))
    try:
        sock.send(header[0], zmq.SNDMORE)
        sock.send(header[1], zmq.SNDMORE)
        for i in range(frames):
            sock.send(payload, zmq.SNDMORE if i < frames - 1 else 0, copy=False)
        time.sleep(hold_s)
    finally:
        sock.close(linger=0)


def fatten(run: Run, members: int, stats_bytes: int) -> list[BrokerLink]:
    """``members`` monitors of the monitor key, each with stats of about ``stats_bytes``: status bodies grow."""
    links = []
    stats = {f"figure/{i:06d}": "v" * 256 for i in range(stats_bytes // 272)}
    for i in range(members):
        peer_id = f"monitor-fat{i}"
        link = BrokerLink(run.connect, P.Hello(role="monitor", peer_id=peer_id), context=run.ctx,
                          credentials=run.who("monitor")).start()  # fmt: skip
        if link.wait_welcome(WAIT_S) is None:
            raise RuntimeError(f"{peer_id}: no welcome")
        link.send(P.Stats(peer_id=peer_id, role="monitor", stats=stats))
        links.append(link)
    return links


def hoard(run: Run, conns: int, rate: float, seconds: float) -> None:
    """``conns`` monitor-key connections asking for status ``rate`` times a second each, reading nothing."""
    socks = []
    for _ in range(conns):
        sock = run.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
        run.who("monitor").apply(sock)
        sock.connect(run.connect)
        socks.append(sock)
    request = P.encode(P.StatusRequest(peer_id="hoard"))
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            for sock in socks:
                try:
                    sock.send_multipart(request, zmq.NOBLOCK)
                except zmq.Again:
                    pass
            time.sleep(1.0 / rate)
    finally:
        for sock in socks:
            sock.close(linger=0)


def frames_control(run: Run, args: dict[str, Any], out: dict[str, Any]) -> None:
    with measured(run, "frames_control_monitor_key", out, args["settle_s"]):
        send_frames(run, "monitor", run.ports[0], zmq.DEALER, args["frames"], args["frame_mib"] * MIB, args["hold_s"])


def frames_trajectories(run: Run, args: dict[str, Any], out: dict[str, Any]) -> None:
    with measured(run, "frames_trajectories_actor_key", out, args["settle_s"]):
        send_frames(run, "actor", run.ports[1], zmq.PUSH, args["frames"], args["frame_mib"] * MIB, args["hold_s"])


def many_frames(run: Run, args: dict[str, Any], out: dict[str, Any]) -> None:
    """The same bytes in frames of 1 MiB less a little (under the control socket's frame cap)."""
    many = args["frames"] * args["frame_mib"]
    with measured(run, "many_frames_control_monitor_key", out, args["settle_s"]):
        send_frames(run, "monitor", run.ports[0], zmq.DEALER, many, MIB - 4096, args["hold_s"])


def hoard_status(run: Run, args: dict[str, Any], out: dict[str, Any]) -> None:
    links = fatten(run, args["fat_members"], 60 << 10)
    out["status_body_bytes"] = len(P.encode(P.Status(body=run.body()))[1])
    with measured(run, "hoard_status", out, args["settle_s"]):
        hoard(run, args["conns"], args["rate"], args["hoard_s"])
    for link in links:
        link.close("done")


ATTACKS = {
    "frames_control": frames_control,
    "frames_trajectories": frames_trajectories,
    "many_frames": many_frames,
    "hoard_status": hoard_status,
}


def measure(args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"args": args}
    with tempfile.TemporaryDirectory(prefix="zddrl-memory-") as tmp:
        run = Run(Path(tmp))
        try:
            run.up(Path(args["profile"]) if args["profile"] else None)
            out["idle"] = {"rss_mib": round(rss_mib(run.broker.pid), 1)}
            only = set(args["only"].split(",")) if args["only"] else set(ATTACKS)
            for name in ATTACKS:
                if name in only:
                    ATTACKS[name](run, args, out)
            out["log_tail"] = (Path(tmp) / "broker.log").read_text().splitlines()[-15:]
        finally:
            run.close()
    return out


@click.command("memory_bounds")
@click.option("--frames", default=7, show_default=True, help="Frames of the big message.")
@click.option("--frame-mib", default=100, show_default=True, help="MiB per frame of the big message.")
@click.option("--hold-s", default=10.0, show_default=True, help="Seconds the attacker keeps its socket open.")
@click.option("--conns", default=40, show_default=True, help="Status-hoarding connections.")
@click.option("--rate", default=5.0, show_default=True, help="Status requests per second per connection.")
@click.option("--hoard-s", default=60.0, show_default=True, help="Seconds of hoarding.")
@click.option("--fat-members", default=8, show_default=True, help="Monitors with 60 KiB stats (bigger bodies).")
@click.option("--settle-s", default=3.0, show_default=True, help="Seconds after an attack before RSS is read.")
@click.option("--profile", default="", help="A broker profile (e.g. a memory budget).")
@click.option("--only", default="", help=f"Comma-separated attacks to run (default all: {', '.join(ATTACKS)}).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def memory_bounds(**args: Any) -> None:
    """The broker's RSS under the memory attacks of a key holder (issue 28 item 3)."""
    as_json = args.pop("as_json")
    out = measure(args)
    print(json.dumps(out, indent=1) if as_json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    memory_bounds()
