"""Process helpers: memory every role reports, free ports, children that die with their parent, the command that
installs an optional extra into this process's environment."""

from __future__ import annotations

import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from loguru import logger

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_statm: tuple[int, int] | None = None
"""(pid, descriptor) of the process's ``/proc/self/statm``, opened once per process (descriptor -1: none)."""


def rss_bytes() -> int:
    """This process's resident set in bytes, read from ``/proc/self/statm`` (the one reader: the broker's memory
    budget reads it ten times a second); 0 where it does not exist (not Linux)."""
    global _statm
    pid = os.getpid()
    if _statm is None or _statm[0] != pid:  # a forked child reads its own, not its parent's
        try:
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY))
        except OSError:
            _statm = (pid, -1)
    if _statm[1] < 0:
        return 0
    return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE  # pread at offset 0 regenerates it: one system call


def rss_mb() -> float:
    """Resident memory now, in MiB (``rss_bytes``; where it reads 0, the peak, which is what getrusage knows)."""
    return rss_bytes() / 2**20 or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000
"""Free ports are chosen from LOWEST_PORT up to the kernel's ephemeral range."""
PORT_RANGE_ENV = "ZDDRL_PORT_RANGE"
"""``LOW-HIGH`` narrows that range to the ports from LOW up to HIGH: processes that choose ports at once, each in a
range of its own, cannot choose the same one (the test suite's parallel workers; their children inherit it)."""


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free TCP ports, held open together while choosing so that they differ.

    A port is chosen by the caller and bound later by another process (a broker `zddrl train` starts): in between,
    any socket that connects may be given it by the kernel as its own local port if it lies in the ephemeral range,
    which is where bind(0) picks from; the bind then fails. So ports are drawn at random below that range (where the
    kernel gives none away), each checked by a bind; bind(0)'s pick only where the range leaves no room below it."""
    low, top = _port_range()
    rng = random.SystemRandom()  # not the random module's seeded stream: two processes draw apart
    socks: list[socket.socket] = []
    try:
        for _ in range(20 * n):
            if len(socks) == n or top - low < 1000:
                break
            s = socket.socket()  # no SO_REUSEADDR: a port any socket holds, even in TIME_WAIT, is passed over
            try:
                s.bind((host, rng.randrange(low, top)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_range() -> tuple[int, int]:
    """Where free ports are drawn: [LOWEST_PORT, the ephemeral range's start), narrowed by PORT_RANGE_ENV."""
    low, top = LOWEST_PORT, _ephemeral_start()
    value = os.environ.get(PORT_RANGE_ENV, "")
    if value:
        try:
            want_low, want_high = (int(part) for part in value.split("-"))
        except ValueError:
            logger.warning(f"{PORT_RANGE_ENV}={value!r} is not LOW-HIGH: ignored")
        else:
            low, top = max(low, want_low), min(top, want_high)
    return low, top


def die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when `zddrl train` dies, even by SIGKILL,
    so that no broker, actor or learner outlives the command (best effort elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def stop_processes(procs: Mapping[str, subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every live process, wait up to ``grace_s`` in all, then SIGKILL those still running."""
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for name, p in procs.items():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning(f"{name} ignored SIGTERM for {grace_s:.0f} s: killing it")
            p.kill()
            p.wait()


def install_command(extra: str) -> str:
    """The command that installs an optional extra: README's, in a checkout (its constraints keep torch the CPU
    build), with the venv's pip and from the checkout's root; pip's plain form for an installed package."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "constraints.txt").is_file():
        return f"pip install 'zddrl[{extra}]'"
    in_venv = Path(sys.prefix).resolve() == (root / ".venv").resolve()
    pip = ".venv/bin/pip" if in_venv else f"{sys.executable} -m pip"
    command = f'{pip} install -c constraints.txt -e ".[{extra}]"'
    return command if Path.cwd().resolve() == root else f"cd {root} && {command}"
