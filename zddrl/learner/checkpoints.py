"""When the learner writes checkpoints, and which run directories may be written or resumed.

The first checkpoint is written right after the first update, so that a run killed in its first
minute can still be resumed (or restarted by `zddrl train`); then every ``train.checkpoint_every``
updates (when set) and every ``train.checkpoint_every_s`` seconds, and a final one at a clean end.
``check_run_dir`` is the one place that decides whether a run directory may be used: `zddrl train`,
`zddrl learner` and the learner node itself all call it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from zddrl.config import Config, ConfigError, TrainConfig, load_config
from zddrl.learner.runlog import RunLog, latest_checkpoint


def check_run_dir(config: Config, run_dir: Path | None, resume: bool) -> Path | None:
    """The checkpoint to resume from (None for a new run); ConfigError when ``run_dir`` may not be used so.

    A run directory is continued only with --resume and with the same env and model (its config.toml);
    a new run never writes into a directory that holds another run's checkpoints."""
    if run_dir is None:
        if resume:
            raise ConfigError("--resume needs the run directory to continue")
        return None
    checkpoint = latest_checkpoint(run_dir)
    if not resume:
        if checkpoint is not None:
            raise ConfigError(
                f"{run_dir} holds the checkpoints of another run: continue it with --resume, "
                "or choose another --run-dir"
            )
        return None
    if checkpoint is None:
        raise ConfigError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
    saved = run_dir / "config.toml"
    if saved.exists():
        before = load_config(saved)
        for section in ("env", "model"):
            if getattr(before, section) != getattr(config, section):
                raise ConfigError(f"--resume: [{section}] differs from the run's {saved}; resume with it")
    return checkpoint


class Checkpoints:
    """``due(updates)`` after each update; ``write(state, version, updates)`` when it is (and at the end)."""

    def __init__(self, runlog: RunLog, train: TrainConfig) -> None:
        self.runlog = runlog
        self.train = train
        self.last_updates = -1
        """The update count of the newest checkpoint this process wrote (-1: none yet)."""
        self.next_s = time.monotonic() + train.checkpoint_every_s

    def due(self, updates: int) -> bool:
        if updates < 1 or updates == self.last_updates:
            return False
        every = self.train.checkpoint_every
        return self.last_updates < 0 or bool(every and updates % every == 0) or time.monotonic() >= self.next_s

    def write(self, state: dict[str, Any], version: int, updates: int, final: bool = False) -> Path:
        path = self.runlog.checkpoint(state, f"ckpt-{version:08d}.pt", keep=self.train.keep_checkpoints)
        if final:
            self.runlog.checkpoint(state, "final.pt")
        self.last_updates = updates
        self.next_s = time.monotonic() + self.train.checkpoint_every_s
        return path
