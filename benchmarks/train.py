"""`python -m benchmarks train`: time and env steps to a target return, per mode, median over seeds.

Each seed runs the real `zddrl train CONFIG --seed S` command as a subprocess; the figures are
its own summary (``wall_s_to_target`` counts from the command's start, start-up included) and
the command's wall time measured from outside. With ``--sb3 SCRIPT`` the Stable-Baselines3
anchor script (docs/src/sb3_ppo_cartpole.py) runs for the same seeds in the same
session, interleaved, so both figures come from the same machine state; ``--sb3-offpolicy SCRIPT``
(docs/src/sb3_offpolicy.py) does the same for the replay modes: SB3's DQN next to apex, its SAC
next to sac, each stopped at its target so that both whole commands are times to solve.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from zddrl.bench.common import timed_json_run
from zddrl.config import kind_label, run_kind_args

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEFAULT_CONFIGS = {
    "sync": EXAMPLES / "cartpole_ppo.toml",
    "async": EXAMPLES / "cartpole_ppo.toml",
    "impala": EXAMPLES / "cartpole_impala.toml",
    "apex": EXAMPLES / "cartpole_apex.toml",
    "sac": EXAMPLES / "pendulum_sac.toml",
}
"""Each mode runs with its own tuned example unless --config MODE=PATH says otherwise."""
SB3_OFFPOLICY_ALGO = {"apex": "dqn", "sac": "sac"}
"""The SB3 algorithm the off-policy anchor runs next to each replay mode (same env, same target)."""


def config_paths(items: tuple[str, ...]) -> dict[str, Path]:
    """Each mode's example config, with ``--config MODE=PATH`` items in its place; a bad item is a usage error."""
    paths = dict(DEFAULT_CONFIGS)
    for item in items:
        mode, sep, path = item.partition("=")
        if not sep or mode not in paths:
            raise click.UsageError(f"--config takes MODE=PATH with MODE one of {sorted(paths)}, got {item!r}")
        paths[mode] = Path(path)
    return paths


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def run_zddrl(config: str | Path, seed: int, mode: str | None, extra: list[str], run_dir: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "zddrl",
        "--log-level",
        "WARNING",
        "train",
        str(config),
        "--seed",
        str(seed),
        "--run-dir",
        str(run_dir),
        *(run_kind_args(mode) if mode else []),
        *extra,
    ]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise click.ClickException(f"zddrl train failed (seed {seed}): {done.stderr[-2000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "impl": "zddrl",
        "mode": mode or kind_label(summary["algorithm"], summary["schedule"]),
        "seed": seed,
        "reached": summary["reached"],
        "wall_s_to_target": summary["wall_s_to_target"],
        "env_steps_to_target": summary["env_steps_to_target"],
        "command_wall_s": round(wall, 3),
        "sps": summary["sps"],
        "total_env_steps": summary["total_env_steps"],
    }


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["impl"], row["mode"]), []).append(row)
    return [
        {
            "impl": impl,
            "mode": mode,
            "runs": len(rs),
            "reached": sum(r["reached"] for r in rs),
            "median_wall_s_to_target": _median([r["wall_s_to_target"] for r in rs]),
            "median_env_steps_to_target": _median([r["env_steps_to_target"] for r in rs]),
            "median_command_wall_s": _median([r["command_wall_s"] for r in rs]),
            "median_sps": _median([r["sps"] for r in rs]),
        }
        for (impl, mode), rs in groups.items()
    ]


@click.command("train")
@click.option(
    "--config",
    "configs",
    multiple=True,
    metavar="MODE=PATH",
    help="Config for a mode (default: examples/cartpole_ppo.toml for sync and async, "
    "examples/cartpole_impala.toml for impala).",
)
@click.option("--seeds", default="1,2,3", show_default=True, help="Comma-separated seeds.")
@click.option("--modes", default="sync", show_default=True, help="Comma-separated modes (sync,async,impala,apex,sac).")
@click.option(
    "--sb3",
    "sb3_script",
    default=None,
    help="Path of the SB3 anchor script to run side by side. "
    "Run with a python that has stable-baselines3: --sb3-python.",
)
@click.option(
    "--sb3-offpolicy",
    "sb3_offpolicy",
    default=None,
    help="Path of the SB3 off-policy anchor (sb3_offpolicy.py): DQN next to apex, SAC next to sac.",
)
@click.option("--sb3-python", default=None, help="Interpreter for the SB3 script (default: this one).")
@click.option("--set", "sets", multiple=True, help="Passed to every `zddrl train` (e.g. train.actors=3).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def train(configs, seeds, modes, sb3_script, sb3_offpolicy, sb3_python, sets, as_json) -> None:
    """Time-to-target and env-steps-to-target of `zddrl train`, per mode, medians over seeds."""
    paths = config_paths(configs)
    rows: list[dict[str, Any]] = []
    extra = [arg for s in sets for arg in ("--set", s)]
    with tempfile.TemporaryDirectory(prefix="zddrl-bench-train-") as tmp:
        for seed in (int(s) for s in seeds.split(",")):
            for mode in modes.split(","):
                rows.append(run_zddrl(paths[mode], seed, mode, extra, Path(tmp) / f"{mode}-s{seed}"))
                if sb3_offpolicy and mode in SB3_OFFPOLICY_ALGO:
                    algo = SB3_OFFPOLICY_ALGO[mode]
                    rows.append(run_sb3_offpolicy(sb3_python or sys.executable, sb3_offpolicy, algo, seed))
            if sb3_script:
                rows.append(run_sb3_with(sb3_python or sys.executable, sb3_script, seed))
    result = {
        "configs": {m: str(paths[m]) for m in modes.split(",")},
        "sets": list(sets),
        "runs": rows,
        "summary": summarize(rows),
    }
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(
        f"{'impl':6} {'mode':6} {'reached':>8} {'s to target':>12} {'steps to target':>16} {'command s':>10} {'sps':>8}"
    )
    for s in result["summary"]:

        def fmt(v, spec):
            return format(v, spec) if v is not None else "-"

        click.echo(
            f"{s['impl']:6} {s['mode']:6} {s['reached']:>4}/{s['runs']:<3} "
            f"{fmt(s['median_wall_s_to_target'], '>12.2f')} {fmt(s['median_env_steps_to_target'], '>16,.0f')} "
            f"{fmt(s['median_command_wall_s'], '>10.2f')} {fmt(s['median_sps'], '>8,.0f')}"
        )


def run_sb3_with(python: str, script: str, seed: int) -> dict[str, Any]:
    """The SB3 anchor for one seed. Its own clock starts at learn(); ``from_start_s_to_target`` adds
    what came before (interpreter, imports, set-up), measured from outside, to compare like for like
    with zddrl's ``wall_s_to_target``."""
    cmd = [python, script, "--config", "zoo", "--threads", "1", "--seed", str(seed)]
    wall, out = timed_json_run(cmd, f"SB3 anchor (seed {seed})")
    before_learn = wall - out["train_s"] - out["eval_s"]  # interpreter + imports + set-up (+ exit)
    hit = out["hit_s"]
    return {
        "impl": "sb3",
        "mode": "zoo",
        "seed": seed,
        "reached": hit is not None,
        "wall_s_to_target": None if hit is None else round(before_learn + hit, 3),
        "learn_s_to_target": hit,
        "env_steps_to_target": out["hit_steps"],
        "command_wall_s": round(wall, 3),
        "setup_s": out["setup_s"],
        "sps": out["sps"],
        "total_env_steps": out["env_steps"],
    }


def run_sb3_offpolicy(python: str, script: str, algo: str, seed: int) -> dict[str, Any]:
    """The SB3 off-policy anchor for one seed, stopped at its target: the command's wall time is its time to solve
    (``wall_s_to_target``), like the whole `zddrl train` command's."""
    cmd = [python, script, "--algo", algo, "--seed", str(seed), "--stop-at-target"]
    wall, out = timed_json_run(cmd, f"SB3 {algo} anchor (seed {seed})")
    reached = out["hit_s"] is not None
    return {
        "impl": "sb3",
        "mode": algo,
        "seed": seed,
        "reached": reached,
        "wall_s_to_target": round(wall, 3) if reached else None,
        "learn_s_to_target": out["hit_s"],
        "env_steps_to_target": out["hit_steps"],
        "command_wall_s": round(wall, 3),
        "setup_s": out["setup_s"],
        "sps": round(out["env_steps"] / wall, 1),
        "total_env_steps": out["env_steps"],
    }
