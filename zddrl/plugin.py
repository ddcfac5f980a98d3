"""Code named in a config: ``module:attr`` references to algorithms, models and envs, loaded by import.

A run config names code of its own with a ``module:attr`` string (``algo.name = "mypkg.myalgo:ALGORITHM"``,
``model.kind = "mypkg.nets:make"``, ``env.id = "mypkg.envs:make"``). Loading one imports that module, which runs
its code, so a process that learned the name from the network (an actor host, a replay service: the run spec
reaches them from the broker) loads only the references its own command line allows, exactly
(``--allow-code``); ``allowed=None`` is a process reading the user's own config file, which trusts it. zddrl's
own algorithms are named by short names (``ppo``) that map to references inside zddrl, always allowed.

Where the module is looked up: installed packages, ``PYTHONPATH``, and the directory of the config file
(``importable``): a config's ``algo.name = "myalgo:ALGORITHM"`` finds ``myalgo.py`` next to the TOML file, in
`zddrl train` and in the learner and actors it starts. A run directory's config.toml records those directories
(``record``), and what reads it or the run's checkpoints looks there too (``import_recorded``).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from zddrl.tomlconf import ConfigError

BUILTIN_ALGORITHMS = {
    "ppo": "zddrl.algos.ppo:ALGORITHM",
    "impala": "zddrl.algos.impala:ALGORITHM",
    "apex": "zddrl.algos.apex:ALGORITHM",
    "sac": "zddrl.algos.sac:ALGORITHM",
}
"""The algorithms that ship with zddrl: ``algo.name`` -> the spec object's reference."""

PICKLED = "cloudpickle:"
"""``cloudpickle:PATH``: an env given to ``zddrl.train`` as a Python callable or class, pickled by value into a
file of the run by the calling process, which alone may have made it (``pickled_env``). A process loads it only if
that exact id is allowed (the ones ``zddrl.train`` starts are); one joining from the network never gets it."""

_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class PluginError(ConfigError):
    """A ``module:attr`` reference that is malformed, not allowed here, or cannot be imported."""


def is_reference(name: str) -> bool:
    """``"pkg.module:attr"`` (an identifier after the colon): names code to import."""
    return bool(_REFERENCE.match(name))


def refusal(reference: str, allowed: frozenset[str] | None) -> str:
    """Why this process must not import ``reference`` (nothing imported yet), or ""."""
    if allowed is None or reference in allowed or reference in BUILTIN_ALGORITHMS.values():
        return ""
    return f"{reference!r} names code to import, and this host does not allow it ({allow_hint(reference)})"


def allow_hint(reference: str) -> str:
    """How to allow ``reference``, for a refusal's message: the process may be a command or a Python caller
    (``zddrl.load_policy``), so both spellings."""
    return f"allow it: --allow-code {reference} on the command line, allow_code=[{reference!r}] from Python"


def load(reference: str, what: str, allowed: frozenset[str] | None = None) -> Any:
    """The object ``reference`` (``module:attr``) names; PluginError, one line naming ``what`` (the config key),
    when it is malformed, refused by ``allowed`` (checked before importing) or cannot be imported."""
    if not is_reference(reference):
        raise PluginError(f"{what} {reference!r} must look like 'package.module:attr'")
    why = refusal(reference, allowed)
    if why:
        raise PluginError(f"{what}: {why}")
    module_name, _, attr = reference.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"{what} {reference!r} cannot be imported: {exc} ({searched()})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"{what} {reference!r}: module {module_name!r} has no attribute {attr!r}") from None


def algorithm_reference(name: str) -> str:
    """``algo.name`` -> the reference of its spec: a built-in's, or the name itself (``module:attr``)."""
    if name in BUILTIN_ALGORITHMS:
        return BUILTIN_ALGORITHMS[name]
    if not is_reference(name):
        raise PluginError(
            f"algo.name must be one of {tuple(BUILTIN_ALGORITHMS)} or a 'package.module:ALGORITHM' of your own, "
            f"got {name!r}"
        )
    return name


IMPORT_PATH_VAR = "ZDDRL_IMPORT_PATH"
"""How the directories made importable here reach the processes this one starts (learner, shards, actors, a replay
service): they inherit it and zddrl's command line reads it (``importable_from_environment``). Not ``PYTHONPATH``,
whose entries would come before the standard library's."""


def importable(directory: str | Path) -> None:
    """Put ``directory`` (a config file's) last on the import path of this process and of the processes it starts,
    once. Last: a file next to a config never shadows an installed module."""
    path = str(Path(directory).resolve())
    if path not in sys.path:
        sys.path.append(path)
    known = os.environ.get(IMPORT_PATH_VAR, "").split(os.pathsep)
    if path not in known:
        os.environ[IMPORT_PATH_VAR] = os.pathsep.join([*filter(None, known), path])


def made_importable() -> list[str]:
    """The directories made importable in this process and handed to the ones it starts (``IMPORT_PATH_VAR``)."""
    return [d for d in os.environ.get(IMPORT_PATH_VAR, "").split(os.pathsep) if d]


def searched() -> str:
    """Where a module was looked for, and how to add a directory: for an import error's message."""
    dirs = made_importable()
    where = f", and {', '.join(dirs)}" if dirs else ""
    if "" not in sys.path and os.getcwd() not in sys.path:
        where += ", not the current directory"
    return (
        f"looked in installed packages, PYTHONPATH{where}; put the module's directory on the path: "
        "PYTHONPATH=DIR zddrl ..."
    )


RECORD = "# zddrl imported this run's code from: "
"""How RUN_DIR/config.toml starts (``record``): the directories its run made importable, a JSON list. A command
that reads a checkpoint of the run looks there too (``recorded``): `zddrl export` need not be told where the
network's module was."""


def record() -> str:
    """The line RUN_DIR/config.toml starts with: the directories made importable for this run, or "" if none."""
    dirs = made_importable()
    return f"{RECORD}{json.dumps(dirs)}\n" if dirs else ""


def recorded(config_text: str) -> list[str]:
    """The directories a run directory's config.toml says its code came from (``record``); [] if it says none."""
    first = config_text.split("\n", 1)[0]
    if not first.startswith(RECORD):
        return []
    try:
        dirs = json.loads(first[len(RECORD) :])
    except ValueError:
        return []
    return [d for d in dirs if isinstance(d, str)] if isinstance(dirs, list) else []


def import_recorded(config_text: str) -> None:
    """Make importable the directories a run directory's config.toml records (``record``) that still exist."""
    for directory in recorded(config_text):
        if Path(directory).is_dir():
            importable(directory)


def importable_from_environment() -> None:
    """The directories a parent process made importable (``IMPORT_PATH_VAR``), made importable here too."""
    for directory in filter(None, os.environ.get(IMPORT_PATH_VAR, "").split(os.pathsep)):
        if directory not in sys.path:
            sys.path.append(directory)
