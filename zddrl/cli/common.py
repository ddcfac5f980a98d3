"""What the commands share: the common options, loading a config as a usage error, credentials from --keys,
and the stop event set by SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import click
from loguru import logger

from zddrl.config import ConfigError, load_config, parse_override, split_endpoints
from zddrl.plugin import PICKLED

CONNECT_HELP = (
    "Broker control endpoint, the only address a client needs; or a fallback list tcp://A:5555,tcp://B:5555, "
    "tried in turn (the next one when the current broker falls silent)."
)


def connect_list(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """--connect checked where it is given (config.split_endpoints): a bad entry is a one-line usage error."""
    try:
        return ",".join(split_endpoints(value))
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None


def stop_on_signals() -> threading.Event:
    """SIGINT/SIGTERM only set the returned event; loops check it and shut down cleanly."""
    stop = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        logger.info(f"{signal.Signals(signum).name} received: stopping")
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def overrides_of(sets: tuple[str, ...], **named: Any) -> dict[str, Any]:
    out = dict(parse_override(s) for s in sets)
    out.update({k: v for k, v in named.items() if v is not None})
    return out


def config_of(config_path: str | None, overrides: dict[str, Any], check_env: bool = True):
    """Config from file + overrides; a bad value or an env that cannot be built is a usage error."""
    from zddrl.algos.checks import replay_refusal, spec_refusal
    from zddrl.envs import EnvError, probe_spec

    try:
        config = load_config(config_path, overrides)
        if check_env:
            spec = probe_spec(config.env)
            why = spec_refusal(config, spec)
            if why:
                raise ConfigError(f"{config.env.id}: {why}")
            why = replay_refusal(config, spec)
            if why:
                raise ConfigError(why)
        return config
    except (ConfigError, EnvError) as exc:
        raise click.UsageError(str(exc)) from None


def checked_run_dir(config, run_dir: Path | None, resume: bool) -> None:
    """``learner.checkpoints.check_run_dir`` as a usage error."""
    from zddrl.learner.checkpoints import check_run_dir

    try:
        check_run_dir(config, run_dir, resume)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


keys_option = click.option(
    "--keys",
    "keys_dir",
    type=click.Path(file_okay=False),
    default=None,
    envvar="ZDDRL_KEYS",
    help="Key directory of a closed bus (zddrl keys; docs/security.md). Without it the bus is open, which the "
    "broker allows on loopback only.",
)


def allow_code_option(where: str):
    """``--allow-code``, read with ``allowed_code``: the ``module:attr`` references (an env id, ``algo.name``,
    ``model.kind``) whose code runs may have this host import (``zddrl.plugin``)."""
    return click.option(
        "--allow-code",
        "allow_code",
        multiple=True,
        envvar="ZDDRL_ALLOW_CODE",
        metavar="MODULE:ATTR",
        help=f"Code a run may have imported {where}: an env id, algo.name or model.kind naming a module "
        "(module:attr, or gymnasium's module:Env-v0), exactly as the run spec says it; repeatable, or space/comma "
        "separated. Runs naming any other code are refused; registered gymnasium ids and zddrl's own algorithms and "
        "models need no allowing.",
    )


def allowed_code(values: tuple[str, ...]) -> frozenset[str]:
    """The references of ``--allow-code`` values; a ``cloudpickle:PATH`` one is a path, taken whole (it may hold
    spaces or commas)."""
    return frozenset(
        ref for value in values for ref in ([value] if value.startswith(PICKLED) else value.replace(",", " ").split())
    )


key_option = click.option(
    "--key",
    "key_name",
    default=None,
    envvar="ZDDRL_KEY",
    help="Which of this role's keys in --keys to use (needed when it holds the secrets of several).",
)


def credentials_of(keys_dir: str | None, role: str, key_name: str | None):
    """This client's ``keys.Credentials`` from --keys (None without it); a bad key directory is a usage error."""
    from zddrl.keys import KeysError, credentials

    if keys_dir is None:
        if key_name is not None:
            raise click.UsageError("--key names a key in --keys: give --keys DIR too")
        return None
    try:
        return credentials(keys_dir, role, key_name)
    except KeysError as exc:
        raise click.UsageError(f"--keys: {exc}") from None


set_option = click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override a config value, e.g. --set algo.lr=1e-3 (repeatable).",
)
