"""`zddrl plot`: learning curves, throughput and staleness of one or more run directories, in one PNG.

Reads RUN_DIR/metrics.csv (required), RUN_DIR/summary.json and RUN_DIR/config.toml (optional: the label and the
target line; a run still in progress has no summary yet). Needs matplotlib (``pip install 'zddrl[plot]'``); it
draws with the Agg canvas directly, so no display is needed and pyplot's global state is never touched.
"""

from __future__ import annotations

import csv
import json
import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from loguru import logger

from zddrl.learner.progress import RETURN_WINDOW
from zddrl.proc import install_command
from zddrl.values import finite_float

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

COLUMNS = ("wall_s", "env_steps", "sps", "return_mean_20", "staleness_mean", "staleness_max")
REQUIRED = ("wall_s", "env_steps")
INSTALL_HINT = install_command("plot")


class PlotError(click.ClickException):
    """A run directory that cannot be plotted, or matplotlib missing (the CLI prints it, exit 1)."""


@dataclass
class Run:
    dir: Path
    series: dict[str, list[float]]
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.dir.name)

    @property
    def algorithm(self) -> str | None:
        """``ppo (async)``: the run's algorithm and schedule, from its summary or its config."""
        algo = self.config.get("algo", {})
        name = self.summary.get("algorithm") or algo.get("name")
        schedule = self.summary.get("schedule") or algo.get("schedule")
        return f"{name} ({schedule})" if name and schedule else name

    @property
    def seed(self) -> Any:
        seed = self.summary.get("seed")
        return self.config.get("env", {}).get("seed") if seed is None else seed

    @property
    def env_id(self) -> str | None:
        return self.config.get("env", {}).get("id")

    @property
    def target(self) -> float | None:
        return finite_float(self.summary.get("target_return"))

    def label(self) -> str:
        parts = [self.name, self.algorithm, None if self.seed is None else f"seed {self.seed}"]
        return ", ".join(str(p) for p in parts if p)


def load_run(run_dir: str | Path) -> Run:
    """The plotted columns of RUN_DIR/metrics.csv (empty cells -> NaN) plus its summary and config, if any."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.csv"
    if not path.is_file():
        raise PlotError(
            f"{run_dir} is not a run directory: it has no metrics.csv (written by `zddrl train` or "
            f"`zddrl learner --run-dir`)"
        )
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or ())]
        if missing:
            raise PlotError(f"{path} is empty or not a zddrl metrics file (no column {', '.join(missing)})")
        rows = list(reader)
    if not rows:
        raise PlotError(f"{path} has no rows yet: the learner has not finished its first update")
    series = {c: [math.nan if (x := finite_float(r.get(c))) is None else x for r in rows] for c in COLUMNS}
    run = Run(run_dir, series)
    try:
        run.summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        pass  # a run in progress (or killed) has no summary: no target line
    try:
        run.config = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, ValueError):
        pass
    return run


def count_label(x: float, _pos: object = None) -> str:
    """A tick label of a count (env steps, steps/s): 10k, 2.5M. Not matplotlib's EngFormatter: below one it
    labels with SI fractions, so that an axis with no data (0..0.05) read "10m 20m" like millions of steps."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:g}{suffix}"
    return f"{x:g}"


def has_return(run: Run) -> bool:
    """Whether the run has a return to plot: metrics.csv leaves it empty until RETURN_WINDOW episodes finished."""
    return any(not math.isnan(x) for x in run.series["return_mean_20"])


LEGEND_ROW_CHARS = 170
"""Characters of legend text that fit across the figure (13 in at 10 pt), handles and spacing counted as 10 each."""


def legend_columns(handles: list[Any]) -> int:
    """Columns of the figure legend such that its rows fit across the figure, whatever the length of the labels:
    runs that share a name are labelled with their directory names, and a legend wider than the figure is cut off
    at both edges. Labels longer than a row are wrapped."""
    for handle in handles:
        handle.set_label(textwrap.fill(handle.get_label(), LEGEND_ROW_CHARS - 10))
    longest = max((len(line) for h in handles for line in h.get_label().splitlines()), default=0)
    return max(1, min(len(handles), 5, LEGEND_ROW_CHARS // (longest + 10)))


def _labels(runs: list[Run]) -> list[str]:
    """One legend label per run; runs that would share one get their directory name added."""
    labels = [r.label() for r in runs]
    return [f"{lab} ({r.dir.name})" if labels.count(lab) > 1 else lab for lab, r in zip(labels, runs)]


def plot_runs(run_dirs: list[Path], output: Path) -> None:
    """Write one PNG with four panels: return vs env steps and vs wall time, env steps/s, staleness."""
    if not run_dirs:
        raise PlotError("no run directory given")
    runs = [load_run(d) for d in run_dirs]  # bad input is reported before matplotlib is even imported
    fig = figure(runs)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, format="png")


def _note_missing_returns(runs: list[Run], ret_steps: Any, ret_wall: Any) -> None:
    """A warning per run without a return yet; when no run has one, a note in the return panels, which span the
    runs (blank panels on a 0..0.05 axis would say nothing)."""
    for run in runs:
        if not has_return(run):
            logger.warning(
                f"{run.dir}: no return to plot yet (fewer than {RETURN_WINDOW} episodes finished): "
                "its return curves are empty"
            )
    if any(has_return(r) for r in runs):
        return
    note = f"no return yet:\nfewer than {RETURN_WINDOW} episodes finished"
    for ax, column in ((ret_steps, "env_steps"), (ret_wall, "wall_s")):
        ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", fontsize=12, color="0.35")
        ax.set_xlim(0, max(max((x for r in runs for x in r.series[column] if not math.isnan(x)), default=1), 1))
        ax.set_yticks([])


def _label_axes(runs: list[Run], ret_steps: Any, ret_wall: Any, sps_wall: Any, stale: Any, steps_fmt: Any) -> None:
    """Titles, axis labels, grids, tick formats and limits of the four panels."""
    for ax, title, xlabel, ylabel in (
        (ret_steps, "Return vs env steps", "env steps (all actors)", "mean return, last 20 episodes"),
        (ret_wall, "Return vs wall time", "wall time since command start (s)", "mean return, last 20 episodes"),
        (sps_wall, "Throughput", "wall time since command start (s)", "env steps / s (average since start)"),
        (stale, "Policy lag of trained data", "env steps (all actors)", "staleness (policy versions)"),
    ):
        ax.set_title(title, fontsize=11)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.set_xlim(left=0)
        if xlabel.startswith("env steps"):
            ax.xaxis.set_major_formatter(steps_fmt)
    sps_wall.yaxis.set_major_formatter(steps_fmt)
    sps_wall.set_ylim(bottom=0)
    top = max((x for r in runs for x in r.series["staleness_max"] if not math.isnan(x)), default=0.0)
    stale.set_ylim(-0.2, max(top, 1.0) * 1.3 + 0.3)  # headroom for the legend
    stale.yaxis.get_major_locator().set_params(integer=True)


def figure(runs: list[Run]) -> Any:
    """The four panels of ``runs`` (a matplotlib Figure on an Agg canvas); PlotError without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise PlotError(f"zddrl plot needs matplotlib: {INSTALL_HINT}") from None

    fig = Figure(figsize=(13, 8.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    (ret_steps, ret_wall), (sps_wall, stale) = fig.subplots(2, 2)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for i, (run, label, color) in enumerate(zip(runs, _labels(runs), colors)):
        s = run.series
        wide = max(1.2, 3.0 - 0.6 * i)  # staleness curves often coincide: earlier runs drawn wider show beneath
        ret_steps.plot(s["env_steps"], s["return_mean_20"], color=color, lw=1.6, label=label)
        ret_wall.plot(s["wall_s"], s["return_mean_20"], color=color, lw=1.6)
        sps_wall.plot(s["wall_s"], s["sps"], color=color, lw=1.6)
        stale.plot(s["env_steps"], s["staleness_mean"], color=color, lw=wide)
        stale.plot(s["env_steps"], s["staleness_max"], color=color, lw=wide * 0.6, ls=":")
        steps = finite_float(run.summary.get("env_steps_to_target"))
        wall = finite_float(run.summary.get("wall_s_to_target"))
        if run.target is not None and run.summary.get("reached") and steps is not None and wall is not None:
            ret_steps.plot([steps], [run.target], "o", color=color, ms=6, zorder=3)
            ret_wall.plot([wall], [run.target], "o", color=color, ms=6, zorder=3)

    style: list[Any] = []
    for target in sorted({r.target for r in runs if r.target is not None}):
        for ax in (ret_steps, ret_wall):
            ax.axhline(target, color="0.35", ls="--", lw=1.1, zorder=1)
        style.append(Line2D([], [], color="0.35", ls="--", label=f"target {target:g}"))
    if any(r.summary.get("reached") for r in runs):
        style.append(Line2D([], [], color="0.35", marker="o", ls="", label="target first reached"))
    stale.legend(
        handles=[
            Line2D([], [], color="0.2", lw=1.6, label="mean over the batch"),
            Line2D([], [], color="0.2", lw=1.0, ls=":", label="max in the batch"),
        ],
        loc="upper right",
        ncols=2,
        fontsize=9,
    )

    _note_missing_returns(runs, ret_steps, ret_wall)

    _label_axes(runs, ret_steps, ret_wall, sps_wall, stale, FuncFormatter(count_label))
    handles = ret_steps.get_legend_handles_labels()[0] + style  # below the panels: it hides no curve
    fig.legend(handles=handles, loc="outside lower center", ncols=legend_columns(handles), fontsize=10, frameon=False)
    envs = sorted({r.env_id for r in runs if r.env_id})
    if envs:
        fig.suptitle(", ".join(envs), fontsize=13, fontweight="bold")
    return fig
