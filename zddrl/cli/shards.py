"""`zddrl learner` beyond one process: the supervisor of --restart, the launcher of one shard per device, and a
shard's own run."""

from __future__ import annotations

import json
from pathlib import Path

import click

from zddrl import STARTED_AT
from zddrl.cli.common import stop_on_signals
from zddrl.config import ConfigError
from zddrl.transport.link import Refused


def default_shard_run_dir(config) -> Path:
    from zddrl.ops.train import default_run_dir

    return default_run_dir(config)


class _ExitWith(click.ClickException):
    """A ClickException with the exit code of the failure it reports."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares it on the class


def supervise(restarts: int, run_dir: Path, t0: float | None, max_seconds: float) -> None:
    """``zddrl learner --restart N``: this same command line, run as a child and restarted when it dies."""
    import sys

    from zddrl.ops.restart import SupervisorError, supervise_learner

    try:
        supervise_learner(sys.argv[1:], run_dir, STARTED_AT if t0 is None else t0, restarts, max_seconds)
    except SupervisorError as exc:
        raise _ExitWith(str(exc), exc.exit_code) from None  # a usage error of the learner stays exit 2


def launch_shards(plan, nnodes, node_rank, master_addr, master_port, run_dir) -> None:
    """Re-run this command once per local device as a shard (same arguments, one run directory)."""
    import sys

    from zddrl.shards.launch import LaunchError, Rendezvous, run_shards

    argv = list(sys.argv[1:])
    if "--run-dir" not in argv:  # every shard must agree on the (default, time-stamped) directory
        argv += ["--run-dir", run_dir]
    try:
        run_shards(plan, Rendezvous(nnodes, node_rank, master_addr, master_port), argv)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    except LaunchError as exc:
        raise click.ClickException(str(exc)) from None


def run_shard(config, plan, connect, run_dir, t0, resume, creds, replay=((), b"")) -> None:
    """This process is the learner, or one shard of it: join the group, train, leave the group."""
    import torch

    from zddrl.learner.node import LearnerNode, NotJoined
    from zddrl.learner.runlog import CheckpointError
    from zddrl.shards.group import ShardError, ShardGroup

    # Adam's second moments of rarely-moving weights decay into subnormal floats, which x86 computes many times
    # slower: a third of an Ape-X gradient step went to two foreach kernels (profiled). Flushing them is a setting
    # of the whole process (numpy's arithmetic too), so the learner process makes it, not the library.
    torch.set_flush_denormal(True)

    try:
        group = ShardGroup.from_env(plan, config.learner.collective_timeout_s)
    except ShardError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        replays, replay_public = replay
        node = LearnerNode(
            connect,
            config,
            run_dir,
            t0=t0,
            resume=resume,
            group=group,
            credentials=creds,
            replays=replays,
            replay_public=replay_public,
        )
        summary = node.run(stop_on_signals())
    except (ConfigError, CheckpointError) as exc:  # usage errors: `zddrl train` never restarts a learner for them
        raise click.UsageError(str(exc)) from None
    except (Refused, ShardError, NotJoined) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        group.close()
    if group.is_main:
        click.echo(json.dumps(summary))
