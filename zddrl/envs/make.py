"""Env ids and their constructors: a zero-argument factory for an ``env.id`` (``env_factory``, ``make_factory``
for a run's ``[env]`` section, ``evaluation_factory``) and the spec of the env it builds (``probe_spec``).

``env.id`` takes every form ``gymnasium.make`` takes: a registered id (``CartPole-v1``, namespaced ``ns/Env-v0``,
versionless ``CartPole``: its highest version), ``module:Env-v0`` (``module`` is imported first, to register the
id), and zddrl's own ``package.module:callable`` (an identifier after the colon), a factory returning a
gymnasium.Env. ``env.kwargs`` go to the constructor (``gymnasium.make(id, **kwargs)`` or ``callable(**kwargs)``);
one that zddrl sets itself from a typed key (``TYPED_KWARGS``) is refused, and one the constructor does not take
is a one-line EnvError when the first env is built. Atari games (ale_py's ids) are built with ``env.atari`` only,
with zddrl's preprocessing (``atari_wrappers``, zddrl.envs.atari). The spaces zddrl supports: zddrl.envs.spaces.

An id with a ``:`` names a module to import (a factory's, or gymnasium's ``module:Env-v0``), which runs its code.
An actor host learns the env id from the network, so it builds such an env only if its own command line
allows that exact id (``zddrl actor --allow-code``): ``env_refusal``, checked before importing. Ids of the local
gymnasium registry import nothing that is not already installed and registered here (ale_py, if installed, to
recognise an Atari id).

Imports zddrl.envs.spaces and zddrl.envs.atari.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import EnvSpec as GymSpec
from gymnasium.envs.registration import find_highest_version, get_env_id, parse_env_id

from zddrl.config import EnvConfig
from zddrl.envs.atari import ALE_VECTOR_KWARGS, atari_wrappers, register_ale
from zddrl.envs.spaces import EnvError, EnvSpec, spec_of
from zddrl.plugin import PICKLED, allow_hint


def env_refusal(env_id: str, allowed: frozenset[str]) -> str:
    """Why a host that allows the ``module:...`` ids ``allowed`` must not build ``env_id`` (nothing imported
    yet), or "": an id that names a module (a factory or gymnasium's ``module:Env-v0``) must be one of them."""
    if ":" in env_id and env_id not in allowed:
        return f"env {env_id!r} names code to import, and this host does not allow it ({allow_hint(env_id)})"
    return ""


ATARI_HINT = "env.id {!r} is an Atari game: set env.atari = true (zddrl's Atari preprocessing; needs the atari extra)"
TYPED_KWARGS = {
    "max_episode_steps": "set env.max_episode_steps instead",
    "render_mode": "zddrl sets it (rgb_array for zddrl eval --video)",
}
"""``env.kwargs`` that zddrl passes to ``gymnasium.make`` itself, and what to do instead."""
ATARI_KWARGS = {
    **TYPED_KWARGS,
    "repeat_action_probability": "set env.repeat_action_probability instead",
    "frameskip": "zddrl's Atari preprocessing takes every frame and steps 4 of them per action (env.atari)",
}
"""The same with ``env.atari``."""


def env_factory(
    env_id: str,
    max_episode_steps: int = 0,
    allowed: frozenset[str] | None = None,
    render_mode: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> Callable[[], gym.Env]:
    """A zero-argument constructor for ``env_id`` (``_registered`` lists the forms), ``kwargs`` passed to it;
    raises EnvError for unknown ids, Atari ids (``env.atari`` builds those: ``make_factory``), bad factories, a
    kwarg in ``TYPED_KWARGS``, and (with ``allowed``: an actor host's list) for an id with a ``:`` not in
    ``allowed``, before importing anything. ``render_mode`` is passed to gymnasium's registered envs (a
    ``module:callable`` env renders as it was made, or as its ``kwargs`` say)."""
    if allowed is not None and env_refusal(env_id, allowed):
        raise EnvError(env_refusal(env_id, allowed))
    user = dict(kwargs or {})
    if env_id.startswith(PICKLED):
        made = _unpickled(env_id)
        return _refusing_kwargs(env_id, user, lambda: _with_limit(made(**user), max_episode_steps))
    module_name, _, attr = env_id.partition(":")
    if attr.isidentifier():  # "pkg.module:make_env"; gymnasium's "module:Env-v0" has a dash
        fn = getattr(_import(env_id, module_name), attr, None)
        if fn is None:
            raise EnvError(f"env factory {env_id!r} cannot be imported: module {module_name!r} has no {attr!r}")
        if not callable(fn):
            raise EnvError(f"env factory {env_id!r} is not callable")
        return _refusing_kwargs(env_id, user, lambda: _with_limit(fn(**user), max_episode_steps))
    make_kwargs = _user_kwargs(user, TYPED_KWARGS)
    spec = _registered(env_id, atari=False)
    if max_episode_steps:
        make_kwargs["max_episode_steps"] = max_episode_steps
    if render_mode is not None:
        make_kwargs["render_mode"] = render_mode
    return _refusing_kwargs(env_id, user, lambda: gym.make(spec.id, **make_kwargs))


def make_factory(
    env: EnvConfig, allowed: frozenset[str] | None = None, render_mode: str | None = None
) -> Callable[[], gym.Env]:
    """``env_factory`` for a run's ``[env]`` section (``env.kwargs`` to the constructor), with its wrappers
    (``env.atari``: ``atari_wrappers``)."""
    if env.kwargs and env.backend == "ale_vector":
        raise EnvError(ALE_VECTOR_KWARGS)
    if not env.atari:
        return env_factory(env.id, env.max_episode_steps, allowed, render_mode, env.kwargs)
    if allowed is not None and env_refusal(env.id, allowed):
        raise EnvError(env_refusal(env.id, allowed))
    kwargs = _user_kwargs(env.kwargs, ATARI_KWARGS)
    spec = _registered(env.id, atari=True)
    # ALE ids skip frames themselves (v5: 4); AtariPreprocessing wants every frame to max-pool the last two.
    kwargs.update(frameskip=1, repeat_action_probability=env.repeat_action_probability)
    if env.max_episode_steps:
        kwargs["max_episode_steps"] = env.max_episode_steps
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    return _refusing_kwargs(env.id, env.kwargs, lambda: atari_wrappers(gym.make(spec.id, **kwargs), env))


def evaluation_factory(env: EnvConfig, render_mode: str | None = None) -> Callable[[], gym.Env]:
    """``make_factory`` for evaluation episodes: whole games, the same whatever the training settings. In Atari
    games that wait for FIRE it is pressed after every lost life (``LifeLoss``; the marks it leaves are not
    used): a greedy policy that never learned to fire would otherwise look at a frozen screen until the time
    limit (a run with ``env.episodic_life`` never needed to)."""
    reference = dataclasses.replace(env, episodic_life=env.atari, backend="gymnasium")  # one env, with LifeLoss
    return make_factory(reference, render_mode=render_mode)


def probe_spec(env: EnvConfig | str, max_episode_steps: int = 0) -> EnvSpec:
    """Build one env of the run (its ``[env]`` section, or a bare id) to read its spaces (the learner never
    steps it)."""
    if isinstance(env, str):
        return spec_of(env_factory(env, max_episode_steps))
    return spec_of(make_factory(env))


def pickled_env(make: Callable[..., gym.Env], path: Path) -> str:
    """Write ``make`` (a class or function, from a script or a notebook too) to ``path`` (owner-only); its env id."""
    import cloudpickle  # gymnasium's own dependency

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        cloudpickle.dump(make, f)
    return f"{PICKLED}{path.resolve()}"


def _unpickled(env_id: str) -> Callable[..., gym.Env]:
    """The callable a ``cloudpickle:PATH`` id names; loaded from this machine's own file (see ``PICKLED``)."""
    import pickle

    path = env_id[len(PICKLED) :]
    try:
        with open(path, "rb") as f:
            made = pickle.load(f)  # noqa: S301 - a file the user's own process wrote, allowed by exact id
    except (OSError, pickle.UnpicklingError, AttributeError, ImportError) as exc:
        raise EnvError(f"env {env_id!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
    if not callable(made):
        raise EnvError(f"env {env_id!r} is not callable")
    return made


def _import(env_id: str, module_name: str) -> ModuleType:
    """The module an allowed ``env_id`` names (imported: its code runs)."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvError(f"env {env_id!r} cannot be imported: {exc}") from None


def _registered(env_id: str, atari: bool) -> GymSpec:
    """The registry entry of a gymnasium id in any form ``gymnasium.make`` takes: ``Env-v0``, ``ns/Env-v0``,
    versionless (its highest version), ``module:Env-v0`` (``module`` imported first: it registers the id).
    Atari ids are refused without ``atari`` (with a hint) and have ale_py register them with it."""
    module_name, _, name = env_id.rpartition(":")
    if module_name:
        _import(env_id, module_name)
    if atari:
        register_ale()
    try:
        spec = _lookup(name)
    except gym.error.Error as exc:
        if not atari and _is_atari(name, None):
            raise EnvError(ATARI_HINT.format(env_id)) from None
        raise EnvError(f"unknown {'Atari' if atari else 'gymnasium'} env id {env_id!r}: {exc}") from None
    if not atari and _is_atari(name, spec):
        raise EnvError(ATARI_HINT.format(env_id))
    return spec


def _lookup(name: str) -> GymSpec:
    """``gymnasium.spec`` of ``name``, a versionless name resolved to its highest version as ``gymnasium.make``
    does."""
    ns, base, version = parse_env_id(name)
    if version is None:
        version = find_highest_version(ns, base)
    return gym.spec(get_env_id(ns, base, version))


def _is_atari(name: str, spec: GymSpec | None) -> bool:
    """Whether ``name`` (its registry entry ``spec``, None if not registered here) is one of ale_py's games: the
    ``ALE/`` namespace, or an entry point in ale_py (ale_py, if installed, registers its ids to be asked)."""
    if name.startswith("ALE/"):
        return True
    if spec is None:
        if importlib.util.find_spec("ale_py") is None:
            return False
        register_ale()
        try:
            spec = _lookup(name)
        except gym.error.Error:
            return False
    return "ale_py" in str(spec.entry_point)


def _user_kwargs(kwargs: Mapping[str, Any], typed: Mapping[str, str]) -> dict[str, Any]:
    """``env.kwargs``, refused (EnvError) where zddrl sets the same constructor kwarg itself (``typed``)."""
    for key in kwargs:
        if key in typed:
            raise EnvError(f"env.kwargs sets {key!r}: {typed[key]}")
    return dict(kwargs)


def _refusing_kwargs(env_id: str, kwargs: Mapping[str, Any], make: Callable[[], gym.Env]) -> Callable[[], gym.Env]:
    """``make``, with the TypeError of a constructor that does not take ``env.kwargs`` turned into a one-line
    EnvError (gymnasium raises it only when the env is built: the first is ``probe_spec``'s)."""
    if not kwargs:
        return make

    def build() -> gym.Env:
        try:
            return make()
        except TypeError as exc:
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            first = first.split(" was raised from the environment creator")[0]  # gymnasium's suffix repeats kwargs
            raise EnvError(f"env {env_id!r} does not take env.kwargs {dict(kwargs)}: {first}") from None

    return build


def _with_limit(env: gym.Env, max_episode_steps: int) -> gym.Env:
    if not isinstance(env, gym.Env):
        raise EnvError(f"env factory returned {type(env).__name__}, not a gymnasium.Env")
    return gym.wrappers.TimeLimit(env, max_episode_steps) if max_episode_steps else env
