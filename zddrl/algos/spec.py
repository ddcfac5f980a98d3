"""An algorithm as one unit: the spec object every part of zddrl reads instead of branching on its name.

An algorithm package (``zddrl/algos/ppo``, or a file of the user's own: docs/extending.md) exports one
``AlgorithmSpec``: its own ``[algo]`` keys (a dataclass), the schedules it runs under, the learner core it
builds, the network that travels to the actors and the policy they act with, its checks and the figures its
updates report. ``algo.name`` chooses it (``zddrl.plugin``); ``algo.schedule`` chooses when the learner
updates (sync rounds or an async stream), which is the framework's business, not the algorithm's, beyond saying
which schedules it corrects for.

A spec module should import cheaply: the config reads its ``settings`` to parse ``[algo]`` in every process that
reads a run, actors included, so the built-in specs reach their torch code through small functions and name
gymnasium's types for the type checker only. A plug-in in one file (examples/plugins/a2c.py) imports torch at its
top, which costs its actors torch's import time at start-up, nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from zddrl.config import Config, algorithm_spec

if TYPE_CHECKING:  # pragma: no cover - types only: a spec module must not import torch
    import torch

    from zddrl.algos.core import LearnerCore
    from zddrl.algos.policy import Policy
    from zddrl.envs import EnvSpec
    from zddrl.shards.group import ShardGroup

FIGURE_GROUPS = ("charts", "losses", "perf", "replay")
"""TensorBoard namespaces of the figures (``losses/entropy``)."""


@dataclass(frozen=True)
class Figure:
    """A number an update reports: a metrics.csv column, the TensorBoard scalar ``group/name``, a `zddrl status`
    figure and a W&B metric, all of one name."""

    name: str
    group: str = "losses"

    def __post_init__(self) -> None:
        if self.group not in FIGURE_GROUPS:
            raise ValueError(f"figure {self.name!r}: group must be one of {FIGURE_GROUPS}, got {self.group!r}")


class ActingVersion(NamedTuple):
    """What an actor host builds its policy from: a version's parameters and where the host stands."""

    flat: np.ndarray
    """The parameters, one float32 buffer (``zddrl.algos.flat``)."""
    layout: list
    """``[name, shape]`` per tensor of the acting network, in ``flat``'s order."""
    extras: Mapping[str, np.ndarray]
    """Arrays that travel with the version (observation statistics: ``obs_mean``, ``obs_var``)."""
    config: Config
    env: EnvSpec
    actor_id: int = 0
    num_envs: int = 0
    """Envs of this host (0: the config's)."""


def no_refusal(config: Config, env: EnvSpec) -> str:
    return ""


ARRAY_DTYPES = ("float32", "float16", "int64", "int32", "uint8", "bool")
"""Dtypes a declared array may have (a subset of the wire's)."""
ARRAY_PER = ("step", "rollout")
"""``step``: ``[T, N, *shape]``, one row per env step; ``rollout``: ``[N, *shape]``, one row per env of a rollout (a
recurrent core's state at the rollout's first step)."""


@dataclass(frozen=True)
class DeclaredArray:
    """An array the actors of an algorithm record beyond the ones every trajectory carries (docs/extending.md,
    "Declared arrays"). The learner's hello carries the run's declaration and the brokers check every trajectory
    against it (docs/protocol.md section 7.1): an array not declared, or of another dtype or shape, is refused."""

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    """The row's shape: ``()`` for one number per step and env."""
    per: str = "step"
    """``step`` or ``rollout`` (ARRAY_PER)."""
    sent: bool = True
    """False: recorded on the actor for the policy's ``finish_rollout`` and left off the wire (Ape-X's Q values of
    the actions taken become the TD errors it sends)."""

    def __post_init__(self) -> None:
        if not (self.name.isidentifier() and len(self.name) <= 64):
            raise ValueError(f"declared array {self.name!r}: the name must be a Python identifier of <= 64 chars")
        if self.dtype not in ARRAY_DTYPES:
            raise ValueError(f"declared array {self.name!r}: dtype must be one of {ARRAY_DTYPES}, got {self.dtype!r}")
        if self.per not in ARRAY_PER:
            raise ValueError(f"declared array {self.name!r}: per must be one of {ARRAY_PER}, got {self.per!r}")
        if not all(isinstance(d, int) and d >= 1 for d in self.shape) or len(self.shape) > 4:
            raise ValueError(f"declared array {self.name!r}: shape must be at most 4 sizes >= 1, got {self.shape}")

    def rows(self, T: int, N: int) -> tuple[int, ...]:
        """The array's full shape in a rollout of ``T`` steps of ``N`` envs."""
        return (T, N, *self.shape) if self.per == "step" else (N, *self.shape)

    def to_wire(self) -> list:
        """``[name, dtype, shape, per]``: one entry of the hello's ``bus.arrays``."""
        return [self.name, self.dtype, list(self.shape), self.per]


@dataclass(frozen=True)
class ReplayFeed:
    """A replay algorithm's data feed: its trajectories go into a replay buffer (``[replay]``; in the learner, or in
    `zddrl replay` services with ``replay.placement = "service"``) and its core samples from there."""

    priorities: str = ""
    """The declared per-step array that holds the actors' TD errors, the transitions' first priorities (Ape-X
    declares one); "": every transition starts at the buffer's largest priority."""


FEEDS = ("rollouts", "local_replay", "replay_service")
"""Where a learner shard's core gets its data (``AlgorithmSpec.feed``)."""


def _actor_critic_export(net: torch.nn.Module, env: EnvSpec, obs_rms: Mapping | None) -> torch.nn.Module:
    from zddrl.algos.exported import ActorCriticPolicy

    return ActorCriticPolicy(net, env, obs_rms)


@dataclass(frozen=True)
class AlgorithmSpec:
    """Everything zddrl needs to know of an algorithm; see the module docstring."""

    name: str
    """Short name, for logs and summaries."""
    settings: type
    """A frozen dataclass of the algorithm's own ``[algo]`` keys, with defaults (zddrl.tomlconf checks the types
    from its hints); its field names must differ from the shared ones (``config.SHARED_ALGO_KEYS``)."""
    schedules: tuple[str, ...]
    """``sync`` and/or ``async``; the first is the default. ``async`` means the core corrects for stale data."""
    learner: Callable[[Config, EnvSpec, ShardGroup], LearnerCore]
    """Builds the learner core: ``update(trajectories, staleness) -> figures`` (zddrl.algos.core.LearnerCore)."""
    acting_model: Callable[[Config, EnvSpec], torch.nn.Module]
    """Builds the network whose parameters travel to the actors (the core's ``model``; a checkpoint's ``model``)."""
    acting_policy: Callable[[ActingVersion], Policy]
    """Builds what an actor acts with from a version (zddrl.algos.policy.Policy)."""
    figures: tuple[Figure, ...] = ()
    """The figures ``update`` returns beyond the ones every core reports (``core.CORE_FIGURES``); a figure not
    declared is logged as such, once, and left out of the metrics."""
    check: Callable[[Config, EnvSpec], str] = no_refusal
    """Why this algorithm cannot learn in a run of this config and env, or "" (checked before anything starts)."""
    arrays: tuple[DeclaredArray, ...] | Callable[[Config, EnvSpec], tuple[DeclaredArray, ...]] = ()
    """The arrays its actors record beyond every trajectory's own (``DeclaredArray``), filled from the acting
    policy's ``ActOutput.extras`` (per step), ``begin_rollout()`` (per rollout) or ``finish_rollout`` (either); or a
    function of the run's config and env giving them (a shape that depends on the action space or a model size).
    Read through ``declared_arrays``."""
    replay: ReplayFeed | None = None
    """Learns from a replay buffer (``ReplayFeed``); None: from the rollouts as they arrive."""
    export: Callable[[torch.nn.Module, EnvSpec, Mapping | None], torch.nn.Module] = _actor_critic_export
    """Wraps the acting network as the module `zddrl export` writes: ``(net, env, obs_rms) -> module`` whose
    ``forward(obs)`` returns ``(action, dist_params)`` and whose ``outputs()`` describes them (zddrl.algos.exported).
    The default fits a network whose ``forward(obs)`` returns ``(dist_params, value)``."""
    fixed_rollout_len: bool = False
    """Every trajectory of a batch must have the version's rollout length (IMPALA stacks them time-major)."""
    bounded_actions: bool = False
    """Continuous actions on the wire must lie within the env's bounds (the actors send squashed actions)."""


def feed(spec: AlgorithmSpec, config: Config) -> str:
    """Where a learner shard of ``spec`` in a run of ``config`` gets its data: one of FEEDS."""
    if spec.replay is None:
        return "rollouts"
    return "replay_service" if config.replay.placement == "service" else "local_replay"


def declared_arrays(spec: AlgorithmSpec, config: Config, env: EnvSpec) -> tuple[DeclaredArray, ...]:
    """The arrays ``spec`` declares for a run of ``config`` on ``env``; ValueError if they are not DeclaredArrays of
    distinct names."""
    arrays = spec.arrays(config, env) if callable(spec.arrays) else spec.arrays
    if not all(isinstance(a, DeclaredArray) for a in arrays) or len({a.name for a in arrays}) != len(arrays):
        raise ValueError(f"algorithm {spec.name!r}: arrays must be DeclaredArrays of distinct names, got {arrays!r}")
    return tuple(arrays)


def sent_arrays(spec: AlgorithmSpec, config: Config, env: EnvSpec) -> tuple[DeclaredArray, ...]:
    """The declared arrays a trajectory of ``spec`` carries (the learner's hello declares them)."""
    return tuple(a for a in declared_arrays(spec, config, env) if a.sent)


def algorithm(name: str, allowed: frozenset[str] | None = None) -> AlgorithmSpec:
    """The spec ``algo.name`` names; ConfigError (one line) if it cannot be loaded or is not a spec."""
    spec = algorithm_spec(name, allowed)
    if not isinstance(spec, AlgorithmSpec):
        from zddrl.config import ConfigError

        raise ConfigError(f"algo.name {name!r} names a {type(spec).__name__}, not a zddrl.algos.spec.AlgorithmSpec")
    return spec


def algorithm_of(config: Config) -> AlgorithmSpec:
    """The spec of ``config``'s algorithm (already vetted when the config was built)."""
    return algorithm(config.algo.name)


def declared(spec: AlgorithmSpec, core_figures: tuple[Figure, ...]) -> dict[str, Figure]:
    """Figure name -> figure, for everything a core of ``spec`` may report."""
    return {f.name: f for f in (*core_figures, *spec.figures)}
