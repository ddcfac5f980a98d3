"""When the learner writes checkpoints, and which run directories may be written or resumed.

The first checkpoint is written right after the first update, so that a run killed in its first
minute can still be resumed (or restarted by `zddrl train`); then every ``train.checkpoint_every``
updates (when set) and every ``train.checkpoint_every_s`` seconds, and a final one at a clean end; also every
``train.video_every`` updates, which `zddrl train` films (ops/filming.py).
``check_run_dir`` is the one place that decides whether a run directory may be used: `zddrl train`,
`zddrl learner` and the learner node itself all call it. ``read_checkpoint`` is how everything else (`zddrl eval`,
`zddrl export`, ``zddrl.load_policy``) reads one: a checkpoint may come from anywhere, so the code its config
names (an env, an algorithm or a network ``module:attr``) is imported only if the caller allows it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from zddrl.config import Config, ConfigError, TrainConfig, load_config
from zddrl.envs import env_refusal
from zddrl.learner.runlog import CheckpointError, RunLog, latest_checkpoint, load_checkpoint
from zddrl.plugin import PluginError, import_recorded


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
        before = load_config(saved, stored=True)
        for section in ("env", "model"):
            if getattr(before, section) != getattr(config, section):
                raise ConfigError(f"--resume: [{section}] differs from the run's {saved}; resume with it")
        if before.algo.name != config.algo.name:
            raise ConfigError(f"--resume: algo.name differs from the run's {saved} ({before.algo.name!r})")
    return checkpoint


def read_checkpoint(path: str | Path, allowed: frozenset[str] = frozenset()) -> tuple[dict[str, Any], Config]:
    """A checkpoint's state and its run's config; CheckpointError (one line) for a file that is not one, or whose
    config names code (``module:attr``) that ``allowed`` does not list exactly (nothing is imported then)."""
    state = load_checkpoint(path)
    search_recorded(Path(path))
    if not {"config", "model"} <= state.keys():
        raise CheckpointError(f"{path} is not a zddrl checkpoint: it holds no config and model")
    try:
        config = Config.from_dict(state["config"], allowed=allowed, stored=True)
    except PluginError as exc:
        raise CheckpointError(f"{path}: its run's {exc}") from None
    except ConfigError as exc:
        raise CheckpointError(f"{path}: its run's config is refused: {exc}") from None
    why = env_refusal(config.env.id, allowed)
    if why:
        raise CheckpointError(f"{path}: its run's {why}")
    return state, config


def search_recorded(path: Path) -> None:
    """Make importable the directories the run of the checkpoint ``path`` (RUN_DIR/checkpoints/*.pt) imported its
    code from, as its config.toml records them (``plugin.record``) and where they still exist: a module next to the
    config the run was started with is found again. Only what ``allowed`` names is ever imported."""
    if path.parent.name != "checkpoints":
        return
    try:
        import_recorded((path.parent.parent / "config.toml").read_text())
    except (OSError, UnicodeDecodeError):
        return


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
        every, film = self.train.checkpoint_every, self.train.video_every  # a video is filmed from a checkpoint
        if self.last_updates < 0 or time.monotonic() >= self.next_s:
            return True
        return any(k and updates % k == 0 for k in (every, film))

    def write(self, state: dict[str, Any], version: int, updates: int, final: bool = False) -> Path:
        path = self.runlog.checkpoint(state, f"ckpt-{version:08d}.pt", keep=self.train.keep_checkpoints)
        if final:
            self.runlog.checkpoint(state, "final.pt")
        self.last_updates = updates
        self.next_s = time.monotonic() + self.train.checkpoint_every_s
        return path
