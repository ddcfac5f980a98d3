"""The progress line: `zddrl train` prints it from metrics.csv, and a standalone learner logs the same line
(every PROGRESS_LINE_EVERY_S) instead of staying silent until its summary."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

from loguru import logger

from fakes import FakeChannel, FakeLink
from zddrl.config import Config
from zddrl.learner.node import LearnerNode
from zddrl.learner.poll import ShardPoller
from zddrl.learner.progress import progress_line
from zddrl.learner.rounds import CollectedBatch
from zddrl.learner.runlog import METRIC_COLUMNS
from zddrl.ops.train import progress_from_metrics
from zddrl.shards.group import ShardGroup


def test_the_line_shows_steps_sps_return_and_version() -> None:
    assert progress_line(12.34, 10240, 512.4, math.nan, 7) == (
        "[  12.3 s] steps    10,240  sps     512  return       -  version 7"
    )
    assert "return   21.35  version 8" in progress_line(1.0, 1, 1.0, 21.35, 8)


def test_zddrl_train_prints_the_same_line_from_metrics_csv(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.csv"
    with open(metrics, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=METRIC_COLUMNS)
        w.writeheader()
        w.writerow({"env_steps": 10240, "sps": "512.4", "return_mean_20": "21.35", "policy_version": 8})
    line = progress_from_metrics(metrics, time.time() - 3.0)
    assert line is not None and line.endswith(progress_line(3.0, 10240, 512.4, 21.35, 8).split("]", 1)[1])


def test_a_learner_logs_its_progress_line_at_most_every_period(tmp_path: Path) -> None:
    config = Config().replace({"algo.batch_size": 16, "env.rollout_len": 8})
    n = LearnerNode("tcp://127.0.0.1:9", config, tmp_path / "run")
    n.own = n.open_run()
    n.link = FakeLink({"a": 1, "b": 1})
    n.poller = ShardPoller(n.link, FakeChannel, "r", ShardGroup(), n._mismatch, logger, n._asked_len)
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format="{message}")
    try:
        for _ in range(3):  # three updates at once: one line, the next is due a period later
            assert n._step(CollectedBatch([], 0.0, 0))
    finally:
        logger.remove(sink)
        n.own.runlog.close()
    progress = [line for line in lines if "] steps " in line]
    assert len(progress) == 1, lines
    assert "steps         0" in progress[0] and "return       -  version 1" in progress[0]
