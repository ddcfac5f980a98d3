"""`zddrl plot` (being written)."""
from __future__ import annotations

from pathlib import Path


def plot_runs(run_dirs: list[Path], output: Path) -> None:  # pragma: no cover - replaced
    raise NotImplementedError("zddrl plot is being written")
