"""Shared test fixtures: real zddrl processes on 127.0.0.1, free ports, bounded waits, always cleaned up.

pytest's default (prepend) import mode puts tests/ on sys.path for this root conftest, and each test file's
own folder for that file: test modules import the helpers here by plain name (``conftest``, ``samples``,
``broker_clients``, ``test_train``), and test file basenames must stay unique across the folders.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from zddrl import proc as zproc
from zddrl import protocol as P
from zddrl.proc import free_ports
from zddrl.transport.link import BrokerLink

pytest_plugins = ("phases",)  # the parallel phase, then the serial one (tests/phases.py)


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker: its own slice of the free ports' range, for it and every process it starts, so that two
    workers never choose the same port (a port another process takes is still passed over, or retried)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and count.isdigit() and zproc.PORT_RANGE_ENV not in os.environ:
        low, top = zproc.LOWEST_PORT, zproc._ephemeral_start()
        # at least the 1,000 ports free_ports draws from at random (past ~22 workers, neighbours' slices overlap)
        width = max(1000, (top - low) // max(1, int(count)))
        start = low + int(worker[2:]) * width % max(1, top - low - width + 1)
        os.environ[zproc.PORT_RANGE_ENV] = f"{start}-{start + width}"
        # torch's in-process ops: the worker's share of the CPUs, not all of them per worker (oversubscribed threads
        # spin against each other); the processes a test starts set their own
        import torch

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cpus // int(count)))


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.02) -> object:
    """Wait until ``condition()`` is truthy (returning it) or fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class Procs:
    """Starts `python -m zddrl ...` processes; ``stop_all()`` terminates, then kills, every one of them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        # PYTHONFAULTHANDLER: a process that hangs can be made to print every thread's stack (``exit_or_dump``).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "zddrl", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        log.close()
        proc.name = name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def exit_or_dump(self, proc: subprocess.Popen, timeout_s: float, *also: str) -> int:
        """``proc``'s exit status once it exits within ``timeout_s``; else the test fails with its log, every
        thread's stack (SIGABRT, which the fault handler answers) and the logs named in ``also``."""
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        name = proc.name  # type: ignore[attr-defined]
        logs = "\n".join(f"--- {n}.log (last 4,000 characters)\n{self.log(n)[-4000:]}" for n in (name, *also))
        pytest.fail(f"{name} did not exit within {timeout_s} s; its threads and logs:\n{logs}")

    def stop(self, proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def stop_all(self) -> None:
        for proc in self.procs:
            self.stop(proc)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


class BrokerHandle:
    def __init__(self, procs: Procs, tmp_path: Path) -> None:
        self.procs = procs
        self.ports = free_ports(4)
        self.connect = f"tcp://127.0.0.1:{self.ports[0]}"
        self.ready = tmp_path / "broker-ready.json"
        self.proc: subprocess.Popen | None = None

    def start(self, *options: str) -> BrokerHandle:
        """Start `zddrl broker` on this handle's ports (``options``: more of its options, e.g. a profile). On the
        first start, a port another process took between the choice and the bind is replaced: new ports, up to
        three tries (a restart keeps its ports, which its clients know)."""
        tries = 3 if self.proc is None else 1
        for _ in range(tries):
            self._start(*options)
            assert self.proc is not None
            if self.proc.poll() is None or ") is in use" not in self.procs.log("broker"):
                break
            self.ports = free_ports(4)
            self.connect = f"tcp://127.0.0.1:{self.ports[0]}"
        assert self.proc.poll() is None, self.procs.log("broker")
        return self

    def _start(self, *options: str) -> None:
        self.ready.unlink(missing_ok=True)
        _, traj_port, learner_port, params_port = self.ports
        self.proc = self.procs.start(
            "broker",
            "broker",
            *options,
            "--bind",
            self.connect,
            "--trajectory-port",
            str(traj_port),
            "--learner-port",
            str(learner_port),
            "--params-port",
            str(params_port),
            "--ready-file",
            str(self.ready),
            *([] if "--keys" in options else ["--insecure"]),  # the open TCP bus, chosen out loud
        )
        wait_for(lambda: self.ready.exists() or self.proc.poll() is not None, 20, "the broker to bind")

    @property
    def bound_ports(self) -> dict[str, int]:
        return json.loads(self.ready.read_text())

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc)


@pytest.fixture
def broker(procs: Procs, tmp_path: Path) -> BrokerHandle:
    """A real `zddrl broker` process on free loopback ports."""
    return BrokerHandle(procs, tmp_path).start()


class Bus:
    """The test's own ZeroMQ context; owns every link and socket it made and closes them all."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.links: list[BrokerLink] = []
        self.sockets: list[zmq.Socket] = []
        """Held until the test ends: a socket the test dropped would be closed by the garbage collector, with its
        unsent messages (linger 0), whenever that runs."""

    def socket(self, kind: int, **opts: Any) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in opts.items():
            sock.setsockopt(getattr(zmq, name.upper()), value)
        self.sockets.append(sock)
        return sock

    def link(self, connect: str, hello: P.Hello, **kw: Any) -> BrokerLink:
        link = BrokerLink(connect, hello, context=self.ctx, **kw).start()
        self.links.append(link)
        return link

    def close(self) -> None:
        for link in self.links:
            link.close("test over")
        self.ctx.destroy(linger=0)


@pytest.fixture
def bus() -> Iterator[Bus]:
    b = Bus()
    try:
        yield b
    finally:
        b.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts zddrl processes (through ``procs``, which ``broker`` and the brokers of the test
    modules use) is ``slow`` whether or not it says so: ``-m "not slow"`` stays the quick edit-test loop."""
    for item in items:
        if "procs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
