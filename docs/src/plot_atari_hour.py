#!/usr/bin/env python
"""The figure of docs/benchmarks.md "Breakout for an hour": the game score (mean of the last 20 games) of zddrl runs
(their metrics.csv, or the curves kept in a docs/bench JSON) and of the SB3 baseline (the JSON line of
sb3_ppo_atari_budget.py) against wall time and against env steps, on two panels.

Usage: plot_atari_hour.py [--zddrl RUN_DIR ...] [--curves BENCH.json ...] [--sb3 SB3.json] --title TITLE -o OUT.png
(BENCH.json: {run name: {"curve": [[seconds, env steps, score or null, ...], ...]}}, as docs/bench/pong_appo.json)"""

import argparse
import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def zddrl_curve(run_dir: Path) -> tuple[list[float], list[int], list[float]]:
    """(seconds, env steps, score) of each metrics.csv row that has a score."""
    seconds, steps, scores = [], [], []
    with open(run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row["return_mean_20"]:
                seconds.append(float(row["wall_s"]))
                steps.append(int(row["env_steps"]))
                scores.append(float(row["return_mean_20"]))
    return seconds, steps, scores


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--zddrl", type=Path, action="append", default=[])
    p.add_argument("--curves", type=Path, action="append", default=[])
    p.add_argument("--sb3", type=Path)
    p.add_argument("--title", default="")
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args()
    fig, (by_time, by_steps) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    runs = {f"zddrl {run_dir.name}": zddrl_curve(run_dir) for run_dir in a.zddrl}
    for path in a.curves:
        for name, run in json.loads(path.read_text()).items():
            kept = [point[:3] for point in run["curve"] if point[2] is not None]
            runs[f"zddrl {name}"] = tuple(zip(*kept))
    for label, (seconds, steps, scores) in runs.items():
        by_time.plot([s / 60 for s in seconds], scores, label=label)
        by_steps.plot([s / 1e6 for s in steps], scores, label=label)
    if a.sb3 is not None:
        sb3 = json.loads(a.sb3.read_text().strip().splitlines()[-1])
        seconds, steps, scores = zip(*sb3["curve"])
        label = f"SB3 PPO ({sb3['env']})"
        by_time.plot([s / 60 for s in seconds], scores, label=label, color="black", alpha=0.7)
        by_steps.plot([s / 1e6 for s in steps], scores, label=label, color="black", alpha=0.7)
    by_time.set_xlabel("wall time from the command's start (minutes)")
    by_steps.set_xlabel("env steps (millions; frames = 4x)")
    by_time.set_ylabel("game score, mean of the last 20 games")
    for ax in (by_time, by_steps):
        ax.grid(alpha=0.3)
    by_time.legend(loc="upper left", fontsize="small")
    fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)


if __name__ == "__main__":
    main()
