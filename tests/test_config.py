"""Typed config: one source of defaults, TOML loading, dotted overrides, clear errors."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from zddrl.algoconf import run_kinds
from zddrl.config import Config, ConfigError, load_config, parse_override, to_toml

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_examples_load_and_round_trip_through_toml(path: Path, tmp_path: Path) -> None:
    config = load_config(path)
    out = tmp_path / "resolved.toml"
    out.write_text(to_toml(config.to_dict()))
    assert load_config(out) == config


def test_defaults_and_overrides() -> None:
    config = load_config(None, {"algo.lr": 1e-3, "env.num_envs": 8, "train.until_return": 400})
    assert config.algo.lr == 1e-3 and config.env.num_envs == 8 and config.train.until_return == 400.0
    assert config.algo.gamma == Config().algo.gamma
    assert math.isinf(Config().train.until_return)
    assert Config.from_dict(Config().to_dict()) == Config()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"algo.lrr": 1.0}, "unknown config key"),
        ({"algo.name": "turbo"}, "algo.name must be one of"),
        ({"algo.mode": "impala"}, "algo.mode was split in two: write algo.name = 'impala' and algo.schedule = 'async'"),
        ({"algo.eps_base": 0.3}, "unknown config key.*for algorithm 'ppo'"),
        ({"algo.name": "impala", "algo.schedule": "sync"}, r"runs with \('async',\) only"),
        ({"algo.name": "nosuch.module:ALGO"}, "cannot be imported"),
        ({"model.kind": "nosuch"}, "model.kind must be one of"),
        ({"env.num_envs": 0}, "env.num_envs must be >= 1"),
        ({"algo.lr": "fast"}, "algo.lr must be a number"),
        ({"algo.norm_adv": 1}, "must be true or false"),
        ({"nosuch.key": 1}, "unknown config section"),
        ({"model.hidden": [64, "x"]}, "model.hidden must be a list of integers"),
    ],
)
def test_bad_values_name_the_key(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_an_unknown_key_names_the_likely_one_in_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, {"algo.lrr": 1.0, "algo.zzzz": 1})
    message = str(err.value)
    assert "unknown config key(s) algo.lrr (did you mean algo.lr?), algo.zzzz for algorithm 'ppo'; its own" in message
    assert "\n" not in message


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[algo\nlr = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_parse_override_reads_toml_values() -> None:
    assert parse_override("algo.lr=1e-3") == ("algo.lr", 1e-3)
    assert parse_override("algo.norm_adv=false") == ("algo.norm_adv", False)
    assert parse_override("model.hidden=[32, 32]") == ("model.hidden", [32, 32])
    assert parse_override("env.id=CartPole-v1") == ("env.id", "CartPole-v1")
    with pytest.raises(ConfigError):
        parse_override("no-equals-sign")


def test_a_misspelt_section_names_the_likely_one_and_lists_the_sections() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, {"trian.max_steps": 5})
    assert str(err.value) == (
        "unknown config section 'trian' (did you mean train?); sections: env, model, algo, bus, replay, train, learner"
    )


@pytest.mark.parametrize(
    "key, meant",
    [
        ("learning_rate", "algo.lr"),
        ("algo.learning_rate", "algo.lr"),
        ("algo.n_epochs", "algo.epochs"),
        ("algo.clip_range", "algo.clip"),
        ("train.gamma", "algo.gamma"),
        ("total_timesteps", "train.max_steps"),
        ("algo.num_envs", "env.num_envs"),
        ("algo.n_steps", "algo.batch_size? It counts the env steps of an update over all envs: n_steps x n_envs."),
        ("model.net_arch", "model.hidden"),
    ],
)
def test_names_from_sb3_and_cleanrl_point_to_zddrls_key(key: str, meant: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"unknown config key(s) {key} (did you mean {meant}")):
        load_config(None, {key: 1})


def test_every_habit_points_to_a_real_key() -> None:
    from zddrl.tomlconf import HABITS

    defaults = Config().to_dict()
    for name, meant in HABITS.items():
        section, key = meant.split(" ")[0].split(".")
        assert key in defaults[section], f"{name} -> {meant}: no such key"


def test_a_run_directorys_config_makes_the_directories_its_code_came_from_importable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`zddrl train RUN_DIR/config.toml --resume RUN_DIR` finds the run's own modules where the run first imported
    them from (the config's record, docs/extending.md), and records them again; a directory gone since is skipped."""
    import sys

    from zddrl import plugin

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv(plugin.IMPORT_PATH_VAR, raising=False)
    code, gone = tmp_path / "code", tmp_path / "gone"
    code.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(f"{plugin.RECORD}{json.dumps([str(code), str(gone)])}\n[env]\nnum_envs = 2\n")
    assert load_config(run / "config.toml").env.num_envs == 2
    assert str(code) in sys.path and str(gone) not in sys.path
    assert plugin.recorded(plugin.record()) == [str(run), str(code)]


MOVED = {
    "max_in_flight": ("bus", 3),
    "max_staleness": ("bus", 7),
    "publish_every": ("learner", 2),
    "straggler_factor": ("learner", 4.0),
    "min_round_timeout_s": ("learner", 0.2),
    "torch_threads": ("learner", 3),
}
"""The framework's keys that [algo] held (algoconf.MOVED_KEYS): their section now, and a value unlike the default."""


@pytest.mark.parametrize("key", sorted(MOVED))
def test_a_key_that_left_algo_is_refused_in_one_line_naming_its_new_place(key: str, tmp_path: Path) -> None:
    section, value = MOVED[key]
    path = tmp_path / "old.toml"
    path.write_text(f"[algo]\nname = 'ppo'\n{key} = {value}\n")
    for load in (lambda: load_config(path), lambda: load_config(None, {f"algo.{key}": value})):
        with pytest.raises(ConfigError) as err:
            load()
        message = str(err.value)
        assert f"algo.{key} moved out of [algo]" in message and f"write {section}.{key} instead" in message
        assert "\n" not in message
    assert getattr(getattr(load_config(None, {f"{section}.{key}": value}), section), key) == value, "--set works"


def test_a_stored_config_with_the_old_keys_is_read_with_them_moved(tmp_path: Path) -> None:
    """A run directory's config.toml or a checkpoint's config, written before the keys left [algo]."""
    old = Config().to_dict()
    old["algo"] |= {key: value for key, (_, value) in MOVED.items()}
    old["algo"]["schedule"] = "async"
    old["bus"] = {}
    old["learner"] = {k: v for k, v in old["learner"].items() if k not in MOVED}
    path = tmp_path / "config.toml"
    path.write_text(to_toml(old))
    for config in (load_config(path, stored=True), Config.from_dict(old, stored=True)):
        for key, (section, value) in MOVED.items():
            assert getattr(getattr(config, section), key) == value, key
        assert config.hello_bus() == {"sync": False, "max_staleness": 7, "max_in_flight": 3}
    with pytest.raises(ConfigError, match="moved out of"):
        load_config(path)  # a config the user writes is refused, not migrated


def test_the_run_labels_come_from_the_built_in_algorithms() -> None:
    """Benchmarks' labels and the values of the old algo.mode key (stored configs hold them) stay what they were."""
    assert run_kinds() == {
        "sync": ("ppo", "sync"),
        "async": ("ppo", "async"),
        "impala": ("impala", "async"),
        "apex": ("apex", "async"),
        "sac": ("sac", "async"),
    }
