"""TensorBoard event files for a run: RUN_DIR/tb, one scalar per metrics.csv figure, namespaced.

Optional: needs the ``tensorboard`` package (the ``tensorboard`` extra); the events are written with
torch's ``SummaryWriter``. ``make_tensorboard_writer`` returns None when it is not installed, so callers write::

    tb = make_tensorboard_writer(run_dir)
    ...
    if tb is not None:
        tb.write(row["env_steps"], row)

View with ``tensorboard --logdir runs/`` (every run directory's tb/ shows up as one run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loguru import logger

from zddrl.algos.spec import Figure
from zddrl.proc import install_command
from zddrl.values import finite_float

TB_DIR = "tb"
TAGS: dict[str, tuple[str, ...]] = {
    "charts": ("return_mean_20", "episodes", "sps", "policy_version"),
    "losses": ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "explained_variance", "grad_norm"),
    "perf": (
        "round_s",
        "update_s",
        "staleness_mean",
        "staleness_max",
        "lr",
        "batch_steps",
        "dropped_late",
        "dropped_stale",
        "dropped_invalid",
    ),
}
"""Namespace -> metrics.csv columns logged under it as ``namespace/column``."""
FLUSH_SECS = 10


def with_figures(figures: tuple[Figure, ...]) -> dict[str, tuple[str, ...]]:
    """``TAGS`` and the declared ``figures`` of a run's algorithm, each under its group."""
    tags = {namespace: list(keys) for namespace, keys in TAGS.items()}
    for figure in figures:
        names = tags.setdefault(figure.group, [])
        if figure.name not in names and not any(figure.name in keys for keys in TAGS.values()):
            names.append(figure.name)
    return {namespace: tuple(keys) for namespace, keys in tags.items()}


def tagged(row: dict[str, Any], tags: dict[str, tuple[str, ...]] | None = None) -> dict[str, float]:
    """The finite figures of a metrics row that ``tags`` (default ``TAGS``) names, as ``namespace/column``."""
    scalars = {}
    for namespace, keys in (TAGS if tags is None else tags).items():
        for key in keys:
            value = finite_float(row.get(key))
            if value is not None:
                scalars[f"{namespace}/{key}"] = value
    return scalars


INSTALL_HINT = install_command("tensorboard")


class TensorBoardWriter:
    """Writes one event file under RUN_DIR/tb; ``write`` once per learner update, ``close`` at the end."""

    def __init__(
        self, run_dir: str | Path, purge_step: int | None = None, tags: dict[str, tuple[str, ...]] | None = None
    ) -> None:
        """``purge_step``: on a resumed run, the first step to be written again (checkpoint's env steps + 1);
        TensorBoard hides the events of the crashed process from that step on, so nothing shows twice."""
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the tensorboard package

        self.tags = TAGS if tags is None else tags
        self.dir = Path(run_dir) / TB_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self._writer: Any = SummaryWriter(log_dir=str(self.dir), flush_secs=FLUSH_SECS, purge_step=purge_step)

    def write(self, step: int, row: dict[str, Any]) -> int:
        """Log the known figures of ``row`` at ``step`` (env steps); returns how many scalars were written."""
        if self._writer is None:
            raise RuntimeError("TensorBoardWriter is closed")
        scalars = tagged(row, self.tags)
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=int(step))
        return len(scalars)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; safe to call twice."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_tensorboard_writer(
    run_dir: str | Path, purge_step: int | None = None, tags: dict[str, tuple[str, ...]] | None = None
) -> TensorBoardWriter | None:
    """A writer for RUN_DIR/tb, or None (one log line) when tensorboard is not installed or cannot load."""
    try:
        return TensorBoardWriter(run_dir, purge_step, tags)
    except ImportError:
        logger.info(f"tensorboard is not installed: no TensorBoard events for this run ({INSTALL_HINT})")
    except Exception as exc:  # a broken install (protobuf mismatch, ...) must not stop training
        logger.warning(f"TensorBoard events disabled: {type(exc).__name__}: {exc}")
    return None
