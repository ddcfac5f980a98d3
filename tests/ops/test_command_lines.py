"""Command lines and console lines of `zddrl train` and `zddrl learner`: the supervisor's child command,
the summary line of a run without updates, the install hint in README's form, the wait for the first actor, the
free ports it chooses."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from zddrl import proc
from zddrl.ops import train
from zddrl.ops.restart import SUPERVISOR_OPTIONS, without_options

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv",
    [
        ["learner", "c.toml", "--connect", "tcp://B:5555", "--run-dir", "runs/x", "--restart", "3"],
        ["learner", "c.toml", "--connect=tcp://B:5555", "--run-dir=runs/x", "--restart=3", "--resume"],
        ["learner", "--run-dir", "runs/x", "c.toml", "--restart", "3", "--connect", "tcp://B:5555", "--t0", "1.5"],
    ],
)
def test_the_supervisor_takes_its_own_options_out_of_the_childs_command_line(argv: list[str]) -> None:
    child = without_options(argv, SUPERVISOR_OPTIONS, ("--resume",))
    assert [a for a in child if "c.toml" in a or "B:5555" in a] == [a for a in argv if "c.toml" in a or "B:5555" in a]
    assert not any(a.startswith(("--run-dir", "--restart", "--t0", "--resume")) or a in ("runs/x", "3") for a in child)


def test_arguments_after_a_double_dash_are_kept() -> None:
    assert without_options(["learner", "--restart", "2", "--", "--restart"], SUPERVISOR_OPTIONS) == [
        "learner",
        "--",
        "--restart",
    ]


def test_the_summary_line_says_no_update_rather_than_none() -> None:
    assert train._first("update", {"wall_s_first_update": 2.5}) == "first update at 2.5 s"
    assert train._first("update", {"wall_s_first_update": None}) == "no update"
    assert train._first("trajectory", {}) == "no trajectory"


def test_the_install_hint_is_readmes_command_in_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    command = proc.install_command("tensorboard")
    if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():
        assert command == '.venv/bin/pip install -c constraints.txt -e ".[tensorboard]"'
        assert '`.venv/bin/pip install -c constraints.txt -e ".[NAME]"`' in (ROOT / "README.md").read_text()
    else:
        assert command == f'{sys.executable} -m pip install -c constraints.txt -e ".[tensorboard]"'
    monkeypatch.chdir(ROOT / "docs")
    assert proc.install_command("tensorboard").startswith(f"cd {ROOT} && ")


def test_a_learner_without_actors_says_every_so_often_that_it_waits_for_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from zddrl.learner import rounds

    lines: list[str] = []
    log = SimpleNamespace(info=lines.append)
    ledger = SimpleNamespace(first_s={})
    clock = [100.0]
    monkeypatch.setattr(rounds.time, "monotonic", lambda: clock[0])
    waiting = rounds.WaitingLine(log)
    for t in (100.0, 110.0, 129.0, 130.0, 140.0, 159.0, 160.5):
        clock[0] = t
        waiting.tick(ledger)  # type: ignore[arg-type]
    assert lines == [
        "waiting for actors: none has sent a trajectory yet (30 s)",
        "waiting for actors: none has sent a trajectory yet (60 s)",
    ]
    ledger.first_s["wall_s_first_trajectory"] = 1.0
    clock[0] = 500.0
    waiting.tick(ledger)  # type: ignore[arg-type]
    waiting.tick(None)
    assert len(lines) == 2


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the range the kernel gives connecting sockets their local ports from, so that none is given the port
    between the choice and the bind of the process that listens on it; bind(0)'s pick where no room is left."""
    top = proc._ephemeral_start()
    ports = proc.free_ports(12)
    assert len(set(ports)) == 12 and all(proc.LOWEST_PORT <= p < top for p in ports), ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    monkeypatch.setattr(proc, "_ephemeral_start", lambda: proc.LOWEST_PORT + 10)
    assert all(p > 0 for p in proc.free_ports(3))
