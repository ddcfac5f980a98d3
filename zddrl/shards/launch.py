"""`zddrl learner --gpus 0,1`: which devices, and one shard process per local device, kept honest.

torch-free (imported by the CLI and the benchmarks): ``zddrl.shards.group`` is the torch side.

Each shard is this same command run again with torchrun's variables set (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a shard started by us and one started
by ``torchrun`` are the same thing. The launcher waits for its shards; when one fails, it stops
the others at once (SIGTERM, then SIGKILL after a grace period) and reports which one failed and
how: a group with a dead member never hangs. SIGINT/SIGTERM to the launcher go to every shard.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loguru import logger

from zddrl.config import parse_gpus
from zddrl.proc import die_with_parent, free_ports, stop_processes

SHUTDOWN_GRACE_S = 4.0
"""After SIGTERM, shards get this long to finish (the main one writes its final checkpoint), then SIGKILL.
Shorter than `zddrl train`'s own grace for the launcher, so that the launcher is the one to escalate."""
POLL_S = 0.1
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class DevicePlan:
    """The local shards of one node: one device string per shard."""

    devices: tuple[str, ...]

    @property
    def backend(self) -> str:
        return "nccl" if self.devices[0].startswith("cuda") else "gloo"


def plan_devices(gpus: str, cuda_count: int | None = None) -> DevicePlan:
    """``--gpus`` -> the local shards' devices.

    ``auto``: one shard, ``cuda:0`` when a GPU is visible, else the CPU. ``0,1``: one shard per
    listed GPU. ``cpu`` or ``cpu:N``: N CPU shards. Raises ``ValueError`` with a usable message.
    """
    kind, values = parse_gpus(gpus)
    if kind == "cpu":
        return DevicePlan(("cpu",) * values[0])
    if cuda_count is None:
        import torch  # only the learner asks; the launcher's other users stay torch-free

        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "auto":
        return DevicePlan(("cuda:0",) if cuda_count else ("cpu",))
    bad = [i for i in values if i >= cuda_count]
    if bad:
        seen = f"{cuda_count} CUDA device(s) visible" if cuda_count else "no CUDA device visible"
        raise ValueError(f"--gpus {gpus!r}: GPU {bad[0]} does not exist here ({seen}); use cpu:N for CPU shards")
    return DevicePlan(tuple(f"cuda:{i}" for i in values))


def launched_as_shard(environ: dict[str, str] | None = None) -> bool:
    """True in a process started by a launcher (ours or torchrun) as one shard of a group."""
    env = os.environ if environ is None else environ
    return all(k in env for k in ("RANK", "WORLD_SIZE"))


class LaunchError(RuntimeError):
    """A shard failed; the text says which and how, and that the others were stopped."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the shards of all nodes meet (torch.distributed ``env://``)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    """0: a free port, chosen here (one node only: other nodes could not know it)."""

    def check(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.nnodes > 1 and (not self.master_port or self.master_addr in LOOPBACK):
            raise ValueError(
                "--nnodes > 1 needs --master-addr (node 0's address, not loopback) and --master-port, "
                "the same on every node"
            )


def shard_environments(plan: DevicePlan, rdv: Rendezvous, base: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The environment of each local shard: torchrun's variables, ranks node-major."""
    rdv.check()
    local = len(plan.devices)
    port = rdv.master_port or free_ports(1, rdv.master_addr)[0]
    base = dict(os.environ if base is None else base)
    return [
        {
            **base,
            "RANK": str(rdv.node_rank * local + i),
            "LOCAL_RANK": str(i),
            "WORLD_SIZE": str(rdv.nnodes * local),
            "LOCAL_WORLD_SIZE": str(local),
            "GROUP_RANK": str(rdv.node_rank),
            "MASTER_ADDR": rdv.master_addr,
            "MASTER_PORT": str(port),
        }
        for i in range(local)
    ]


def run_shards(plan: DevicePlan, rdv: Rendezvous, argv: Sequence[str]) -> None:
    """Run ``python -m zddrl *argv`` once per local device as a shard; return when all exited cleanly.

    Raises :class:`LaunchError` as soon as one shard fails (after stopping the others)."""
    envs = shard_environments(plan, rdv)
    procs: list[subprocess.Popen] = []
    stopping: list[int] = []
    stop_at: list[float] = []

    def forward(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        stop_at.append(time.monotonic())
        for p in procs:
            if p.poll() is None:  # a second signal means "now": no more grace
                p.send_signal(signum if len(stopping) == 1 else signal.SIGKILL)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for env in envs:
            procs.append(subprocess.Popen([sys.executable, "-m", "zddrl", *argv], env=env, preexec_fn=die_with_parent))
        logger.info(
            f"started {len(procs)} learner shard(s) on {', '.join(plan.devices)} (ranks "
            f"{envs[0]['RANK']}..{envs[-1]['RANK']} of {envs[0]['WORLD_SIZE']}, backend {plan.backend})"
        )
        while True:
            failed = [(int(env["RANK"]), p) for env, p in zip(envs, procs) if p.poll() not in (None, 0)]
            if failed and not stopping:
                rank, proc = failed[0]
                _stop_all(procs)
                raise LaunchError(
                    f"learner shard {rank} (pid {proc.pid}) exited with code {proc.returncode}; "
                    f"the other shards were stopped. Its log says why; continue the run with "
                    f"--resume --run-dir RUN_DIR"
                )
            if stopping and time.monotonic() - stop_at[0] > SHUTDOWN_GRACE_S:
                logger.warning(
                    f"learner shards still running {SHUTDOWN_GRACE_S:.0f} s after "
                    f"{signal.Signals(stopping[0]).name}: killing them"
                )
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            if all(p.poll() is not None for p in procs):
                if stopping and failed:
                    raise LaunchError(
                        f"stopped by {signal.Signals(stopping[0]).name}; shard(s) "
                        f"{[r for r, _ in failed]} exited with an error"
                    )
                return
            time.sleep(POLL_S)  # a supervisor's poll of its children, not a synchronisation
    finally:
        _stop_all(procs)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stop_all(procs: Sequence[subprocess.Popen]) -> None:
    stop_processes({f"learner shard pid {p.pid}": p for p in procs}, SHUTDOWN_GRACE_S)
