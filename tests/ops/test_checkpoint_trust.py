"""Reading a checkpoint, which may come from anywhere: the code its run names runs only if allowed; a checkpoint
of an older zddrl still reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from zddrl.algos.core import acting_model
from zddrl.cli import main
from zddrl.config import Config
from zddrl.envs import EnvSpec


def _checkpoint(tmp_path: Path, overrides: dict[str, Any]) -> Path:
    """A checkpoint as the learner writes one, of an untrained CartPole MLP policy; its config with ``overrides``
    set as they are (the config a forger would write, not one zddrl checked)."""
    config = Config().replace({"model.hidden": [8]})
    model = acting_model(config, EnvSpec((4,), True, 2))
    data = config.to_dict()
    for key, value in overrides.items():
        section, name = key.split(".")
        data[section][name] = value
    path = tmp_path / "final.pt"
    torch.save({"config": data, "model": model.state_dict(), "policy_version": 7}, path)
    return path


def test_a_checkpoint_names_code_that_runs_only_if_allowed(tmp_path: Path) -> None:
    """A checkpoint may come from anywhere: an env id, algorithm or network of it that names code (here a shell
    command through env.kwargs) is refused by eval, export and load_policy before anything is imported, unless
    allowed; the file is read without pickle."""
    import zddrl
    from zddrl.learner.checkpoints import read_checkpoint
    from zddrl.learner.runlog import CheckpointError

    marker = tmp_path / "pwned"
    path = _checkpoint(tmp_path, {"env.id": "os:system", "env.kwargs": {"command": f"touch {marker}"}})
    for load in (lambda: read_checkpoint(path), lambda: zddrl.load_policy(path)):
        with pytest.raises(CheckpointError, match="--allow-code os:system") as refused:
            load()
        assert "allow_code=['os:system'] from Python" in str(refused.value)  # load_policy's caller has no command line
    for command in (["eval", str(path)], ["export", str(path), "--format", "torchscript", "-o", str(tmp_path / "x")]):
        done = CliRunner().invoke(main, command)
        assert done.exit_code == 1 and "--allow-code os:system" in done.output, done.output
    assert not marker.exists()


def test_a_checkpoint_of_an_older_zddrl_is_read_with_its_algo_mode(tmp_path: Path) -> None:
    """Before algo.name and algo.schedule, a stored [algo] held `mode` and every algorithm's keys at once."""
    from zddrl.learner.checkpoints import read_checkpoint

    path = _checkpoint(tmp_path, {})
    state = torch.load(path, weights_only=True)
    old = {k: v for k, v in state["config"]["algo"].items() if k not in ("name", "schedule")}
    state["config"]["algo"] = {**old, "mode": "impala", "clip": 0.2, "eps_base": 0.4, "tau": 0.005}
    torch.save(state, path)
    _, config = read_checkpoint(path)
    assert (config.algo.name, config.algo.schedule) == ("impala", "async")


def test_export_finds_the_network_module_where_the_run_imported_it_from(tmp_path: Path) -> None:
    """A run of a network of the user's own records in RUN_DIR/config.toml where its code came from: `zddrl export`
    run anywhere (here, not next to the module and without PYTHONPATH) finds the module there; once it is gone, the
    error says where zddrl looked and how to add a directory."""
    import os
    import shutil
    import subprocess
    import sys

    from zddrl import plugin

    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(Path(__file__).resolve().parents[2] / "examples" / "plugins" / "nets.py", code / "h41_user_nets.py")
    sys.path.append(str(code))
    try:
        config = Config().replace({"model.hidden": [8], "model.kind": "h41_user_nets:make"})
        model = acting_model(config, EnvSpec((4,), True, 2))
    finally:
        sys.path.remove(str(code))
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"config": config.to_dict(), "model": model.state_dict()}, run / "checkpoints" / "final.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", plugin.IMPORT_PATH_VAR)}
    (run / "config.toml").write_text(  # as `zddrl train CONFIG` writes it, CONFIG in code/
        subprocess.run(
            [sys.executable, "-c", "from zddrl import plugin; plugin.importable('code'); print(plugin.record())"],
            cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
        ).stdout
    )  # fmt: skip
    assert plugin.recorded((run / "config.toml").read_text()) == [str(code)]

    def export() -> subprocess.CompletedProcess:
        command = ["export", str(run), "--allow-code", "h41_user_nets:make", "--format", "torchscript", "-o"]
        command.append(str(tmp_path / "p.pt"))
        return subprocess.run(
            [sys.executable, "-m", "zddrl", *command], cwd=run, env=env, capture_output=True, text=True, timeout=120
        )

    done = export()
    assert done.returncode == 0 and (tmp_path / "p.pt").is_file(), done.stderr[-2000:]
    code.rename(tmp_path / "moved")
    done = export()
    assert done.returncode != 0 and "h41_user_nets" in done.stderr and "PYTHONPATH=DIR" in done.stderr, done.stderr
