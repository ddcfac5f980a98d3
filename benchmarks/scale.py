"""`python -m benchmarks scale`: the scaling curve, env steps/s and time to the target against the number of actors.

Each point is one real `zddrl train` run (broker, N actor processes, learner) with a simulated per-step env latency
(``train.env_latency_ms``: each env step sleeps first, as a remote simulator would), so that actors, not the env's
own CPU cost, set the pace, as on a cluster whose envs run elsewhere (DD-PPO, Wijmans et al. 2020, fig. 3; IMPALA,
Espeholt et al. 2018, fig. 4 plot the same two curves). A run stops at the config's target return or ``--seconds``
after its first update (start-up is left out of the window; docs/benchmarks.md measures it on its own). Per point:
env steps/s over the whole command (start-up included) and between the first and the last update (``sps_steady``,
from metrics.csv), the time and env steps to the target, and the dropped data.
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from benchmarks.train import DEFAULT_CONFIGS, config_paths
from zddrl.config import run_kind_args

DEFAULT_ACTORS = "1,2,4,8,16,32"
DEFAULT_MODES = "sync,async,impala"
DEFAULT_LATENCY_MS = 5.0
"""Per env step: one actor with one env then tops out near 200 env steps/s, 32 of them near 6,400, above what the
learner takes on 2 cores, so the curve shows where the system, not the env, stops scaling."""
DEFAULT_SECONDS = 20.0
"""Measuring window of each run, from its first update (start-up is left out: 32 actor processes take a while to
start on 2 cores): the 18 runs of the default grid take ~10-15 min there."""
START_UP_BACKSTOP_S = 240.0
"""The run's own time limit is the window plus this: only a run whose first update never comes meets it."""
RUN_GRACE_S = 60.0
"""A run stopped at the end of its window may take this long to write its summary and exit before it is killed."""
POLL_S = 0.2


def steady_sps(metrics: Path) -> float | None:
    """Env steps/s between the first and the last update of metrics.csv (start-up left out); None with < 2 rows."""
    try:
        with open(metrics, newline="") as f:
            rows = list(csv.DictReader(f))
    except FileNotFoundError:
        return None
    if len(rows) < 2:
        return None
    first, last = rows[0], rows[-1]
    dt = float(last["wall_s"]) - float(first["wall_s"])
    return (int(last["env_steps"]) - int(first["env_steps"])) / dt if dt > 0 else None


def train_command(config: Path, mode: str, actors: int, args: dict[str, Any], run_dir: Path) -> list[str]:
    """The `zddrl train` command of one point: N actors of ``args["envs"]`` envs and the latency. Its own time limit
    is only a backstop: the bench stops it ``args["seconds"]`` after its first update (``run_point``)."""
    sets = {
        "train.actors": actors,
        "env.num_envs": args["envs"],
        "train.env_latency_ms": args["latency_ms"],
        "train.max_seconds": args["seconds"] + START_UP_BACKSTOP_S,
        "train.max_steps": 100_000_000,  # the measuring window or the target ends a point, not a step budget
    }
    overrides = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    extra = [arg for s in args["sets"] for arg in ("--set", s)]
    return [
        *[sys.executable, "-m", "zddrl", "--log-level", "WARNING", "train", str(config)],
        *[*run_kind_args(mode), "--seed", str(args["seed"]), "--run-dir", str(run_dir), *overrides, *extra],
    ]


def _first_update_seen(metrics: Path) -> bool:
    try:
        with open(metrics, "rb") as f:
            return len(f.read(1 << 16).splitlines()) >= 2  # the header and one row
    except FileNotFoundError:
        return False


def _stderr_path(run_dir: Path) -> Path:
    return run_dir.with_name(run_dir.name + ".stderr")


def _run_window(cmd: list[str], run_dir: Path, seconds: float) -> tuple[int | None, float]:
    """Run ``cmd`` until it ends by itself (target reached) or ``seconds`` after its first update, then stop it as
    Ctrl-C would (the learner still writes its summary); returns its exit code (None: killed) and wall seconds."""
    t0 = time.monotonic()
    with open(_stderr_path(run_dir), "wb") as err:  # a file, not a pipe nobody reads until the end (it could fill)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
    deadline = t0 + seconds + START_UP_BACKSTOP_S + RUN_GRACE_S
    first_at: float | None = None
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if first_at is None and _first_update_seen(run_dir / "metrics.csv"):
                first_at = time.monotonic()
            if first_at is not None and time.monotonic() - first_at >= seconds:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=RUN_GRACE_S)
                break
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, time.monotonic() - t0


def run_point(config: Path, mode: str, actors: int, args: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One `zddrl train` run; its summary's figures, or ``error`` (one failed point does not end the bench)."""
    code, wall = _run_window(train_command(config, mode, actors, args, run_dir), run_dir, args["seconds"])
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        tail = _stderr_path(run_dir).read_text(errors="replace")[-500:] if _stderr_path(run_dir).exists() else ""
        return {"mode": mode, "actors": actors, "error": f"no summary (exit code {code}): {tail}"}
    return {
        "mode": mode,
        "actors": actors,
        "envs": actors * args["envs"],
        "reached": s["reached"],
        "wall_s_to_target": s["wall_s_to_target"],
        "env_steps_to_target": s["env_steps_to_target"],
        "wall_s_first_update": s.get("wall_s_first_update"),
        "total_env_steps": s["total_env_steps"],
        "sps": s["sps"],
        "sps_steady": _round(steady_sps(run_dir / "metrics.csv")),
        "updates": s["updates"],
        "dropped": sum(sum(s[k].values()) for k in ("dropped_late", "dropped_stale", "dropped_invalid")),
        "command_wall_s": round(wall, 3),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(points: list[dict[str, Any]]) -> str:
    lines = [
        f"{'mode':6} {'actors':>6} {'sps':>8} {'steady sps':>10} {'s to target':>11} {'steps to target':>15} "
        f"{'dropped':>7}"
    ]
    for p in points:
        if "error" in p:
            lines.append(f"{p['mode']:6} {p['actors']:>6} failed: {p['error'][-200:]}")
            continue
        lines.append(
            f"{p['mode']:6} {p['actors']:>6} {p['sps']:>8,.0f} {_fmt(p['sps_steady'], '>10,.0f')} "
            f"{_fmt(p['wall_s_to_target'], '>11.1f')} {_fmt(p['env_steps_to_target'], '>15,')} {p['dropped']:>7}"
        )
    return "\n".join(lines)


def plot(points: list[dict[str, Any]], path: Path, title: str) -> None:
    """Two panels against actors (log2 axis), one line per mode: env steps/s, and seconds to the target (a point
    that did not reach it is left out)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install 'zddrl[plot]'") from None
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_sps, ax_time = fig.subplots(1, 2)
    for mode in dict.fromkeys(p["mode"] for p in points):
        ok = [p for p in points if p["mode"] == mode and "error" not in p]
        ax_sps.plot([p["actors"] for p in ok], [p["sps_steady"] or p["sps"] for p in ok], "o-", label=mode)
        hit = [p for p in ok if p["reached"]]
        ax_time.plot([p["actors"] for p in hit], [p["wall_s_to_target"] for p in hit], "o-", label=mode)
    for ax, ylabel in ((ax_sps, "env steps/s (first to last update)"), (ax_time, "s to target (from command start)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("actors")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_sps.set_yscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise click.BadParameter("actor counts must be >= 1")
    return values


def _modes(text: str) -> list[str]:
    modes = text.split(",")
    bad = [m for m in modes if m not in DEFAULT_CONFIGS]
    if bad:
        raise click.BadParameter(f"unknown mode(s) {bad}; choose from {sorted(DEFAULT_CONFIGS)}")
    return modes


@click.command("scale")
@click.option("--actors", default=DEFAULT_ACTORS, show_default=True, help="Comma-separated actor counts.")
@click.option("--modes", default=DEFAULT_MODES, show_default=True, help="Comma-separated modes.")
@click.option(
    "--env-latency-ms",
    type=click.FloatRange(min=0.0),
    default=DEFAULT_LATENCY_MS,
    show_default=True,
    help="Simulated latency of every env step (train.env_latency_ms).",
)
@click.option(
    "--seconds",
    type=click.FloatRange(min=1.0),
    default=DEFAULT_SECONDS,
    show_default=True,
    help="Measuring window of each run, from its first update; a run also stops at the target.",
)
@click.option("--envs", type=click.IntRange(min=1), default=1, show_default=True, help="Envs per actor.")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option(
    "--config",
    "configs",
    multiple=True,
    metavar="MODE=PATH",
    help="Config for a mode (default: the examples `python -m benchmarks train` uses).",
)
@click.option("--set", "sets", multiple=True, help="Passed to every `zddrl train` (e.g. algo.batch_size=512).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="Write the plot (PNG).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def scale(actors, modes, env_latency_ms, seconds, envs, seed, configs, sets, plot_path, as_json) -> None:
    """Env steps/s and time to the target against actors, per mode: one `zddrl train` run per point."""
    paths = config_paths(configs)
    counts, mode_list = _ints(actors), _modes(modes)
    args = {"envs": envs, "latency_ms": env_latency_ms, "seconds": seconds, "seed": seed, "sets": list(sets)}
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="zddrl-bench-scale-") as tmp:
        for mode in mode_list:
            for n in counts:
                points.append(run_point(paths[mode], mode, n, args, Path(tmp) / f"{mode}-a{n}"))
                if not as_json:
                    click.echo(format_table(points[-1:]).splitlines()[-1], err=True)
    settings = {**args, "actors": counts, "modes": mode_list, "configs": {m: str(paths[m]) for m in mode_list}}
    if plot_path:
        title = (
            f"CartPole, {envs} env(s) per actor, {env_latency_ms:g} ms per env step, "
            f"windows of {seconds:g} s from the first update"
        )
        plot(points, Path(plot_path), title)
    if as_json:
        click.echo(json.dumps({"bench": "scale", "settings": settings, "points": points}))
    else:
        click.echo(format_table(points))
