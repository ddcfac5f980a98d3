"""W&B logging (train.wandb_project): the run's figures under TensorBoard's names and its config, read back from
the files an offline run writes (no network, no account)."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from zddrl.config import Config, ConfigError
from zddrl.learner.runlog import RunLog

if importlib.util.find_spec("wandb") is None:  # not imported here: ~3 s of every collection
    pytest.skip("wandb is not installed", allow_module_level=True)
pytestmark = [pytest.mark.slow, pytest.mark.serial]  # wandb starts a service process of its own, with its own timeouts


def test_an_offline_run_holds_the_figures_and_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # takes precedence over the config's "online": never the network here
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = Config(name="wandb-test").replace(
        {"train.wandb_project": "zddrl-tests", "train.wandb_run_name": "offline-check", "train.wandb_mode": "online"}
    )
    log = RunLog(tmp_path / "run", config.to_dict())
    for step in (1024, 2048, 1024):  # the third as after a learner's restart from a checkpoint: kept, not dropped
        log.write(
            {
                "env_steps": step,
                "policy_version": step // 1024,
                "return_mean_20": -20.0 + step / 1024,
                "entropy": 1.7,
                "sps": float("nan"),
            }
        )
    log.close()
    (run,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    (records,) = run.glob("run-*.wandb")  # what `wandb sync` uploads later
    kinds, history, config_items, runs = read_records(records)
    assert runs == [("zddrl-tests", "offline-check")], runs
    assert [h["env_steps"] for h in history] == [1024, 2048, 1024], history
    assert history[1]["charts/return_mean_20"] == -18.0 and history[1]["losses/entropy"] == 1.7
    assert all("charts/sps" not in h for h in history)  # a NaN figure is left out, as in TensorBoard
    assert config_items.get("name") == "wandb-test", sorted(config_items)
    assert config_items["train"]["wandb_project"] == "zddrl-tests"


BLOCK = 32 * 1024
HEADER = 7
"""A .wandb file: ``:W&B`` + a 2-byte magic + a version byte, then LevelDB's log format (32 KiB blocks of records:
crc32c (4 bytes), length (2, little endian), type (1: full, 2: first, 3: middle, 4: last), data), each record a
protobuf ``Record``. Read here with nothing of wandb but its protobuf classes: its own reader is not public."""


def read_records(path: Path) -> tuple[dict, list[dict], dict, list[tuple[str, str]]]:
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", raw[:8]
    pos, pending, kinds, history, config, runs = HEADER, b"", {}, [], {}, []
    while pos + 7 <= len(raw):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a record header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = struct.unpack_from("<HB", raw, pos + 4)
        if kind == 0:
            break
        pending += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            which = record.WhichOneof("record_type")
            kinds[which] = kinds.get(which, 0) + 1
            if which == "history":
                history.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
            elif which == "config":
                config.update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif which == "run":  # the config given to wandb.init travels in the run record
                runs.append((record.run.project, record.run.display_name))
                config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return kinds, history, config, runs


def test_the_mode_is_checked() -> None:
    with pytest.raises(ConfigError, match="train.wandb_mode must be one of"):
        Config().replace({"train.wandb_mode": "sometimes"})
