"""``[algo]``: the keys every algorithm shares (``AlgoConfig``) and, beside them, the algorithm's own (its spec's
``settings`` dataclass), found by ``algo.name`` through ``zddrl.plugin``.

Parsing a table must know the algorithm's keys, so this module reaches the algorithm's spec by name, the one place
a layer below ``zddrl.algos`` reaches code above it, by design: algorithms are plug-ins, and a built-in's spec module
(``zddrl/algos/<name>/__init__.py``) imports nothing heavier than numpy. ``zddrl.config`` re-exports all of it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from zddrl import plugin
from zddrl.tomlconf import ConfigError, with_guess
from zddrl.tomlconf import build as _build
from zddrl.tomlconf import require as _require

SCHEDULES = ("constant", "linear")
"""Learning-rate (and clip) schedules."""


@dataclass(frozen=True)
class AlgoConfig:
    """How the learner learns: the keys every algorithm shares, and ``settings``, the algorithm's own keys.

    In TOML both sit in one ``[algo]`` table; the keys this class does not declare belong to the algorithm
    ``name`` chooses, whose spec declares them in a dataclass of its own (``AlgorithmSpec.settings``)."""

    name: str = "ppo"
    """The algorithm: ppo (clipped surrogate; truncated IS when data is stale) | impala (V-trace) | apex (Ape-X
    dueling double DQN) | sac (soft actor-critic) | ``package.module:ALGORITHM`` (a spec of your own:
    docs/extending.md); apex and sac learn from a replay buffer ([replay])."""
    schedule: str = "auto"
    """When the learner updates and with which data: sync (every actor samples with the newest version, one round
    per update) | async (actors never wait; data up to ``bus.max_staleness`` versions old, corrected by the algorithm)
    | auto (the algorithm's first: sync for ppo, async for the others)."""
    batch_size: int = 256
    """Env steps per update, summed over all actors; fixed whatever the number of actors. apex/sac: env steps taken
    into the replay buffer per update (each update then takes ``replay.replay_ratio`` gradient steps per step)."""
    gamma: float = 0.99
    """Discount factor."""
    lr: float = 3e-4
    """Adam learning rate (start value of the schedule)."""
    lr_schedule: str = "constant"
    """constant | linear (to 0 at total_steps)."""
    max_grad_norm: float = 0.5
    """Global gradient-norm clip."""
    normalize_obs: bool = False
    """Running mean/std of observations, applied by actors; the statistics travel with the parameters."""
    normalize_reward: bool = False
    """Scale rewards by the running std of the discounted return (learner side, per env stream)."""
    total_steps: int = 100_000
    """Horizon of the linear schedules, in env steps trained on."""
    staleness_lr_decay: float = 0.0
    """Async schedule: learning rate divided by (1 + this * mean staleness of the batch)."""
    settings: Any = None
    """The algorithm's own keys (its spec's ``settings`` dataclass), built from the rest of ``[algo]``."""

    def __post_init__(self) -> None:
        spec = algorithm_spec(self.name)
        if self.settings is None:  # built in code, not from a table: the algorithm's defaults
            object.__setattr__(self, "settings", spec.settings())
        if self.schedule == "auto":
            object.__setattr__(self, "schedule", spec.schedules[0])
        _require(self.schedule in SCHEDULES_OF_RUNS, f"algo.schedule must be one of {SCHEDULES_OF_RUNS}")
        _require(
            self.schedule in spec.schedules,
            f"algo.schedule {self.schedule!r}: algorithm {self.name!r} runs with {spec.schedules} only",
        )
        _require(
            isinstance(self.settings, spec.settings),
            f"algo.settings of algorithm {self.name!r} must be a {spec.settings.__name__}, "
            f"got a {type(self.settings).__name__}",
        )
        _require(self.batch_size >= 1, "algo.batch_size must be >= 1")
        _require(0.0 < self.gamma <= 1.0, "algo.gamma must be in (0, 1]")
        _require(self.lr > 0, "algo.lr must be > 0")
        _require(self.lr_schedule in SCHEDULES, f"algo.lr_schedule must be one of {SCHEDULES}")
        _require(self.max_grad_norm > 0, "algo.max_grad_norm must be > 0")
        _require(self.total_steps >= 1, "algo.total_steps must be >= 1")
        _require(self.staleness_lr_decay >= 0, "algo.staleness_lr_decay must be >= 0")

    def table(self) -> dict[str, Any]:
        """The ``[algo]`` table: the shared keys and the algorithm's own, side by side."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "settings"}
        return {**shared, **dataclasses.asdict(self.settings)}


SCHEDULES_OF_RUNS = ("sync", "async", "auto")
SHARED_ALGO_KEYS = frozenset(f.name for f in dataclasses.fields(AlgoConfig)) - {"settings"}
MOVED_KEYS = {
    "max_in_flight": "bus",
    "max_staleness": "bus",
    "publish_every": "learner",
    "straggler_factor": "learner",
    "min_round_timeout_s": "learner",
    "torch_threads": "learner",
}
"""Keys ``[algo]`` held before they moved to the framework's sections (docs/configuration.md says why): a config
that sets them there is refused with the new key; a stored one (a run directory's, a checkpoint's) is moved."""


@functools.lru_cache(maxsize=1)
def run_kinds() -> dict[str, tuple[str, str]]:
    """Short labels of the built-in (algorithm, schedule) pairs: how benchmarks and tests name their runs, and the
    values of the ``algo.mode`` key of configs that zddrl wrote before ``algo.name`` and ``algo.schedule`` (stored
    ones are read with it; one a user writes is refused with the keys that replace it). Made from the one table of
    built-in algorithms (``plugin.BUILTIN_ALGORITHMS``) and their specs' schedules: an algorithm of one schedule is
    labelled by its name (impala, apex, sac), one of several by each schedule (ppo: sync, async)."""
    kinds: dict[str, tuple[str, str]] = {}
    for name in plugin.BUILTIN_ALGORITHMS:
        schedules = algorithm_spec(name).schedules
        for schedule in schedules:
            kinds[schedule if len(schedules) > 1 else name] = (name, schedule)
    return kinds


def run_kind(label: str) -> dict[str, str]:
    """``{"algo.name": ..., "algo.schedule": ...}`` overrides of a ``run_kinds`` label."""
    name, schedule = run_kinds()[label]
    return {"algo.name": name, "algo.schedule": schedule}


def run_kind_args(label: str) -> list[str]:
    """The `zddrl train`/`learner` options of a ``run_kinds`` label."""
    name, schedule = run_kinds()[label]
    return ["--algorithm", name, "--schedule", schedule]


def kind_label(name: str, schedule: str) -> str:
    """The ``run_kinds`` label of an algorithm and schedule (the algorithm's name when it has none)."""
    return next((label for label, pair in run_kinds().items() if pair == (name, schedule)), name)


@functools.lru_cache(maxsize=64)
def algorithm_spec(name: str, allowed: frozenset[str] | None = None) -> Any:
    """The spec object ``algo.name`` names (``zddrl.algos.spec.AlgorithmSpec``; a ``module:attr`` must be allowed:
    ``zddrl.plugin``); ConfigError if it cannot be loaded or is not a spec."""
    spec = plugin.load(plugin.algorithm_reference(name), "algo.name", allowed)
    _require(
        all(hasattr(spec, a) for a in ("settings", "schedules", "learner")),
        f"algo.name {name!r} does not name an AlgorithmSpec (zddrl.algos.spec)",
    )
    clash = sorted({f.name for f in dataclasses.fields(spec.settings)} & SHARED_ALGO_KEYS)
    _require(not clash, f"algo.name {name!r}: its settings redeclare the shared [algo] keys {clash}")
    return spec


def algo_from_table(table: Any, allowed: frozenset[str] | None, stored: bool = False) -> AlgoConfig:
    """``[algo]`` -> AlgoConfig: the shared keys, and the rest as the named algorithm's settings. ``stored``: a
    config zddrl wrote (a run directory's, a checkpoint's), read with ``stored_table``."""
    _require(isinstance(table, dict), "algo must be a table")
    if stored:
        table = stored_table(table, allowed)
    moved = [k for k in MOVED_KEYS if k in table]
    if moved:
        new = ", ".join(f"{MOVED_KEYS[k]}.{k}" for k in moved)
        raise ConfigError(
            f"{', '.join(f'algo.{k}' for k in moved)} moved out of [algo], the algorithm's section: write {new} "
            "instead (docs/configuration.md)"
        )
    if "mode" in table:
        name, schedule = run_kinds().get(str(table["mode"]), ("ppo", "sync"))
        raise ConfigError(
            f"algo.mode was split in two: write algo.name = {name!r} and algo.schedule = {schedule!r} "
            f"instead of algo.mode = {table['mode']!r}"
        )
    name = table.get("name", "ppo")
    _require(isinstance(name, str), "algo.name must be a string")
    spec = algorithm_spec(name, allowed)
    own = {k: v for k, v in table.items() if k not in SHARED_ALGO_KEYS}
    shared = {k: v for k, v in table.items() if k in SHARED_ALGO_KEYS}
    mine = [f.name for f in dataclasses.fields(spec.settings)]
    unknown = sorted(set(own) - set(mine))
    _require(
        not unknown,
        f"unknown config key(s) {', '.join(with_guess('algo.', k, {*mine, *SHARED_ALGO_KEYS}) for k in unknown)} "
        f"for algorithm {name!r}; its own keys: {', '.join(mine) or 'none'}; every algorithm's: "
        f"{', '.join(sorted(SHARED_ALGO_KEYS))}",
    )
    settings = _build(spec.settings, own, "algo.")
    algo: AlgoConfig = _build(AlgoConfig, {**shared, "settings": settings, "name": name}, "algo.")
    return algo


def stored_table(table: dict[str, Any], allowed: frozenset[str] | None) -> dict[str, Any]:
    """A stored ``[algo]`` as this version reads it: ``mode`` (written before ``name`` and ``schedule`` existed)
    becomes the two, and keys of other algorithms (the one flat table of every algorithm's keys of that time) go."""
    if "mode" not in table or "name" in table:
        return table
    name, schedule = run_kinds().get(str(table["mode"]), ("ppo", "sync"))
    mine = {f.name for f in dataclasses.fields(algorithm_spec(name, allowed).settings)}
    kept = {k: v for k, v in table.items() if k in SHARED_ALGO_KEYS or k in mine}
    return {**kept, "name": name, "schedule": schedule}


def reset_for(name: str, table: dict[str, Any]) -> dict[str, Any]:
    """``table`` (a config's ``[algo]``) for switching to algorithm ``name``: the shared keys and those of the
    old algorithm's that ``name``'s settings declare too (epochs, ent_coef, ...) are kept, the schedule is the new
    algorithm's default."""
    mine = {f.name for f in dataclasses.fields(algorithm_spec(name).settings)}
    kept = {k: v for k, v in table.items() if k in SHARED_ALGO_KEYS or k in mine}
    return {**kept, "name": name, "schedule": "auto"}
