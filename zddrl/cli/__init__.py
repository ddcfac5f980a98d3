"""The ``zddrl`` command line (click). Every command has ``--help``; ZDDRL_* env vars give defaults."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
from pathlib import Path

import click

from zddrl import STARTED_AT, __version__
from zddrl.cli.actor import actor
from zddrl.cli.common import (
    CONNECT_HELP,
    checked_run_dir,
    config_of,
    connect_list,
    credentials_of,
    key_option,
    keys_option,
    overrides_of,
    set_option,
    stop_on_signals,
)
from zddrl.cli.evaluate import eval_cmd
from zddrl.cli.export import export
from zddrl.cli.keys import keys
from zddrl.cli.replay import replay
from zddrl.cli.shards import default_shard_run_dir, launch_shards, run_shard, supervise
from zddrl.config import ConfigError, ipc_endpoint, is_ipc, load_broker_config, private_bus_dir
from zddrl.logs import configure
from zddrl.plugin import importable_from_environment


class _LazyGroup(click.Group):
    """Imports a subcommand's module only when that subcommand runs (or ``--help`` lists it): ``zddrl bench``
    pulls in the benchmark code, which every other command does without."""

    LAZY = {"bench": "zddrl.bench.cli:bench"}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.LAZY])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.LAZY:
            module, attr = self.LAZY[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "ZDDRL"})
@click.version_option(__version__, prog_name="zddrl")
@click.option("--log-level", default="INFO", show_default=True, help="DEBUG, INFO, WARNING or ERROR.")
@click.option("--log-file", default=None, help="Also log to this file (rotated at 50 MB, 5 kept).")
@click.pass_context
def main(ctx: click.Context, log_level: str, log_file: str | None) -> None:
    """zddrl: distributed deep RL on a ZeroMQ bus (broker, actors, learners)."""
    configure(log_level, log_file, role=ctx.invoked_subcommand or "main")
    importable_from_environment()  # code next to the config of the command that started this one


@main.command()
@click.option(
    "--bind",
    default=None,
    help="Control endpoint: tcp://ADDR:PORT (port * = random; without --keys it needs --insecure), or the local bus "
    "ipc://DIR/control (its sockets are files in DIR, which should be owner-only).  [default: profile's, else the "
    "local bus in a fresh owner-only directory, logged and written to --ready-file]",
)
@click.option("--profile", type=click.Path(dir_okay=False), default=None, help="Broker profile TOML (see brokers/).")
@click.option("--trajectory-port", type=int, default=None, help="Trajectory PULL port (default control+1).")
@click.option("--learner-port", type=int, default=None, help="Learner ROUTER port (default control+2).")
@click.option("--params-port", type=int, default=None, help="Parameter PUB port (default control+3).")
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the bound ports as JSON here once serving (for scripts and tests).",
)
@keys_option
@click.option(
    "--key",
    "key_name",
    default=None,
    envvar="ZDDRL_BROKER_KEY",
    help="Which broker pair in --keys/broker/ this broker serves with (needed when it holds several secrets). A "
    "relay's broker/ holds its own pair and its upstream's public key (docs/security.md, \"Relays\").",
)
@click.option(
    "--insecure",
    is_flag=True,
    default=None,
    help="The open TCP bus: allow a tcp:// --bind without --keys. Anyone who reaches the ports (on 127.0.0.1: every "
    'local user) can join, inject, read and exhaust the bus (docs/security.md, "Local runs").',
)
@click.option(
    "--upstream",
    envvar="ZDDRL_UPSTREAM",
    default=None,
    help="Run as a relay under the broker at tcp://ROOT:PORT (or a fallback list A,B): its actors' trajectories go "
    "there with credit end to end, parameters come from there (docs/architecture.md).  [default: profile's, else "
    "none: a root broker]",
)
@click.option(
    "--upstream-window",
    type=int,
    default=None,
    help="Relay: trajectories pushed upstream and unacknowledged at most (0 = 2 x the actors' windows).",
)
@click.option(
    "--peer",
    envvar="ZDDRL_PEER",
    default=None,
    help="The other broker of a standby pair, tcp://HOST:PORT: only the active one takes clients (docs/deploying.md, "
    '"A standby broker"; on a closed bus --keys must hold a monitor key for the probe).  [default: none]',
)
@click.option(
    "--peer-role",
    type=click.Choice(["primary", "backup"]),
    default=None,
    help="With --peer: a primary starts active unless its peer is; a backup takes over when the peer is silent.",
)
def broker(
    bind,
    profile,
    trajectory_port,
    learner_port,
    params_port,
    ready_file,
    keys_dir,
    key_name,
    insecure,
    upstream,
    upstream_window,
    peer,
    peer_role,
) -> None:
    """Run the broker (or, with --upstream, a relay): routes trajectories to learners and parameters to actors."""
    from zddrl.broker.broker import Broker
    from zddrl.broker.sockets import BindError
    from zddrl.broker.upstream import RelayRefused

    bus_dir = None
    try:
        config = load_broker_config(
            profile,
            {
                "bind": bind,
                "trajectory_port": trajectory_port,
                "learner_port": learner_port,
                "params_port": params_port,
                "keys": keys_dir,
                "insecure": insecure,
                "upstream": upstream,
                "upstream_window": upstream_window,
                "peer": peer,
                "peer_role": peer_role,
            },
        )
        if key_name is not None and not config.keys:
            raise ConfigError("--key names a broker key in --keys: give --keys DIR too")
        config, bus_dir = local_default(config)
        credentials = relay_credentials(config, key_name) if config.upstream else None
        b = Broker(config, credentials=credentials, key=key_name)
    except ConfigError as exc:
        if bus_dir is not None:
            shutil.rmtree(bus_dir, ignore_errors=True)
        raise click.UsageError(str(exc)) from None
    stop = stop_on_signals()
    try:
        try:
            ports = b.bind()
        except (BindError, ConfigError) as exc:  # a port taken, a bad bind port: one line, no traceback
            raise click.ClickException(str(exc)) from None
        if ready_file:  # the ports; on the local bus the control endpoint (its siblings are beside it)
            Path(ready_file).write_text(json.dumps({"endpoint": config.bind} if is_ipc(config.bind) else ports))
        try:
            b.run(stop)
        except RelayRefused as exc:
            raise click.ClickException(str(exc)) from None
    finally:
        b.close()
        if bus_dir is not None:
            shutil.rmtree(bus_dir, ignore_errors=True)


def local_default(config):
    """The broker's bus when no bind was chosen (``broker.bind = ""``): the local bus in a fresh owner-only directory
    (returned, to remove at exit). A tcp:// bind without keys is the open TCP bus: only with ``insecure``
    (ConfigError else)."""
    if not config.bind:
        directory = private_bus_dir()
        return dataclasses.replace(config, bind=ipc_endpoint(directory)), directory
    if is_ipc(config.bind) and not config.keys:
        directory = Path(config.bind.removeprefix("ipc://")).parent
        if directory.is_dir() and directory.stat().st_mode & 0o077:
            click.echo(
                f"warning: {directory} is open to other users (mode {directory.stat().st_mode & 0o777:o}): any of "
                "them can join this bus; chmod 700 it",
                err=True,
            )
    if not is_ipc(config.bind) and not config.keys and not config.insecure:
        raise ConfigError(
            f"broker: binding {config.bind} without keys is the open TCP bus: anyone who reaches it (on loopback, "
            "every local user) can join, inject, read and exhaust it; bind the local bus (no --bind, or --bind "
            "ipc://DIR/control), or pass --keys DIR (docs/security.md), or --insecure to choose the open TCP bus"
        )
    return config, None


def relay_credentials(config, key_name: str | None = None):
    """A relay's client keys towards its upstream (its ``relay`` key and the upstream's public key in its --keys
    directory, beside its own broker pair ``key_name``: ``keys.relay_credentials``), None on an open bus."""
    from zddrl.keys import KeysError
    from zddrl.keys import relay_credentials as of_relay

    if not config.keys:
        return None
    try:
        return of_relay(config.keys, key_name)
    except KeysError as exc:
        raise click.UsageError(f"--keys: {exc}") from None


GPUS_HELP = (
    "Learner shards: 'auto' (one; GPU 0 if any, else CPU), GPU indices '0,1' (a shard each), or 'cpu:N'. "
    "Overrides learner.gpus."
)


@main.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.option("--connect", required=True, envvar="ZDDRL_CONNECT", callback=connect_list, help=CONNECT_HELP)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Run directory (default: train.run_dir/NAME-TIME).",
)
@click.option("--algorithm", default=None, help="Overrides algo.name (ppo, impala, apex, sac or module:ATTR).")
@click.option("--schedule", type=click.Choice(["sync", "async"]), default=None, help="Overrides algo.schedule.")
@click.option("--seed", type=int, default=None, help="Overrides env.seed.")
@click.option("--gpus", default=None, envvar="ZDDRL_GPUS", help=GPUS_HELP)
@click.option("--shards", type=click.IntRange(1, 64), default=None, help="N CPU shards: the same as --gpus cpu:N.")
@click.option(
    "--nnodes",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    envvar="ZDDRL_NNODES",
    help="Nodes in the learner group (multi-node: the same command on every node).",
)
@click.option(
    "--node-rank",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    envvar="ZDDRL_NODE_RANK",
    help="This node's index, 0..nnodes-1.",
)
@click.option(
    "--master-addr",
    default="127.0.0.1",
    show_default=True,
    envvar="ZDDRL_MASTER_ADDR",
    help="Rendezvous host (node 0's address) for torch.distributed.",
)
@click.option(
    "--master-port",
    type=click.IntRange(0, 65535),
    default=0,
    envvar="ZDDRL_MASTER_PORT",
    help="Rendezvous port; 0 picks a free one (one node only).",
)
@click.option("--t0", type=float, default=None, hidden=True, help="Epoch time the whole command started.")
@click.option("--resume", is_flag=True, help="Continue the run in --run-dir from its newest checkpoint.")
@click.option(
    "--restart",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    metavar="N",
    help="When the learner (or a shard of it) dies, restart it from the newest checkpoint in --run-dir "
    "(afresh if none yet), at most N times, with back-off. This process then supervises the "
    "learner as a child process; it restarts nothing if it is killed itself.",
)
@click.option(
    "--replay",
    "replays",
    default="",
    envvar="ZDDRL_REPLAY",
    help="replay.placement = 'service': the replay services to sample from, tcp://HOST:PORT[,tcp://HOST2:PORT].",
)
@click.option(
    "--replay-key",
    default=None,
    envvar="ZDDRL_REPLAY_KEY",
    help="Closed bus: which key in --keys/replays/ the replay services serve with (needed when it holds several).",
)
@keys_option
@key_option
@set_option
def learner(
    config_path,
    connect,
    run_dir,
    algorithm,
    schedule,
    seed,
    gpus,
    shards,
    nnodes,
    node_rank,
    master_addr,
    master_port,
    t0,
    resume,
    restart,
    replays,
    replay_key,
    keys_dir,
    key_name,
    sets,
) -> None:
    """Run the learner on CONFIG: publish the run, train, publish parameters.

    With several devices (--gpus 0,1, --gpus cpu:2, --shards 2) or nodes (--nnodes), this process
    starts one shard process per local device and supervises them; under torchrun (RANK and
    WORLD_SIZE set) it is one shard itself. With --restart N it runs all that as a child process and
    restarts it when it dies (ops/restart.py says why a child and what that covers)."""
    from zddrl.shards.launch import launched_as_shard, plan_devices

    _check_learner_options(run_dir, resume, gpus, shards, restart, nnodes)
    if shards is not None:
        gpus = f"cpu:{shards}"
    creds = credentials_of(keys_dir, "learner", key_name)  # checked before any shard or child starts
    config = config_of(
        config_path,
        overrides_of(
            sets, **{"algo.name": algorithm, "algo.schedule": schedule, "env.seed": seed, "learner.gpus": gpus}
        ),
    )
    run_dir = run_dir or str(default_shard_run_dir(config))
    if restart:  # before plan_devices, which imports torch: the supervisor stays small
        checked_run_dir(config, Path(run_dir), resume)
        supervise(restart, Path(run_dir), t0, config.train.max_seconds)
        return
    try:
        plan = plan_devices(config.learner.gpus)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if os.environ.get("RANK", "0") == "0":  # the launcher, a lone learner, or shard 0 under torchrun
        checked_run_dir(config, Path(run_dir), resume)
    if not launched_as_shard():
        if len(plan.devices) > 1 or nnodes > 1:
            launch_shards(plan, nnodes, node_rank, master_addr, master_port, run_dir)
            return
    replay = _replay_link(config, replays, keys_dir, replay_key)
    run_shard(config, plan, connect, run_dir, t0, resume, creds, replay)


def _check_learner_options(run_dir, resume: bool, gpus, shards, restart: int, nnodes: int) -> None:
    """The learner's options that cannot go together: one usage error each."""
    from zddrl.shards.launch import launched_as_shard

    if resume and not run_dir:
        raise click.UsageError("--resume needs --run-dir (the run to continue)")
    if gpus is not None and shards is not None:
        raise click.UsageError("give --gpus or --shards, not both")
    if restart and launched_as_shard():
        raise click.UsageError(
            "--restart supervises a learner this command starts; under torchrun use its "
            "--max-restarts (each restart then needs --resume)"
        )
    if restart and nnodes > 1:
        raise click.UsageError("--restart supports one node: the nodes of a group would have to restart together")


def _replay_link(config, replays: str, keys_dir: str | None, replay_key: str | None) -> tuple[tuple[str, ...], bytes]:
    """The replay endpoints and (closed bus) their public key for a service-placement run; usage errors else."""
    from zddrl.algos.spec import algorithm_of

    endpoints = tuple(e.strip() for e in replays.split(",") if e.strip())
    service = config.replay.placement == "service" and algorithm_of(config).replay
    if service and not endpoints:
        raise click.UsageError("replay.placement = 'service' needs --replay tcp://HOST:PORT (a `zddrl replay`)")
    if endpoints and not service:
        raise click.UsageError("--replay is for apex/sac runs with replay.placement = 'service'")
    if not endpoints or keys_dir is None:
        return endpoints, b""
    from zddrl.keys import KeysError, public_key

    try:
        return endpoints, public_key(keys_dir, "replay", replay_key)
    except KeysError as exc:
        raise click.UsageError(f"--keys: {exc}") from None


@main.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.option("--actors", type=int, default=None, help="Actor processes (overrides train.actors).")
@click.option("--seed", type=int, default=None, help="Overrides env.seed.")
@click.option("--algorithm", default=None, help="Overrides algo.name (ppo, impala, apex, sac or module:ATTR).")
@click.option("--schedule", type=click.Choice(["sync", "async"]), default=None, help="Overrides algo.schedule.")
@click.option("--until-return", type=float, default=None, help="Stop at this target return (train.target_kind).")
@click.option("--max-steps", type=int, default=None, help="Stop after this many env steps.")
@click.option("--max-seconds", type=float, default=None, help="Stop after this many seconds.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None, help="Exact run directory to write.")
@click.option("--gpus", default=None, envvar="ZDDRL_GPUS", help=GPUS_HELP)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Continue this run directory from its newest checkpoint (metrics append).",
)
@click.option(
    "--secure",
    is_flag=True,
    help="Close the bus with throwaway keys too: CURVE on every socket, signed parameters (docs/security.md).",
)
@click.option(
    "--open-tcp",
    is_flag=True,
    help="The open TCP bus: the processes meet on loopback ports, which every local user can reach (join, inject, "
    "read). Default: the local bus, ipc sockets in an owner-only directory that only you can connect to "
    '(docs/security.md, "Local runs").',
)
@set_option
def train(
    config_path,
    actors,
    seed,
    algorithm,
    schedule,
    until_return,
    max_steps,
    max_seconds,
    run_dir,
    gpus,
    resume_dir,
    secure,
    open_tcp,
    sets,
) -> None:
    """Run broker, actors and learner on this machine until the first limit is reached.

    They talk over the local bus (ipc sockets in an owner-only directory, removed at the end: no other local user
    can connect) unless --open-tcp."""
    from zddrl.ops.train import run_training

    config = config_of(
        config_path,
        overrides_of(
            sets,
            **{
                "train.actors": actors,
                "env.seed": seed,
                "algo.name": algorithm,
                "algo.schedule": schedule,
                "train.until_return": until_return,
                "train.max_steps": max_steps,
                "train.max_seconds": max_seconds,
                "learner.gpus": gpus,
            },
        ),
        check_env=False,  # run_training probes the env once the learner has started: the learner starts sooner
    )
    checked_run_dir(config, Path(resume_dir or run_dir) if (resume_dir or run_dir) else None, bool(resume_dir))
    summary = run_training(
        config, run_dir=resume_dir or run_dir, t0=STARTED_AT, resume=bool(resume_dir), secure=secure, open_tcp=open_tcp
    )
    click.echo(json.dumps(summary))


@main.command()
@click.option("--connect", required=True, envvar="ZDDRL_CONNECT", callback=connect_list, help=CONNECT_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the broker's status as JSON.")
@click.option("--watch", is_flag=True, help="Keep a live table on screen, refreshed every --interval seconds.")
@click.option("--interval", type=float, default=1.0, show_default=True, help="Refresh period of --watch.")
@click.option("--timeout", type=float, default=3.0, show_default=True, help="Seconds to wait for the broker.")
@click.option(
    "--page",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Page of the member rows (a large fleet's members come in pages of at most 500; the counts cover all).",
)
@keys_option
@key_option
def status(connect, as_json, watch, interval, timeout, page, keys_dir, key_name) -> None:
    """Print the broker's counters, members, drops and health warnings."""
    from zddrl.ops.status import ask_status, format_status, watch_status

    creds = credentials_of(keys_dir, "monitor", key_name)
    if watch:
        watch_status(connect, interval, timeout, creds, page=page)
        return
    body, why = ask_status(connect, timeout, credentials=creds, page=page)
    if body is None:  # why: a refused handshake or request; "" when nothing answered in time
        raise click.ClickException(why or f"no answer from a broker at {connect} within {timeout} s")
    click.echo(json.dumps(body, indent=2) if as_json else format_status(body))


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="PNG file to write.")
def plot(run_dirs, output) -> None:
    """Plot return vs env steps and vs wall time, SPS and staleness of one or more runs (overlaid)."""
    from zddrl.ops.plot import plot_runs

    plot_runs([Path(d) for d in run_dirs], Path(output))
    click.echo(output)


main.add_command(keys)
main.add_command(replay)
main.add_command(export)
main.add_command(eval_cmd)
main.add_command(actor)
