"""`zddrl actor --procs N`: N actor processes from one command, one per core by default, each with an id of its own
(``--actor-id`` and the next N-1, or with ``--actor-id auto`` each the one the broker assigns it: ids place the
seed streams), all stopped by one signal.

One process per core, not threads: an actor host steps its envs and runs its policy on one core (numpy or torch on
one thread), and Python runs one thread at a time. The children are plain `zddrl actor` processes with
``--procs 1``; each dies with this one, even when it is killed with SIGKILL (``proc.die_with_parent``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from loguru import logger

from zddrl.proc import die_with_parent, stop_processes

STOP_GRACE_S = 15.0
"""How long the children have to leave their runs cleanly after a stop before they are killed."""


def process_count(procs: str) -> int:
    """``--procs``: ``auto`` (this machine's cores) or a count >= 1; ValueError otherwise."""
    if procs == "auto":
        return max(1, os.cpu_count() or 1)
    count = int(procs)
    if count < 1:
        raise ValueError("--procs must be >= 1 or auto")
    return count


def actor_id_of(text: str) -> int | None:
    """``--actor-id``: an id >= 0, or None for ``auto`` (the broker assigns it); ValueError otherwise."""
    if text == "auto":
        return None
    actor_id = int(text)
    if actor_id < 0:
        raise ValueError("--actor-id must be >= 0 or auto")
    return actor_id


def run_actor_processes(args: list[str], first_id: int | None, count: int, stop: threading.Event) -> int:
    """Start ``zddrl actor ARGS --actor-id I --procs 1`` for I in ``first_id .. first_id + count - 1`` (``first_id``
    None: ``--actor-id auto`` for each) and wait until all have ended or ``stop`` is set (then stop them); the
    highest exit code."""
    ids = ["auto"] * count if first_id is None else [str(i) for i in range(first_id, first_id + count)]
    procs = {
        f"actor-{n}": subprocess.Popen(
            [sys.executable, "-m", "zddrl", "actor", *args, "--actor-id", actor_id, "--procs", "1"],
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        for n, actor_id in enumerate(ids)
    }
    named = "assigned by the broker" if first_id is None else f"{first_id}..{first_id + count - 1}"
    logger.info(f"{count} actor processes started, ids {named}")
    while not stop.is_set() and any(p.poll() is None for p in procs.values()):
        time.sleep(0.2)
    stop_processes(procs, STOP_GRACE_S)
    codes = [p.returncode for p in procs.values()]
    return max((128 - c if c < 0 else c for c in codes if c), default=0)  # killed by signal S: 128 + S, as shells


def child_args(
    connect: str,
    envs: int | None,
    slowdown: float,
    env_latency_ms: float,
    max_steps: int | None,
    allow_code: tuple[str, ...],
    keys_dir: str | None,
    key_name: str | None,
) -> list[str]:
    """The `zddrl actor` options each child gets: this command's own, as given."""
    args = ["--connect", connect, "--slowdown", repr(slowdown), "--env-latency-ms", repr(env_latency_ms)]
    args += ["--envs", str(envs)] if envs is not None else []
    args += ["--max-steps", str(max_steps)] if max_steps is not None else []
    args += [a for ref in allow_code for a in ("--allow-code", ref)]
    args += ["--keys", keys_dir] if keys_dir else []
    args += ["--key", key_name] if key_name else []
    return args
