"""The run directory: resolved config, metrics.csv, summary.json and checkpoints.

Layout (names that scripts and CI rely on; docs/run-directory.md documents each column)::

    RUN_DIR/config.toml        the resolved config
    RUN_DIR/meta.json          versions, git SHA, host, command line, run id, the hosts of the fleet
    RUN_DIR/metrics.csv        one row per update (METRIC_COLUMNS)
    RUN_DIR/summary.json       SUMMARY_KEYS, written at the end
    RUN_DIR/tb/                TensorBoard event files (charts/, losses/, perf/), when tensorboard is installed
    RUN_DIR/wandb/             W&B's local files, with train.wandb_project (offline runs: for `wandb sync`)
    RUN_DIR/checkpoints/ckpt-VERSION.pt   periodic (the newest K kept): what --resume continues from
    RUN_DIR/checkpoints/final.pt   the last state: model, optimizer, version, statistics, RNG, config
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loguru import logger

from zddrl import plugin
from zddrl.algos.spec import Figure
from zddrl.config import to_toml
from zddrl.learner.tensorboard import make_tensorboard_writer, with_figures
from zddrl.learner.wandb_log import make_wandb_writer

METRIC_COLUMNS = (
    "wall_s",
    "env_steps",
    "policy_version",
    "sps",
    "return_mean_20",
    "episodes",
    "batch_steps",
    "policy_loss",
    "value_loss",
    "entropy",
    "approx_kl",
    "clipfrac",
    "explained_variance",
    "grad_norm",
    "lr",
    "staleness_mean",
    "staleness_max",
    "staleness_hist",
    "is_weight_mean",
    "rho_mean",
    "grad_steps",
    "loss",
    "q_mean",
    "td_abs_mean",
    "critic_loss",
    "actor_loss",
    "temperature",
    "replay_size",
    "replay_fill",
    "replay_bytes",
    "nonfinite_td",
    "eval_return",
    "eval_s",
    "target_kind",
    "dropped_late",
    "dropped_stale",
    "dropped_invalid",
    "skipped_steps",
    "actors",
    "rollout_len",
    "round_s",
    "update_s",
    "clip",
    "beta",
    "grad_steps_total",
    "replay_stale_updates",
    "replay_dropped_by_version",
)
SUMMARY_KEYS = (
    "target_return",
    "target_kind",
    "eval_return",
    "reached",
    "wall_s_to_target",
    "env_steps_to_target",
    "return_at_target",
    "total_env_steps",
    "wall_s",
    "sps",
    "return_mean_20",
    "episodes",
    "policy_version",
    "updates",
    "dropped_late",
    "dropped_stale",
    "dropped_invalid",
    "lag",
    "algorithm",
    "schedule",
    "seed",
    "shards",
    "shard_trajectories",
)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


class RunLog:
    """Writes one run directory. Only the learner (shard 0) owns one.

    ``resume_version``: continue a run whose checkpoint had that policy version; metrics rows written
    after the checkpoint (work lost with the crash, done again now) are dropped, the rest kept.
    """

    def __init__(
        self,
        run_dir: str | Path,
        config: dict[str, Any],
        resume_version: int | None = None,
        figures: tuple[Figure, ...] = (),
    ) -> None:
        """``figures``: what the run's algorithm declares; those not among ``METRIC_COLUMNS`` (a user's algorithm's)
        become columns after them, and TensorBoard and W&B scalars under their group."""
        self.dir = Path(run_dir)
        self.columns = METRIC_COLUMNS + tuple(dict.fromkeys(f.name for f in figures if f.name not in METRIC_COLUMNS))
        self.algorithm = str(config.get("algo", {}).get("name", ""))
        self._undeclared: set[str] = set()
        tags = with_figures(figures)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._meta: dict[str, Any] | None = None
        (self.dir / "config.toml").write_text(plugin.record() + to_toml(config))  # where its code came from
        kept = self._rows_up_to(resume_version) if resume_version is not None else []
        self._csv_file = open(self.dir / "metrics.csv", "w", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=self.columns, extrasaction="ignore")
        self._csv.writeheader()
        self._csv.writerows(kept)
        self._csv_file.flush()
        # TensorBoard when installed (extra `tensorboard`); a resumed run hides events written after its checkpoint.
        purge = None if resume_version is None else (int(kept[-1]["env_steps"]) + 1 if kept else 0)
        self._tb = make_tensorboard_writer(self.dir, purge_step=purge, tags=tags)
        self._wandb = make_wandb_writer(self.dir, config, tags)  # W&B when train.wandb_project is set (extra `wandb`)

    def _rows_up_to(self, version: int) -> list[dict[str, str]]:
        try:
            with open(self.dir / "metrics.csv", newline="") as f:
                rows = list(csv.DictReader(f))
        except FileNotFoundError:
            return []
        return [r for r in rows if r.get("policy_version", "").isdigit() and int(r["policy_version"]) <= version]

    def write(self, row: dict[str, Any]) -> None:
        self._warn_undeclared(row)
        self._csv.writerow({k: _fmt(row.get(k)) for k in self.columns})
        self._csv_file.flush()
        if self._tb is not None:
            self._tb.write(int(row["env_steps"]), row)
        if self._wandb is not None:
            self._wandb.write(int(row["env_steps"]), row)

    def _warn_undeclared(self, row: dict[str, Any]) -> None:
        """A figure no column takes is said once, by name: an algorithm that reports a figure it did not declare
        (``AlgorithmSpec.figures``) must learn of it, not lose it silently."""
        new = set(row) - set(self.columns) - self._undeclared
        if new:
            self._undeclared |= new
            logger.warning(
                f"figure(s) {', '.join(sorted(new))} of algorithm {self.algorithm!r} are not declared in its "
                "spec's figures: not written to metrics.csv, TensorBoard or W&B"
            )

    def meta(self, extra: dict[str, Any]) -> None:
        """Run metadata (``meta.json``): zddrl and library versions, git SHA, host, command line, plus ``extra``.
        CollectedBatch once; later calls add to what was written."""
        if self._meta is None:
            self._meta = run_metadata()
        self._meta.update(extra)
        atomic_write_bytes(self.dir / "meta.json", json.dumps(self._meta, indent=2).encode())

    def summary(self, summary: dict[str, Any]) -> None:
        atomic_write_bytes(self.dir / "summary.json", json.dumps(summary, indent=2).encode())

    def checkpoint(self, state: dict[str, Any], name: str = "final.pt", keep: int | None = None) -> Path:
        """Write ``checkpoints/NAME`` atomically (temp file, fsync, rename): a crash mid-write leaves the
        previous checkpoints intact. With ``keep``, only the newest ``keep`` ckpt-*.pt files stay."""
        path = self.dir / "checkpoints" / name
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        import torch  # here, not at import: `zddrl train` (no torch) finds checkpoints through this module

        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if keep:
            for old in sorted(path.parent.glob("ckpt-*.pt"))[:-keep]:
                old.unlink(missing_ok=True)
        return path

    def close(self) -> None:
        self._csv_file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return "" if value is None else value


def git_sha() -> str | None:
    """The commit of the zddrl source tree this process runs, when it is a git checkout."""
    try:
        out = subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def run_metadata() -> dict[str, Any]:
    import gymnasium
    import numpy
    import torch
    import zmq

    from zddrl import __version__

    return {
        "zddrl": __version__,
        "git_sha": git_sha(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gymnasium": gymnasium.__version__,
        "numpy": numpy.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "hardware": hardware(),
    }


CPU_UNITS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
"""The CPU features ``hardware`` reports: those that decide how fast torch runs bf16 and fp16 on a CPU."""


def hardware() -> dict[str, Any]:
    """What the figures of a run or a benchmark were measured on: the CPU, its cores, the units that decide how
    fast a CPU learner runs bf16 (``avx512_bf16``, AMX), and the GPUs torch sees. The same VM type has run the same
    learner 2.4x apart on two days; a figure without its host cannot be compared."""
    import torch

    caps = torch.cpu.get_capabilities()
    found: dict[str, Any] = {
        "cpu": caps.get("cpu_name") or platform.processor() or platform.machine(),
        "logical_cores": os.cpu_count(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_units": sorted(unit for unit in CPU_UNITS if caps.get(unit)),
    }
    if torch.cuda.is_available():
        found["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return found


def describe_hardware(found: dict[str, Any]) -> str:
    """One line of :func:`hardware`'s answer, for a report's heading."""
    units = ", ".join(found["cpu_units"]) or "none of avx512_bf16, amx_bf16"
    amx = "" if "amx_bf16" in found["cpu_units"] else " (no AMX)"
    gpus = f"; GPUs: {', '.join(found['gpus'])}" if found.get("gpus") else ""
    return (
        f"measured on {found['cpu']}, {found['logical_cores']} logical cores, torch {found['torch_cpu_capability']}, "
        f"units: {units}{amx}{gpus}"
    )


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest periodic checkpoint (highest version) of a run; temp files of interrupted writes are ignored."""
    found = sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))
    return found[-1] if found else None


class CheckpointError(ValueError):
    """A file that is not a checkpoint zddrl wrote."""


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint without unpickling arbitrary objects (``weights_only=True``); CheckpointError, one line,
    for a file that is not one (torch's own errors on a text file say things like ``KeyError: 105``)."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes, the answer is one line
        raise CheckpointError(
            f"{path} is not a zddrl checkpoint (RUN_DIR/checkpoints/*.pt): torch.load says {type(exc).__name__}"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a zddrl checkpoint: it holds a {type(state).__name__}, not a state")
    return state
