"""`zddrl train`: broker, N actor processes and the learner on this machine, with one command.

Every role runs as its own process through the same CLI commands used across hosts. They talk over the local bus:
``ipc://`` sockets in a fresh owner-only directory (``config.private_bus_dir``, removed when the run ends), which no
other local user can connect to; ``open_tcp`` puts them on free loopback ports instead, open to every local user
(docs/security.md, "Local runs"). All processes start at once (ZeroMQ connects before the broker binds and retries),
the learner decides when the run is over (first limit reached), and everything is shut down in
a ``finally`` (SIGTERM, then SIGKILL after a grace period): no orphans, also on Ctrl-C.

A learner (or shard group) that dies is restarted from the run's newest checkpoint, at most
``train.max_restarts`` times with back-off (ops/restart.py); broker and actors stay up meanwhile and
follow the restarted learner's run. Its log goes on in the same ``logs/learner.log``, after a line
that says which restart it is and why. With ``replay.placement = "service"`` a replay service (`zddrl replay`)
runs too and keeps the buffer across such restarts (its state under ``RUN_DIR/replay``).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import click
from loguru import logger

from zddrl import plugin
from zddrl.algos.spec import algorithm_of
from zddrl.config import Config, ConfigError, TrainConfig, ipc_endpoint, private_bus_dir, to_toml
from zddrl.keys import new_key
from zddrl.learner.progress import progress_line
from zddrl.learner.runlog import latest_checkpoint
from zddrl.learner.tensorboard import TB_DIR
from zddrl.ops.filming import Filming
from zddrl.ops.restart import (
    RestartBudget,
    describe_restart,
    exit_cause,
    give_up_message,
    log_tail,
    overdue,
    own_group_dying_with_parent,
    restartable,
    resume_point,
    wait_for_group,
)
from zddrl.proc import die_with_parent, free_ports, install_command, stop_processes

SHUTDOWN_GRACE_S = 5.0
VIDEO_WAIT_S = 120.0
"""How long the videos at the run's end (one in progress, the final policy's) may take (``train.video_max_steps``
bounds each)."""
PROGRESS_EVERY_S = 0.5


def default_run_dir(config: Config) -> Path:
    return Path(config.train.run_dir) / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}-s{config.env.seed}"


class LocalProcesses:
    """The processes of one local run; ``stop()`` ends every one of them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(
        self, name: str, args: list[str], banner: str = "", own_group: bool = False, nice: int = 0
    ) -> subprocess.Popen:
        """Start ``zddrl *args`` as ``name``; with a ``banner`` (a restart), its log goes on after that line;
        ``own_group``: in a process group of its own (the learner's, with its shards: ops/restart.py); ``nice``:
        added to its niceness (``train.actor_nice``)."""
        log = open(self.log_dir / f"{name}.log", "a" if banner else "w")
        if banner:
            log.write(f"\n---- {time.strftime('%H:%M:%S')} {banner} ----\n")
            log.flush()
        cmd = [sys.executable, "-m", "zddrl", "--log-file", str(self.log_dir / f"{name}.loguru.log"), *args]
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=own_group_dying_with_parent if own_group else partial(_nice_dying_with_parent, nice),
        )
        log.close()
        self.procs[name] = proc
        return proc

    def wind_down(self, keep: str) -> None:
        """SIGTERM every process but ``keep`` (``stop()`` later waits for them)."""
        for name, p in self.procs.items():
            if name != keep and p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def dead(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None and p.returncode != 0]

    def stop(self) -> None:
        stop_processes(self.procs, SHUTDOWN_GRACE_S)


def _nice_dying_with_parent(nice: int) -> None:
    die_with_parent()
    if nice:
        os.nice(nice)


def _last_row(metrics: Path) -> dict[str, str] | None:
    """The header and the last row of metrics.csv, reading only its end (the file grows all run)."""
    try:
        with open(metrics, "rb") as f:
            header = f.readline()
            f.seek(0, 2)
            f.seek(max(len(header), f.tell() - 4096))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    if not header or not lines or not lines[-1].strip():
        return None
    rows = list(csv.DictReader([header.decode(), lines[-1].decode()]))
    return rows[0] if rows and rows[0].get("env_steps") else None


def progress_from_metrics(metrics: Path, t0: float) -> str | None:
    """The progress line of the newest row of a run's metrics.csv (None before the first update)."""
    r = _last_row(metrics)
    if r is None:
        return None
    ret = float(r["return_mean_20"]) if r["return_mean_20"] else math.nan
    return progress_line(time.time() - t0, int(r["env_steps"]), float(r["sps"]), ret, r["policy_version"])


class FinishWatch:
    """Tells, from summary.json, when the learner has finished the run (limit or target reached) while it still writes
    its final checkpoint and exits: the broker and the actors are stopped then, in parallel with the learner's
    last writes, instead of after them (their shutdown was ~1-2 s of the command's wall time on 2 cores). A summary
    that was there before (``--resume``) or that a crashing learner wrote does not count: a crash is restarted."""

    def __init__(self, path: Path, train: TrainConfig) -> None:
        self.path, self.train = path, train
        self.seen = self._mtime()

    def _mtime(self) -> int | None:
        try:
            return self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return None

    def finished(self) -> bool:
        mtime = self._mtime()
        if mtime == self.seen:
            return False
        self.seen = mtime
        try:
            s = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return False
        t = self.train
        return (
            bool(s.get("reached")) or s.get("total_env_steps", 0) >= t.max_steps or s.get("wall_s", 0) >= t.max_seconds
        )


def throwaway_keys() -> Path:
    """A fresh key directory for one secured local run (``zddrl train --secure``): a broker, a learner, an actor,
    a monitor and a replay key, made with ``keys.new_key``; the caller removes it when the run ends."""
    root = Path(tempfile.mkdtemp(prefix="zddrl-keys-"))
    for role in ("broker", "learner", "actor", "monitor", "replay"):
        new_key(root, role, role)
    return root


class LocalBus:
    """Where the processes of one local run meet: the broker's ``connect`` endpoint, its options (``broker_args``)
    and the replay service's endpoint (``replay``, "" without one). By default the local bus, ``ipc://`` sockets in
    a fresh owner-only directory (``directory``; ``close`` removes it); ``open_tcp``: free loopback ports."""

    def __init__(self, open_tcp: bool, replay: bool) -> None:
        self.directory: Path | None = None
        if open_tcp:
            control, traj, learn, params, replay_port = free_ports(5)
            self.connect = f"tcp://127.0.0.1:{control}"
            ports = ["--trajectory-port", str(traj), "--learner-port", str(learn), "--params-port", str(params)]
            # the open TCP bus, chosen out loud: `zddrl broker` refuses a TCP bind without keys or --insecure
            self.broker_args = ["--bind", self.connect, *ports, "--insecure"]
            self.replay = f"tcp://127.0.0.1:{replay_port}" if replay else ""
        else:
            self.directory = private_bus_dir()
            self.connect = ipc_endpoint(self.directory)
            self.broker_args = ["--bind", self.connect]
            self.replay = ipc_endpoint(self.directory, "replay") if replay else ""
        self.kind = "local (ipc, owner-only directory)" if self.directory else "open (TCP on loopback)"

    def close(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def _start(
    procs: LocalProcesses,
    config: Config,
    bus: LocalBus,
    learner_args: list[str],
    resume: bool,
    keys: list[str],
    run_dir: Path = Path("."),
) -> subprocess.Popen:
    """The broker (on ``bus``), a replay service (on ``bus.replay``, if any; its state in ``run_dir/replay``), the
    learner (in a process group of its own, with its shards) and the actors, all with the ``keys`` options; returns
    the learner."""
    connect = bus.connect
    procs.start("broker", ["broker", *bus.broker_args, *keys])
    if bus.replay:  # before the learner, which samples from it (ZeroMQ waits for the bind either way)
        allow = allow_own_code(config)  # the user's own code (see the actors below)
        bind = bus.replay
        state = ["--state-dir", str(run_dir / "replay")]
        procs.start("replay", ["replay", "--connect", connect, "--bind", bind, *state, *allow, *keys])
    learner = procs.start("learner", [*learner_args, *(["--resume"] if resume else [])], own_group=True)
    slowdowns = config.train.slowdowns
    for i in range(config.train.actors):
        slow = ["--slowdown", str(slowdowns[i])] if i < len(slowdowns) and slowdowns[i] > 1 else []
        if config.train.env_latency_ms > 0:
            slow += ["--env-latency-ms", repr(config.train.env_latency_ms)]
        allow = allow_own_code(config)
        actor = ["actor", "--connect", connect, "--actor-id", str(i), *slow, *allow, *keys]
        procs.start(f"actor-{i}", actor, nice=config.train.actor_nice)
    return learner


def allow_own_code(config: Config) -> list[str]:
    """``--allow-code`` for each piece of code the user's own config names (env, algorithm, model): the processes
    this command starts may import it, where a host joining from the network would have to allow it itself."""
    return [arg for ref in config.references() for arg in ("--allow-code", ref)]


def run_training(
    config: Config,
    run_dir: str | Path | None = None,
    show_progress: bool = True,
    t0: float | None = None,
    resume: bool = False,
    secure: bool = False,
    open_tcp: bool = False,
) -> dict[str, Any]:
    """Run the whole system locally until the learner stops; return its summary.

    ``t0`` (epoch seconds) is when the command started; wall-clock figures count from it. The processes meet on
    the local bus (``LocalBus``), or with ``open_tcp`` on loopback TCP ports any local user can reach. ``secure``:
    the bus is closed with throwaway keys too (CURVE on every socket, signed parameters), removed when the run ends.
    """
    t0 = time.time() if t0 is None else t0
    run_dir = Path(run_dir) if run_dir else default_run_dir(config)
    fresh = _open_run_dir(config, run_dir)
    log_dir = run_dir / "logs"
    service = bool(algorithm_of(config).replay) and config.replay.placement == "service"
    bus = LocalBus(open_tcp, replay=service)
    connect = bus.connect
    procs = LocalProcesses(log_dir)
    budget = RestartBudget(config.train.max_restarts)
    key_dir = throwaway_keys() if secure else None
    keys = ["--keys", str(key_dir)] if key_dir is not None else []
    learner_args = _learner_args(run_dir, connect, keys, bus.replay)
    restart = partial(_restart_learner, procs, budget, learner_args, run_dir, t0)
    refused = interrupted = False
    filming = Filming(run_dir, config.train, allow_own_code(config)) if config.train.video_every else None
    try:
        learner = _start(procs, config, bus, [*learner_args, "--t0", repr(t0)], resume, keys, run_dir)
        refused = fresh  # until the env passed: a run refused before anything ran leaves no directory behind
        if not algorithm_of(config).replay:
            _check_env(config)  # after the start: the learner, on the critical path, need not wait for this probe
        refused = False
        kind = f"{bus.kind}, closed (CURVE, throwaway keys)" if secure else bus.kind
        logger.info(f"run {run_dir}: broker {connect}, {config.train.actors} actors, learner; the bus is {kind} "
                    f"(logs in {log_dir}; zddrl status --connect {connect})")  # fmt: skip
        logger.info(tensorboard_hint(run_dir))
        learner = _watch(procs, learner, config, run_dir, t0, show_progress, restart, filming)
        if filming is not None:
            filming.finish(VIDEO_WAIT_S)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if filming is not None:
            filming.stop()
        procs.stop()  # on Ctrl-C, the learner's clean stop writes its final checkpoint: what the message names
        if key_dir is not None:
            shutil.rmtree(key_dir, ignore_errors=True)
        bus.close()
        if refused:
            shutil.rmtree(run_dir, ignore_errors=True)
    if interrupted:
        click.echo(interrupted_message(run_dir), err=True)
        raise click.exceptions.Exit(130)  # 128 + SIGINT, as a shell reports it; not click's "Aborted!"
    return _summary(learner, run_dir, t0, budget.used)


def _open_run_dir(config: Config, run_dir: Path) -> bool:
    """Check what can be checked before anything is written, then make the run directory with its config and log
    folder. Returns whether this command made it: a directory it made is removed again if the env is refused after
    the start (nothing ran)."""
    _check_env_id(config)  # a misspelt env id: one line, before anything is written
    if algorithm_of(config).replay:  # a buffer that cannot fit must not cost a learner's failed starts
        _check_env(config)
    if config.train.video_every and importlib.util.find_spec("imageio_ffmpeg") is None:
        raise click.UsageError(f"train.video_every films the run: it needs the video extra, {install_command('video')}")
    fresh = not run_dir.exists()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(plugin.record() + to_toml(config.to_dict()))
    return fresh


def tensorboard_hint(run_dir: Path) -> str:
    """How to watch the run in TensorBoard, or how to get it: on the console, where the user looks first (the
    learner's own line about it goes to its log)."""
    if importlib.util.find_spec("tensorboard") is None:
        return (
            f"no TensorBoard events for this run: {install_command('tensorboard')} "
            "(metrics.csv and `zddrl plot` work without)"
        )
    return f"TensorBoard: tensorboard --logdir {run_dir / TB_DIR}"


def _learner_args(run_dir: Path, connect: str, keys: list[str], replay: str) -> list[str]:
    """`zddrl learner` of the run: its config.toml, the local broker, the keys, the replay service if any."""
    args = ["learner", str(run_dir / "config.toml"), "--connect", connect, "--run-dir", str(run_dir), *keys]
    return [*args, "--replay", replay] if replay else args


def interrupted_message(run_dir: Path) -> str:
    """What a Ctrl-C of `zddrl train` leaves, and how to go on: one line."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return f"interrupted before the first checkpoint: nothing to resume in {run_dir} (logs in {run_dir / 'logs'})"
    return (
        f"interrupted: the run is saved in {run_dir}, newest checkpoint {checkpoint.name}; "
        f"resume with: zddrl train {run_dir / 'config.toml'} --resume {run_dir}"
    )


def _watch(
    procs: LocalProcesses,
    learner: subprocess.Popen,
    config: Config,
    run_dir: Path,
    t0: float,
    show_progress: bool,
    restart: Callable[[subprocess.Popen], tuple[subprocess.Popen, float]],
    filming: Filming | None = None,
) -> subprocess.Popen:
    """Watch the run until the learner stops for good: restart it when it may be (``restart``), wind the others
    down when the run is over, stop at ``train.max_seconds``, film (``filming``), print progress; return the last
    learner."""
    log_dir = run_dir / "logs"
    tty = show_progress and sys.stderr.isatty()
    learner_t0 = t0  # the learner's clock: t0 until a restart from a checkpoint (resume_point)
    next_line = 0.0
    stopping = wound_down = False
    finish = FinishWatch(run_dir / "summary.json", config.train)
    while True:
        code = learner.poll()
        if code is not None:
            if code == 0 or stopping or not restartable(code):
                break
            learner, learner_t0 = restart(learner)
            continue
        if not wound_down and finish.finished():
            procs.wind_down(keep="learner")  # the run is over: the learner only writes its last files
            stopping = wound_down = True
        dead = [name for name in procs.dead() if name != "learner"]
        if dead and not wound_down:
            raise click.ClickException(f"{', '.join(dead)} exited with an error; see {log_dir}")
        if not stopping and overdue(t0, learner_t0, config.train.max_seconds):
            logger.info(f"train.max_seconds ({config.train.max_seconds:.0f} s) reached: stopping the restarted learner")
            learner.send_signal(signal.SIGTERM)  # a clean stop: summary and final checkpoint
            stopping = True
        if filming is not None and not stopping:
            filming.poll()
        try:
            learner.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            pass
        if show_progress and time.monotonic() >= next_line:
            line = progress_from_metrics(run_dir / "metrics.csv", t0)
            if line:
                click.echo(("\r" + line) if tty else line, err=True, nl=not tty)
            next_line = time.monotonic() + (PROGRESS_EVERY_S if tty else 5.0)
    if tty:
        click.echo("", err=True)
    return learner


def _summary(learner: subprocess.Popen, run_dir: Path, t0: float, restarts: int) -> dict[str, Any]:
    """The learner's summary.json with the whole command's figures, or the learner's failure as a CLI error."""
    summary_path = run_dir / "summary.json"
    if learner.returncode != 0 or not summary_path.exists():
        raise click.ClickException(
            f"the learner failed ({exit_cause(learner.returncode)}); see {run_dir / 'logs' / 'learner.log'}"
        )
    summary = json.loads(summary_path.read_text())
    summary["wall_s_command"] = round(time.time() - t0, 3)
    summary["run_dir"] = str(run_dir)
    summary["learner_restarts"] = restarts
    target = f"at {summary['wall_s_to_target']} s" if summary.get("reached") else "not reached"
    logger.info(
        f"whole command {summary['wall_s_command']:.2f} s: {_first('trajectory', summary)}, "
        f"{_first('update', summary)}, target {target}"
    )
    return summary


def _first(event: str, summary: dict[str, Any]) -> str:
    """``first update at 2.1 s``, or ``no update`` in a run that made none (the resume of a finished run)."""
    wall_s = summary.get(f"wall_s_first_{event}")
    return f"first {event} at {wall_s} s" if wall_s is not None else f"no {event}"


def _check_env_id(config: Config) -> None:
    """A usage error if the run's env id names no env (a misspelt id) or its model.kind no importable code: resolving
    them builds nothing (a module:callable is imported), so it comes before the run directory is made, where building
    the env (``_check_env``) would delay the learner's start."""
    from zddrl.envs import EnvError, make_factory, rom_name

    try:
        make_factory(config.env)
        if config.env.backend == "ale_vector":
            rom_name(config.env.id)
        if config.model.is_custom:  # the algorithm's module was imported when the config was read
            plugin.load(config.model.kind, "model.kind")
    except (EnvError, plugin.PluginError) as exc:
        raise click.UsageError(str(exc)) from None


def _check_env(config: Config) -> None:
    """A usage error (the ``finally`` stops the processes) if the run's env cannot be built, zddrl cannot handle
    its spaces, the algorithm cannot learn in it or its replay buffer cannot fit (``algos.checks``): one clear line here
    instead of a learner that fails in its log."""
    from zddrl.algos.checks import replay_refusal, spec_refusal
    from zddrl.envs import EnvError, probe_spec
    from zddrl.learner.node import run_bus_of

    try:
        spec = probe_spec(config.env)
    except EnvError as exc:
        raise click.UsageError(str(exc)) from None
    why = spec_refusal(config, spec)
    if why:
        raise click.UsageError(f"{config.env.id}: {why}")
    why = replay_refusal(config, spec)
    if why:
        raise click.UsageError(why)
    try:  # the algorithm's declared arrays, as the learner's hello will state them (docs/protocol.md section 7.1)
        run_bus_of(config, algorithm_of(config), spec)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _restart_learner(
    procs: LocalProcesses,
    budget: RestartBudget,
    learner_args: list[str],
    run_dir: Path,
    t0: float,
    dead: subprocess.Popen,
) -> tuple[subprocess.Popen, float]:
    """The learner ``dead`` died: after the back-off, start it again from the newest checkpoint (or
    afresh); return the new process and its clock. Raises ClickException once the budget is spent."""
    log = procs.log_dir / "learner.log"
    cause = exit_cause(dead.returncode)
    delay = budget.next_delay_s()
    if delay is None:
        raise click.ClickException(give_up_message(budget, cause, log, run_dir, log_tail(log)))
    resume, _ = resume_point(run_dir, t0)
    logger.warning(describe_restart(budget.used, budget, cause, delay, resume, log_tail(log)))
    waited = wait_for_group(dead.pid)  # a killed launcher's shards: gone before the new learner starts
    time.sleep(max(0.0, delay - waited))  # the back-off (a Ctrl-C meanwhile still ends the run in the finally)
    resume, learner_t0 = resume_point(run_dir, t0)  # now: an orphaned shard 0 may have checkpointed meanwhile
    args = [*learner_args, "--t0", repr(learner_t0), *(["--resume"] if resume else [])]
    return procs.start(
        "learner", args, banner=f"restart {budget.used} of {budget.max_restarts}: the learner {cause}", own_group=True
    ), learner_t0
