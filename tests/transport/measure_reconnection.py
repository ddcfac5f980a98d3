"""Measures what a broker's death costs its clients: welcomes per client after a restart, and failover time.

Not a test (pytest does not collect it): the figures behind docs/protocol.md section 5.2 and the README's failover
line, on loopback, with a real `zddrl broker` started from a profile (brokers/cluster.toml by default, its bind and
ports replaced by free loopback ones) and in-process ``BrokerLink`` clients (actors)::

    python tests/transport/measure_reconnection.py [--profile brokers/cluster.toml] [--clients 8]

* restart: the broker gets kill -9, stays down ``--down`` seconds (under interval x liveness, so that the clients
  keep their control sockets and queue heartbeats meanwhile), and is started again on the same ports: each client's
  welcomes (and hellos) until the clients have been quiet for three heartbeat intervals.
* failover: two brokers, clients given the list ``A,B``; A gets kill -9: seconds until each client is welcomed by B.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq
from loguru import logger

from zddrl import protocol as P
from zddrl.brokerconf import load_broker_config
from zddrl.proc import free_ports
from zddrl.transport.link import BrokerLink

START_S = 30.0
"""Longest wait for a broker to bind, and for the clients' welcomes."""


class Broker:
    """A `zddrl broker` process on four free loopback ports, started from ``profile``; restartable on the same ports."""

    def __init__(self, profile: Path, folder: Path, name: str) -> None:
        self.profile, self.folder, self.name = profile, folder, name
        self.ports = free_ports(4)
        self.connect = f"tcp://127.0.0.1:{self.ports[0]}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Broker:
        ready = self.folder / f"{self.name}-ready.json"
        ready.unlink(missing_ok=True)
        names = ("--trajectory-port", "--learner-port", "--params-port")
        ports = [a for pair in zip(names, map(str, self.ports[1:])) for a in pair]
        args = [
            "--profile",
            str(self.profile),
            "--bind",
            self.connect,
            "--insecure",
            *ports,
            "--ready-file",
            str(ready),
        ]
        with open(self.folder / f"{self.name}.log", "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "zddrl", "broker", *args], stdout=log, stderr=log)
        wait(lambda: ready.exists() or self.proc.poll() is not None, START_S, f"broker {self.name} to bind")
        if self.proc.poll() is not None:
            raise SystemExit((self.folder / f"{self.name}.log").read_text())
        return self

    def kill(self) -> float:
        """kill -9; returns the monotonic time of the kill."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        self.proc.wait()
        return killed

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def wait(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.005)


def links(ctx: zmq.Context, connect: str, n: int) -> list[BrokerLink]:
    out = [BrokerLink(connect, P.Hello(role="actor", peer_id=f"actor-{i}"), context=ctx).start() for i in range(n)]
    wait(lambda: all(link.generation >= 1 for link in out), START_S, "the first welcomes")
    return out


def hellos(link: BrokerLink) -> int | str:
    return getattr(link, "hellos", "-")  # counted by links from the one-hello-per-reconnection change on


def measure_restart(profile: Path, folder: Path, clients: int, down_s: float, interval_s: float) -> dict:
    broker = Broker(profile, folder, "restarted").start()
    ctx = zmq.Context()
    try:
        group = links(ctx, broker.connect, clients)
        before = [(link.generation, hellos(link)) for link in group]
        broker.kill()
        time.sleep(down_s)  # the clients keep heartbeating into their queues meanwhile
        broker.start()
        wait(lambda: all(link.generation > g for link, (g, _) in zip(group, before)), START_S, "the re-welcomes")
        quiet = [link.generation for link in group]
        while True:  # until no client was welcomed again for three intervals
            time.sleep(3 * interval_s)
            now = [link.generation for link in group]
            if now == quiet:
                break
            quiet = now
        welcomes = [link.generation - g for link, (g, _) in zip(group, before)]
        sent = [
            h - h0 if isinstance(h, int) and isinstance(h0, int) else "-"
            for h, (_, h0) in zip(map(hellos, group), before)
        ]
        for link in group:
            link.close("measured")
        return {"welcomes_per_client": welcomes, "hellos_per_client": sent, "down_s": down_s}
    finally:
        ctx.destroy(linger=0)
        broker.stop()


def measure_failover(profile: Path, folder: Path, clients: int) -> dict:
    a, b = Broker(profile, folder, "a").start(), Broker(profile, folder, "b").start()
    ctx = zmq.Context()
    try:
        group = links(ctx, f"{a.connect},{b.connect}", clients)
        killed = a.kill()
        moved: dict[int, float] = {}

        def all_moved() -> bool:
            for i, link in enumerate(group):
                if i not in moved and link.generation >= 2 and link.connect == b.connect:
                    moved[i] = time.monotonic() - killed
            return len(moved) == len(group)

        wait(all_moved, 120, "every client's welcome by B")
        times = sorted(moved.values())
        for link in group:
            link.close("measured")
        return {
            "failover_s_min": round(times[0], 2),
            "failover_s_median": round(statistics.median(times), 2),
            "failover_s_max": round(times[-1], 2),
        }
    finally:
        ctx.destroy(linger=0)
        a.stop()
        b.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, default=Path("brokers/cluster.toml"))
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--down", type=float, default=0.0, help="seconds the restarted broker stays down (0: 3 beats)")
    args = parser.parse_args()
    settings = load_broker_config(args.profile)
    interval_s, liveness = settings.heartbeat_interval_s, settings.heartbeat_liveness
    logger.remove()  # the links' own lines would drown the figures
    with tempfile.TemporaryDirectory(prefix="zddrl-measure-") as tmp:
        folder = Path(tmp)
        figures = {
            "profile": str(args.profile),
            "heartbeat": f"{interval_s} s x {liveness}",
            "clients": args.clients,
            **measure_restart(args.profile, folder, args.clients, args.down or 3 * interval_s, interval_s),
            **measure_failover(args.profile, folder, args.clients),
        }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
