"""Typed dataclasses from TOML: the checks of values against type hints, CLI overrides, and TOML out.

Generic over frozen dataclasses (nested ones are tables); ``zddrl.config`` holds the sections and the one
source of defaults. An unknown key or a value of the wrong type is a :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import typing
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration that cannot be used; the text names the key and the reason."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def coerce(value: Any, hint: Any, key: str, none_is_inf: frozenset[str] = frozenset()) -> Any:
    """``value`` as ``hint`` says, or ConfigError naming ``key``; a None for a key of ``none_is_inf`` is infinity
    (TOML has no null: such keys are written as absent, msgpack and JSON as null)."""
    origin = typing.get_origin(hint) or hint
    if origin is float:
        if value is None and key in none_is_inf:
            return math.inf
        require(isinstance(value, (int, float)) and not isinstance(value, bool), f"{key} must be a number")
        return float(value)
    if origin is int:
        require(isinstance(value, int) and not isinstance(value, bool), f"{key} must be an integer")
        return value
    if origin is bool:
        require(isinstance(value, bool), f"{key} must be true or false")
        return value
    if origin is str:
        require(isinstance(value, str), f"{key} must be a string")
        return value
    if origin is dict:
        require(isinstance(value, dict) and all(isinstance(k, str) for k in value), f"{key} must be a table")
        require(_tomlish(value), f"{key} must hold TOML values only (strings, numbers, booleans, lists, tables)")
        return dict(value)
    if origin is tuple:
        item = typing.get_args(hint)[0]
        ok = (int,) if item is int else (int, float)
        require(
            isinstance(value, (list, tuple)) and all(isinstance(v, ok) and not isinstance(v, bool) for v in value),
            f"{key} must be a list of {'integers' if item is int else 'numbers'}",
        )
        return tuple(item(v) for v in value)
    return value


def _tomlish(value: Any) -> bool:
    """What TOML can write and read back the same (no null, no other objects)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _tomlish(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_tomlish(v) for v in value)
    return isinstance(value, (str, int, float, bool))


def build(cls: type, data: Any, prefix: str, none_is_inf: frozenset[str] = frozenset()) -> Any:
    require(isinstance(data, dict), f"{prefix or 'config'} must be a table")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    require(
        not unknown,
        f"unknown config key(s) {', '.join(with_guess(prefix, k, known) for k in unknown)}; "
        f"known in {prefix.rstrip('.') or 'top level'}: {', '.join(sorted(known))}",
    )
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[name] = build(hint, value, f"{prefix}{name}.", none_is_inf)
        else:
            kwargs[name] = coerce(value, hint, f"{prefix}{name}", none_is_inf)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - guarded by the unknown-key check
        raise ConfigError(str(exc)) from None


HABITS: dict[str, str] = {
    "learning_rate": "algo.lr",
    "n_epochs": "algo.epochs",
    "update_epochs": "algo.epochs",
    "num_minibatches": "algo.minibatches",
    "clip_range": "algo.clip",
    "clip_coef": "algo.clip",
    "ent_coef": "algo.ent_coef",
    "vf_coef": "algo.vf_coef",
    "gae_lambda": "algo.gae_lambda",
    "gamma": "algo.gamma",
    "max_grad_norm": "algo.max_grad_norm",
    "normalize_advantage": "algo.norm_adv",
    "norm_adv": "algo.norm_adv",
    "anneal_lr": 'algo.lr_schedule = "linear"',
    "n_steps": "algo.batch_size",
    "num_steps": "algo.batch_size",
    "total_timesteps": "train.max_steps",
    "n_envs": "env.num_envs",
    "num_envs": "env.num_envs",
    "env_id": "env.id",
    "seed": "env.seed",
    "net_arch": "model.hidden",
    "activation_fn": "model.activation",
    "buffer_size": "replay.capacity",
    "learning_starts": "replay.learning_starts",
}
"""Stable-Baselines3's and CleanRL's names (and zddrl keys in the wrong section) -> the zddrl key that means the same;
only names with a true equivalent (SB3's ``batch_size`` is a minibatch, zddrl's an update: not listed)."""

HABIT_NOTES = {
    "n_steps": "It counts the env steps of an update over all envs: n_steps x n_envs.",
    "num_steps": "It counts the env steps of an update over all envs: num_steps x num_envs.",
}
"""Where the equivalent is not one to one, what to write."""


def with_guess(prefix: str, key: str, known: set[str]) -> str:
    """``prefix + key``, and the key it most likely means: a habit from another library (``HABITS``), else the
    known key it misspells. The list of every known key follows, but the one meant is hard to spot in it."""
    habit = HABITS.get(key)
    if habit is not None and not habit.startswith(f"{prefix}{key}"):
        note = f" {HABIT_NOTES[key]}" if key in HABIT_NOTES else ""
        return f"{prefix}{key} (did you mean {habit}?{note})"
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f"{prefix}{key} (did you mean {prefix}{close[0]}?)" if close else f"{prefix}{key}"


def unknown_section(name: str, sections: list[str]) -> str:
    """The error for a dotted key whose section does not exist: the likely one and every section."""
    close = difflib.get_close_matches(name, sections, n=1)
    guess = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown config section {name!r}{guess}; sections: {', '.join(sections)}"


def parse_override(text: str) -> tuple[str, Any]:
    """``"algo.lr=1e-3"`` -> ``("algo.lr", 0.001)``; the value is read as a TOML value, else a string."""
    key, sep, raw = text.partition("=")
    require(bool(sep) and bool(key.strip()), f"override {text!r} must look like section.key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip(), value


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


def to_toml(config: dict[str, Any]) -> str:
    """A config dict (``Config.to_dict()``) as TOML: top-level scalars, then one table per section."""
    lines = [f"{k} = {toml_value(v)}" for k, v in config.items() if not isinstance(v, dict)]
    for section, table in config.items():
        if isinstance(table, dict):
            lines.append(f"\n[{section}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"
