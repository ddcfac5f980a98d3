"""TensorBoard events: namespaced scalars under RUN_DIR/tb, empty and NaN values skipped, optional dependency."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from zddrl.learner.runlog import METRIC_COLUMNS
from zddrl.learner.tensorboard import TAGS, TensorBoardWriter, make_tensorboard_writer


def _row(step: int, **changes: object) -> dict[str, object]:
    """A learner row as RunLog.write gets it: every column, numbers as the learner computes them."""
    row: dict[str, object] = {c: float(i + step) for i, c in enumerate(METRIC_COLUMNS)}
    row.update(env_steps=step, policy_version=step // 256, staleness_hist="0:256", **changes)
    return row


def _read(tb_dir: Path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard is not installed (pip install 'zddrl[tensorboard]')",
    )
    acc = event_accumulator.EventAccumulator(str(tb_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return acc


def test_every_tag_is_a_metrics_csv_column_under_its_namespace() -> None:
    keys = [k for ks in TAGS.values() for k in ks]
    assert len(keys) == len(set(keys))
    assert set(keys) <= set(METRIC_COLUMNS)
    assert set(TAGS) == {"charts", "losses", "perf"}


def test_writer_logs_namespaced_scalars_and_skips_empty_and_nan_values(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'zddrl[tensorboard]')")
    with TensorBoardWriter(tmp_path) as tb:
        # first updates: no return yet (NaN from the learner, or an empty CSV cell), no rho outside impala
        assert (
            tb.write(256, _row(256, return_mean_20=math.nan, grad_norm=None, clipfrac=""))
            == sum(map(len, TAGS.values())) - 3
        )
        tb.write(512, _row(512, return_mean_20=21.5, value_loss=math.inf))
        tb.write(768, _row(768, return_mean_20=30.0))
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 0

    acc = _read(tmp_path / "tb")
    expected = {f"{ns}/{k}" for ns, keys in TAGS.items() for k in keys}
    assert set(acc.Tags()["scalars"]) == expected
    ret = acc.Scalars("charts/return_mean_20")
    assert [(e.step, e.value) for e in ret] == [(512, 21.5), (768, 30.0)]
    assert [e.step for e in acc.Scalars("losses/grad_norm")] == [512, 768]
    assert [e.step for e in acc.Scalars("losses/clipfrac")] == [512, 768]
    assert [e.step for e in acc.Scalars("losses/value_loss")] == [256, 768]
    assert [e.value for e in acc.Scalars("charts/policy_version")] == [1.0, 2.0, 3.0]
    lr_index = METRIC_COLUMNS.index("lr")
    assert [e.value for e in acc.Scalars("perf/lr")] == pytest.approx([lr_index + s for s in (256, 512, 768)])


def test_close_is_idempotent_and_write_after_close_fails(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'zddrl[tensorboard]')")
    tb = TensorBoardWriter(tmp_path)
    tb.close()
    tb.close()
    with pytest.raises(RuntimeError, match="closed"):
        tb.write(1, _row(1))


def test_make_writer_returns_a_writer_when_tensorboard_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'zddrl[tensorboard]')")
    tb = make_tensorboard_writer(tmp_path / "run")
    assert isinstance(tb, TensorBoardWriter)
    tb.close()
    assert (tmp_path / "run" / "tb").is_dir()


def test_make_writer_returns_none_with_one_info_line_without_tensorboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loguru import logger

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import raise ImportError
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(f"{m.record['level'].name} {m.record['message']}"), level="DEBUG")
    try:
        assert make_tensorboard_writer(tmp_path) is None
    finally:
        logger.remove(sink)
    assert len(lines) == 1 and lines[0].startswith("INFO ") and "[tensorboard]" in lines[0]
    assert not (tmp_path / "tb").exists()


def test_a_resumed_run_hides_the_events_written_after_its_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'zddrl[tensorboard]')")
    with TensorBoardWriter(tmp_path) as tb:  # the crashed process: checkpoint at 512 env steps, then 768 and 1024
        for step in (256, 512, 768, 1024):
            tb.write(step, _row(step, return_mean_20=1.0))
    with TensorBoardWriter(tmp_path, purge_step=513) as tb:  # the resumed one redoes 768, 1024, then goes on
        for step in (768, 1024, 1280):
            tb.write(step, _row(step, return_mean_20=2.0))
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    ret = _read(tmp_path / "tb").Scalars("charts/return_mean_20")
    assert [(e.step, e.value) for e in ret] == [(256, 1.0), (512, 1.0), (768, 2.0), (1024, 2.0), (1280, 2.0)]


def test_an_algorithms_own_figures_become_columns_and_scalars_and_undeclared_ones_are_named(tmp_path: Path) -> None:
    """A user's algorithm declares ``grad_variance`` (group perf): metrics.csv gets the column after the standard
    ones and TensorBoard ``perf/grad_variance``; ``mystery``, which it reports undeclared, is named once in the log
    and written nowhere."""
    from loguru import logger

    from zddrl.algos.spec import Figure
    from zddrl.learner.runlog import RunLog

    lines: list[str] = []
    sink = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        log = RunLog(tmp_path / "run", {"algo": {"name": "mine:ALGORITHM"}}, figures=(Figure("grad_variance", "perf"),))
        for step in (256, 512):
            log.write(_row(step, grad_variance=0.5 * step, mystery=1.0))
        log.close()
    finally:
        logger.remove(sink)
    header = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[: len(METRIC_COLUMNS)] == list(METRIC_COLUMNS) and header[len(METRIC_COLUMNS) :] == ["grad_variance"]
    assert "mystery" not in header
    named = [line for line in lines if "mystery" in line]
    assert len(named) == 1 and "'mine:ALGORITHM'" in named[0] and "not declared" in named[0]
    scalars = _read(tmp_path / "run" / "tb").Tags()["scalars"]  # skips here without tensorboard
    assert "perf/grad_variance" in scalars and not any("mystery" in tag for tag in scalars)


def test_zddrl_train_says_on_the_console_how_to_watch_the_run_or_get_tensorboard(monkeypatch, tmp_path: Path) -> None:
    import importlib.util

    from zddrl.ops import train

    assert train.tensorboard_hint(tmp_path) == f"TensorBoard: tensorboard --logdir {tmp_path / 'tb'}"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert 'install -c constraints.txt -e ".[tensorboard]"' in train.tensorboard_hint(tmp_path)  # README's form
