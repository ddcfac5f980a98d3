"""`zddrl plot`: a PNG from real run directories (one short `zddrl train`, reused), and clear errors."""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from loguru import logger

from zddrl.ops.plot import PlotError, count_label, figure, has_return, load_run, plot_runs

ROOT = Path(__file__).resolve().parents[2]
CARTPOLE = str(ROOT / "examples" / "cartpole_ppo.toml")
NEEDS_MPL = "matplotlib is not installed (pip install 'zddrl[plot]')"


def zddrl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zddrl", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG, after checking its signature and IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run directory: `zddrl train` CartPole for 3000 env steps (a few seconds)."""
    path = tmp_path_factory.mktemp("plot") / "run"
    done = zddrl("train", CARTPOLE, "--run-dir", str(path), "--max-steps", "3000", "--max-seconds", "90")
    assert done.returncode == 0, done.stderr[-3000:]
    return path


@pytest.mark.slow
def test_load_run_reads_a_real_run_with_empty_return_cells(run_dir: Path) -> None:
    run = load_run(run_dir)
    steps, ret = run.series["env_steps"], run.series["return_mean_20"]
    assert len(steps) >= 5 and steps == sorted(steps) and steps[-1] >= 3000
    assert math.isnan(ret[0])  # fewer than 20 episodes after the first update: an empty cell
    assert run.series["staleness_max"] == [0.0] * len(steps)  # the sync schedule
    assert run.label() == "cartpole_ppo, ppo (sync), seed 1"
    assert run.target == 475.0 and run.env_id == "CartPole-v1"


@pytest.mark.slow
def test_plot_writes_a_png_from_a_real_run(run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason=NEEDS_MPL)
    out = tmp_path / "out.png"
    done = zddrl("plot", str(run_dir), "-o", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(out)
    width, height = png_size(out)
    assert width >= 1000 and height >= 700
    assert out.stat().st_size > 30_000  # four panels of axes, curves and text, not a blank canvas


@pytest.mark.slow
def test_plot_overlays_two_runs(run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason=NEEDS_MPL)
    other = tmp_path / "async-run"
    shutil.copytree(run_dir, other)
    summary = json.loads((other / "summary.json").read_text())
    (other / "summary.json").write_text(json.dumps({**summary, "schedule": "async", "seed": 2}))
    twin = tmp_path / "twin"  # same name, algorithm and seed as run_dir: the legend adds the directory name
    shutil.copytree(run_dir, twin)
    (twin / "summary.json").unlink()  # a run in progress: label from config.toml, no target line
    one, three = tmp_path / "one.png", tmp_path / "three.png"
    plot_runs([run_dir], one)
    done = zddrl("plot", str(run_dir), str(other), str(twin), "-o", str(three))
    assert done.returncode == 0, done.stderr[-3000:]
    assert png_size(three) == png_size(one)
    assert three.read_bytes() != one.read_bytes()
    assert load_run(other).label() == "cartpole_ppo, ppo (async), seed 2"
    assert load_run(twin).label() == "cartpole_ppo, ppo (sync), seed 1" and load_run(twin).target is None


@pytest.mark.slow
def test_plot_of_a_dir_without_metrics_is_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    out = tmp_path / "out.png"
    done = zddrl("plot", str(empty), "-o", str(out))
    assert done.returncode != 0
    assert "no metrics.csv" in done.stderr and str(empty) in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "empty or not a zddrl metrics file"),
        ("wall_s,env_steps,return_mean_20\n", "has no rows yet"),
        ("a,b\n1,2\n", "no column wall_s, env_steps"),
    ],
)
def test_plot_of_an_empty_or_foreign_metrics_file_is_a_clear_error(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "metrics.csv").write_text(content)
    with pytest.raises(PlotError, match=message):
        plot_runs([tmp_path], tmp_path / "out.png")


@pytest.mark.slow
def test_plot_without_matplotlib_says_how_to_install_it(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # makes the import raise ImportError
    with pytest.raises(PlotError, match=r"install.*\[plot\]"):
        plot_runs([run_dir], tmp_path / "out.png")
    assert not (tmp_path / "out.png").exists()


def test_step_ticks_read_k_and_m_never_milli() -> None:
    assert [count_label(x) for x in (0, 750, 10_000, 25_000, 1_750, 2_500_000, 3e9)] == [
        "0",
        "750",
        "10k",
        "25k",
        "1.75k",
        "2.5M",
        "3G",
    ]
    assert count_label(0.01) == "0.01"  # EngFormatter wrote "10m": read as 10 million steps


def test_a_run_with_no_return_yet_gets_a_note_and_a_warning(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason=NEEDS_MPL)
    rows = "".join(f"{i * 0.5},{i * 1000},2000,,0,0\n" for i in range(1, 31))
    (tmp_path / "metrics.csv").write_text("wall_s,env_steps,sps,return_mean_20,staleness_mean,staleness_max\n" + rows)
    lines: list[str] = []
    sink = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        plot_runs([tmp_path], tmp_path / "out.png")
    finally:
        logger.remove(sink)
    assert png_size(tmp_path / "out.png")[0] >= 1000
    assert [line.strip() for line in lines] == [
        f"{tmp_path}: no return to plot yet (fewer than 20 episodes finished): its return curves are empty"
    ]
    assert not has_return(load_run(tmp_path))
    fig = figure([load_run(tmp_path)])
    fig.canvas.draw()
    ret_steps, ret_wall = fig.axes[:2]
    for ax in (ret_steps, ret_wall):
        assert [t.get_text() for t in ax.texts] == ["no return yet:\nfewer than 20 episodes finished"]
    assert ret_steps.get_xlim() == (0, 30_000)  # the run's steps, not an empty 0..0.05 axis
    assert "30k" in [t.get_text() for t in ret_steps.get_xticklabels()]


@pytest.mark.parametrize("runs", [2, 3, 6])
def test_the_legend_of_runs_labelled_by_their_directories_fits_in_the_figure(tmp_path: Path, runs: int) -> None:
    pytest.importorskip("matplotlib", reason=NEEDS_MPL)
    from zddrl.ops.plot import Run

    series = {c: [1.0, 2.0, 3.0] for c in ("wall_s", "env_steps", "sps", "return_mean_20")}
    series |= {"staleness_mean": [0.0] * 3, "staleness_max": [0.0] * 3}
    summary = {"algorithm": "ppo", "schedule": "sync", "seed": 1, "target_return": 475.0, "reached": True}
    summary |= {"env_steps_to_target": 2.0, "wall_s_to_target": 2.0}
    config = {"name": "cartpole_ppo", "env": {"id": "CartPole-v1"}}
    same = [Run(tmp_path / f"cartpole_ppo-20261203-10111{i}-1a2b", series, summary, config) for i in range(runs)]
    fig = figure(same)
    fig.canvas.draw()
    legend = fig.legends[0].get_window_extent()
    assert "cartpole_ppo-20261203-101110-1a2b" in fig.legends[0].get_texts()[0].get_text()
    assert 0 <= legend.x0 and legend.x1 <= fig.bbox.width and legend.y0 >= 0, (legend, fig.bbox)
