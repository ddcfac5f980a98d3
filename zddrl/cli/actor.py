"""`zddrl actor`: an actor host, or `--procs N` of them (zddrl.actor.host, zddrl.ops.actor_procs)."""

from __future__ import annotations

import click

from zddrl.cli.common import (
    CONNECT_HELP,
    allow_code_option,
    allowed_code,
    connect_list,
    credentials_of,
    key_option,
    keys_option,
    stop_on_signals,
)
from zddrl.transport.link import Refused


@click.command()
@click.option("--connect", required=True, envvar="ZDDRL_CONNECT", callback=connect_list, help=CONNECT_HELP)
@click.option("--envs", type=int, default=None, help="Envs on this host (default: the run's env.num_envs).")
@click.option(
    "--actor-id",
    default="0",
    show_default=True,
    envvar="ZDDRL_ACTOR_ID",
    help="Seeds env i with seed + id*1000 + i; 'auto': the broker assigns the lowest free id (a restarted process "
    "of the same key gets its old one back).",
)
@click.option(
    "--slowdown",
    type=float,
    default=1.0,
    show_default=True,
    help="Testing knob: make this host FACTOR times slower per env step.",
)
@click.option(
    "--env-latency-ms",
    type=click.FloatRange(min=0.0),
    default=0.0,
    show_default=True,
    help="Benchmark knob: every env step sleeps this long first, as a remote or slow simulator would.",
)
@click.option("--max-steps", type=int, default=None, help="Exit after this many env steps.")
@click.option(
    "--procs",
    default="1",
    show_default=True,
    envvar="ZDDRL_PROCS",
    help="Actor processes: N, or 'auto' (one per core), ids --actor-id, --actor-id + 1, ... (or each its own from "
    "the broker with --actor-id auto); one signal stops all.",
)
@allow_code_option("on this host")
@keys_option
@key_option
def actor(connect, envs, actor_id, slowdown, env_latency_ms, max_steps, procs, allow_code, keys_dir, key_name) -> None:
    """Run an actor host: step envs with the newest policy, push trajectories."""
    from zddrl.actor.host import ActorHost
    from zddrl.envs import SlowEnvs
    from zddrl.ops.actor_procs import actor_id_of, child_args, process_count, run_actor_processes

    if envs is not None and envs < 1:
        raise click.UsageError("--envs must be >= 1")
    try:
        first_id = actor_id_of(actor_id)
    except ValueError:
        raise click.UsageError(f"--actor-id takes an id >= 0 or 'auto', got {actor_id!r}") from None
    try:
        count = process_count(procs)
    except ValueError:
        raise click.UsageError(f"--procs takes a count >= 1 or 'auto', got {procs!r}") from None
    allowed = allowed_code(allow_code)
    creds = credentials_of(keys_dir, "actor", key_name)
    if count > 1:
        args = child_args(connect, envs, slowdown, env_latency_ms, max_steps, allow_code, keys_dir, key_name)
        raise SystemExit(run_actor_processes(args, first_id, count, stop_on_signals()))
    try:
        ActorHost(
            connect,
            first_id,
            envs,
            make_envs=SlowEnvs(slowdown, env_latency_ms),
            max_steps=max_steps,
            allowed_code=allowed,
            credentials=creds,
        ).run(stop_on_signals())
    except Refused as exc:
        raise click.ClickException(str(exc)) from None
