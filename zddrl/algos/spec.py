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
    replay: bool = False
    """Learns from a replay buffer ([replay]; ``replay.placement`` may put it in `zddrl replay` services)."""
    fixed_rollout_len: bool = False
    """Every trajectory of a batch must have the version's rollout length (IMPALA stacks them time-major)."""
    bounded_actions: bool = False
    """Continuous actions on the wire must lie within the env's bounds (the actors send squashed actions)."""


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
