"""Weights & Biases logging of a run (optional: the ``wandb`` extra), next to metrics.csv and TensorBoard.

``train.wandb_project`` turns it on. The learner's main shard logs the same figures as TensorBoard under the same
names (``charts/return_mean_20``, ``losses/entropy``, ...; ``tensorboard.tagged``) against ``env_steps``, and the
run's config. The W&B run id is derived from the run directory's path, so a resumed run (``--resume``, or a
learner restarted by ``zddrl train``) continues the same W&B run. ``make_wandb_writer`` returns None, with one log
line, when it is off, not installed or fails to start: logging must never stop training.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from loguru import logger

from zddrl.learner.tensorboard import tagged
from zddrl.proc import install_command

INSTALL_HINT = install_command("wandb")
STEP_METRIC = "env_steps"
"""The x axis of every figure (a logged metric, not wandb's own step)."""


class WandbWriter:
    """``write(step, row)`` once per learner update, ``close()`` at the end."""

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        project: str,
        name: str,
        mode: str,
        tags: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        self.tags = tags
        import wandb  # ImportError without the extra

        run_dir = Path(run_dir).resolve()
        self._run: Any = wandb.init(
            project=project,
            name=name or run_dir.name,
            id=hashlib.sha1(str(run_dir).encode()).hexdigest()[:16],
            resume="allow",
            # wandb lets mode= override WANDB_MODE; the environment is the user's last word (a CI job, a laptop
            # offline), as for every other wandb setting
            mode=os.environ.get("WANDB_MODE") or mode,  # type: ignore[arg-type]  # checked when the config was read
            dir=str(run_dir),
            config=config,
        )
        # Figures are plotted against env steps, a metric of their own, not wandb's step: after a resume or a
        # learner's restart the env steps go back to the checkpoint's, and wandb drops rows whose step went back.
        self._run.define_metric(STEP_METRIC)
        self._run.define_metric("*", step_metric=STEP_METRIC)

    def write(self, step: int, row: dict[str, Any]) -> int:
        """Log the known figures of ``row`` at ``step`` (env steps); returns how many were logged."""
        values = tagged(row, self.tags)
        if values and self._run is not None:
            self._run.log({STEP_METRIC: int(step), **values})
        return len(values)

    def close(self) -> None:
        """Finish the run (offline: its files are complete); safe to call twice."""
        if self._run is not None:
            self._run.finish()
            self._run = None


def make_wandb_writer(
    run_dir: Path, config: dict[str, Any], tags: dict[str, tuple[str, ...]] | None = None
) -> WandbWriter | None:
    """A writer when ``config``'s ``train.wandb_project`` is set and wandb starts, else None."""
    train = config.get("train", {})
    project = train.get("wandb_project", "")
    if not project:
        return None
    try:
        name, mode = train.get("wandb_run_name", ""), train.get("wandb_mode", "online")
        return WandbWriter(run_dir, config, project, name, mode, tags)
    except ImportError:
        logger.warning(f"train.wandb_project is set but wandb is not installed: no W&B logging ({INSTALL_HINT})")
    except Exception as exc:  # no login, no network, a broken install: the run goes on without it
        first_line = (str(exc).strip().splitlines() or [""])[0]
        logger.warning(f"W&B logging disabled: {type(exc).__name__}: {first_line}")
    return None
