"""`zddrl learner`'s options that cannot go together: one usage error each, before anything starts."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from zddrl.cli import main

CONFIG = "examples/cartpole_ppo.toml"


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--resume"], "--resume needs --run-dir"),
        (["--gpus", "cpu:2", "--shards", "2"], "give --gpus or --shards, not both"),
        (["--restart", "2", "--nnodes", "2"], "--restart supports one node"),
    ],
)
def test_options_that_cannot_go_together_are_one_usage_error(options: list[str], says: str) -> None:
    result = CliRunner().invoke(main, ["learner", CONFIG, "--connect", "tcp://127.0.0.1:1", *options])
    assert result.exit_code == 2 and says in result.output


def test_restart_under_torchrun_says_what_to_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = CliRunner().invoke(main, ["learner", CONFIG, "--connect", "tcp://127.0.0.1:1", "--restart", "2"])
    assert result.exit_code == 2 and "under torchrun use its --max-restarts" in result.output


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("bus.max_in_flight=0", "bus.max_in_flight must be >= 1"),
        ("bus.max_staleness=-1", "bus.max_staleness must be >= 0"),
        ("algo.max_in_flight=2", "algo.max_in_flight moved out of [algo], the algorithm's section: write bus.max_in"),
    ],
)
def test_a_run_that_cannot_work_is_refused_in_one_line_before_anything_starts(key: str, says: str) -> None:
    """The broker routes runs it does not read (docs/protocol.md 5.1): the learner is where an actor window of 0
    is refused, before it announces the run."""
    result = CliRunner().invoke(main, ["learner", CONFIG, "--connect", "tcp://127.0.0.1:1", "--set", key])
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert result.exit_code == 2 and len(errors) == 1 and says in errors[0], result.output
