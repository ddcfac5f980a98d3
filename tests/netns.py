"""Emulated hosts for tests: network namespaces on one bridge, each with an address of its own, and the processes
the test runs in them; run as a script, it is the monitor host's status poller.

``Net`` makes a bridge and, per host, a namespace whose veth pair plugs it into the bridge (``10.77.0.N/24``
inside the namespace, loopback up); nothing gets an address outside the namespaces the test made. ``cut`` and
``heal`` take a host's bridge-side link down and up: a partition with every process left running. ``remove``
stops what ran in the namespaces and deletes the veths, the namespaces and the bridge, whatever happened before.
Names are unique per run, so two runs on one machine do not meet.

``python tests/netns.py --out FILE --keys DIR NAME=tcp://ADDR:PORT ...`` (started in the monitor's namespace)
asks each broker for its status over the closed bus with the monitor key, one thread per broker, and appends one
JSON line per answer or silence: ``{"t": monotonic seconds, "at": NAME, "broker": {...}, "members": {...},
"departures": [...]}``.
CLOCK_MONOTONIC is one clock for every namespace, so the test compares ``t`` with its own instants.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SUBNET = "10.77.0"
"""Addresses of the emulated hosts: SUBNET.1, SUBNET.2, ... (/24), on the test's own bridge only."""
IP_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
STATUS_TIMEOUT_S = 0.5
"""Per status request: a new connection each time, so a request sent into a partition is not stuck behind a lost
SYN's retransmission back-off once the link is up again."""
POLL_INTERVAL_S = 0.2
ROW_FIELDS = ("role", "pid", "policy_version", "messages", "relay")
"""What the poller keeps of each member row."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=check)


class Net:
    """A bridge and the hosts on it; every process started with ``start`` runs in its host's namespace."""

    def __init__(self, log_dir: Path) -> None:
        self.tag = "zn" + secrets.token_hex(3)
        """Prefix of every name this net makes (interface names are at most 15 characters)."""
        self.log_dir = log_dir
        self.bridge = f"{self.tag}br"
        self.hosts: dict[str, tuple[str, str, str]] = {}
        """Host name -> (namespace, bridge-side veth, address)."""
        self.procs: dict[str, subprocess.Popen] = {}
        self.made_bridge = False

    def make(self, hosts: list[str]) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self.made_bridge = True
        ip("link", "set", self.bridge, "up")
        for n, host in enumerate(hosts, start=1):
            ns, veth, address = f"{self.tag}-{host}", f"{self.tag}h{n}", f"{SUBNET}.{n}"
            ip("netns", "add", ns)
            self.hosts[host] = (ns, veth, address)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def address(self, host: str) -> str:
        return self.hosts[host][2]

    def endpoint(self, host: str, port: int = 5555) -> str:
        return f"tcp://{self.address(host)}:{port}"

    def cut(self, host: str) -> None:
        """Partition ``host``: its link into the bridge goes down, its processes keep running."""
        ip("link", "set", self.hosts[host][1], "down")

    def heal(self, host: str) -> None:
        ip("link", "set", self.hosts[host][1], "up")

    def start(self, host: str, name: str, *command: str) -> subprocess.Popen:
        """``command`` in ``host``'s namespace, its output in LOG_DIR/NAME.log. `ip netns exec` execs the command
        itself, so the Popen's pid is the command's."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZDDRL_")}
        with open(self.log_dir / f"{name}.log", "w") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.hosts[host][0], *command],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**env, "PYTHONUNBUFFERED": "1"},
            )
        self.procs[name] = proc
        return proc

    def reachable(self, src: str, dst: str, port: int, timeout_s: float = 5.0) -> bool:
        """Whether a TCP connection from ``src`` to ``dst``:``port`` opens across the bridge."""
        code = f"import socket; socket.create_connection(({self.address(dst)!r}, {port}), timeout={timeout_s}).close()"
        command = ["ip", "netns", "exec", self.hosts[src][0], sys.executable, "-c", code]
        return subprocess.run(command, capture_output=True, timeout=timeout_s + IP_TIMEOUT_S).returncode == 0

    def log(self, name: str, chars: int = 3000) -> str:
        path = self.log_dir / f"{name}.log"
        return f"--- {name}.log:\n{path.read_text()[-chars:]}" if path.exists() else f"--- no {name}.log"

    def logs(self) -> str:
        return "\n".join(self.log(name, 1500) for name in self.procs)

    def stop(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def remove(self, order: list[str]) -> list[str]:
        """Stop the processes (``order`` first, the rest after), kill anything still in a namespace (children of
        them), delete veths, namespaces and the bridge. Returns what could not be removed."""
        for name in [*order, *(n for n in self.procs if n not in order)]:
            if name in self.procs:
                self.stop(name)
        left: list[str] = []
        for ns, veth, _ in self.hosts.values():
            pids = ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                _kill(int(pid))
            for args in (("link", "del", veth), ("netns", "del", ns)):
                done = ip(*args, check=False)
                if done.returncode != 0 and "Cannot find" not in done.stderr:
                    left.append(f"ip {' '.join(args)}: {done.stderr.strip()}")
        if self.made_bridge:
            done = ip("link", "del", self.bridge, check=False)
            if done.returncode != 0:
                left.append(f"ip link del {self.bridge}: {done.stderr.strip()}")
        return left

    def leftovers(self) -> list[str]:
        """Names of this net still present on the machine (after ``remove``: none)."""
        links = ip("-o", "link", "show", check=False).stdout
        spaces = ip("netns", "list", check=False).stdout
        return [word for word in (links + spaces).split() if word.startswith(self.tag)]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Samples:
    """The poller's JSON lines, read as they come: ``read()`` takes the new whole lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return self.rows
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]
        self._offset += len(whole)
        self.rows.extend(json.loads(line) for line in whole.splitlines() if line)
        return self.rows

    def at(self, broker: str, since: float = 0.0) -> list[dict[str, Any]]:
        """Answers of ``broker`` received at or after ``since`` (silences left out)."""
        return [r for r in self.read() if r["at"] == broker and r["t"] >= since and "broker" in r]

    def last(self, broker: str, before: float) -> dict[str, Any] | None:
        answers = [r for r in self.at(broker) if r["t"] < before]
        return answers[-1] if answers else None

    def first(
        self, broker: str, since: float, condition: Callable[[dict[str, Any]], bool], timeout_s: float
    ) -> dict[str, Any] | None:
        """The first answer of ``broker`` at or after ``since`` for which ``condition`` holds, waiting up to
        ``timeout_s`` (from now) for it; None if none came."""
        deadline = time.monotonic() + timeout_s
        while True:
            for row in self.at(broker, since):
                if condition(row):
                    return row
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def _trim(body: dict[str, Any], now: float) -> dict[str, Any]:
    """The counters, each member's ROW_FIELDS, and who left when (``left``: monotonic seconds)."""
    members = {peer: {k: row.get(k) for k in ROW_FIELDS} for peer, row in body.get("members", {}).items()}
    departures = [
        {"member": d.get("member"), "reason": str(d.get("reason"))[:200], "left": now - float(d.get("ago_s", 0))}
        for d in body.get("departures", [])
    ]
    return {"broker": body["broker"], "members": members, "departures": departures}


def poll(out: Path, keys: Path, brokers: dict[str, str]) -> None:
    """Ask every broker for its status until SIGTERM, appending one JSON line per answer or silence."""
    import zmq

    from zddrl.keys import credentials
    from zddrl.transport.status import request_status

    creds, ctx, lock, stop = credentials(keys, "monitor"), zmq.Context(), threading.Lock(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def ask(name: str, endpoint: str, f: Any) -> None:
        while not stop.is_set():
            body = request_status(endpoint, STATUS_TIMEOUT_S, ctx, creds)
            now = time.monotonic()
            line = json.dumps({"t": now, "at": name, **(_trim(body, now) if body else {})})
            with lock:
                f.write(line + "\n")
                f.flush()
            if body is not None:
                stop.wait(POLL_INTERVAL_S)

    with open(out, "a") as f:
        threads = [threading.Thread(target=ask, args=(n, e, f), daemon=True) for n, e in brokers.items()]
        for thread in threads:
            thread.start()
        stop.wait()
        for thread in threads:
            thread.join(STATUS_TIMEOUT_S * 4)
    ctx.destroy(linger=0)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="status poller of the monitor host")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--keys", type=Path, required=True)
    parser.add_argument("brokers", nargs="+", help="NAME=tcp://ADDR:PORT")
    args = parser.parse_args(argv)
    poll(args.out, args.keys, dict(b.split("=", 1) for b in args.brokers))


if __name__ == "__main__":
    main(sys.argv[1:])
