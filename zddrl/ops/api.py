"""zddrl's Python API: ``zddrl.train`` runs a whole local run as `zddrl train` does, ``zddrl.load_policy`` gives a
checkpoint's policy to act with. Both are re-exported by the package (``import zddrl``)::

    import zddrl
    result = zddrl.train("examples/cartpole_ppo.toml", algo={"lr": 1e-3}, train={"max_seconds": 60})
    result.summary["reached"], result.run_dir
    action = result.policy.act(obs)                       # deterministic by default
    policy = zddrl.load_policy("runs/cartpole_ppo-.../checkpoints/final.pt")

An env given as a Python callable or class (defined in the calling script or notebook) is pickled by value into the
run directory and reaches the learner and the actors that ``train`` starts on this machine (``envs.PICKLED``); a
multi-host run names its env by id, as each host must allow the code it runs.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from zddrl.algos.model import flatten_params
from zddrl.algos.policy import Policy
from zddrl.algos.spec import ActingVersion, algorithm_of
from zddrl.config import Config, ConfigError, load_config
from zddrl.envs import EnvSpec, pickled_env, probe_spec
from zddrl.learner.checkpoints import read_checkpoint
from zddrl.learner.runlog import CheckpointError, latest_checkpoint
from zddrl.ops.train import default_run_dir, run_training

ENV_FILE = "env.cloudpickle"
"""Where ``train`` pickles an env given as a Python object, in the run directory."""


def checkpoint_policy(state: Mapping[str, Any], config: Config, spec: EnvSpec) -> Policy:
    """The acting policy of a checkpoint's state (its ``model`` and observation statistics), as actors build it."""
    from zddrl.algos.core import acting_model

    model = acting_model(config, spec)
    model.load_state_dict(state["model"])
    flat, layout = flatten_params(model)
    rms = state.get("obs_rms")
    extras = {} if rms is None else {"obs_mean": rms["mean"].numpy(), "obs_var": rms["var"].numpy()}
    return algorithm_of(config).acting_policy(ActingVersion(flat, layout, extras, config, spec, 0, 1))


class LoadedPolicy:
    """A trained policy: ``act(obs)`` -> actions and ``dist_params(obs)`` -> its distribution's parameters, for one
    observation or a batch of them: the two outputs of the file `zddrl export` writes of the same checkpoint."""

    def __init__(
        self,
        policy: Policy,
        config: Config,
        spec: EnvSpec,
        policy_version: int,
        seed: int = 0,
        weights: Mapping[str, Any] | None = None,
    ) -> None:
        self.policy, self.config, self.spec, self.policy_version = policy, config, spec, policy_version
        self.rng = np.random.default_rng(seed)
        self.weights = weights
        """The checkpoint's ``model`` and ``obs_rms``, what ``dist_params`` builds the network from (None: none)."""
        self._exported: Any = None
        if not spec.discrete:
            self.low = np.asarray(spec.action_low, np.float32)
            self.high = np.asarray(spec.action_high, np.float32)

    def act(self, obs: Any, deterministic: bool = True) -> np.ndarray:
        """The actions for ``obs`` (shape ``obs_shape``, or ``[B, *obs_shape]``): the mode of the policy's
        distribution (greedy for Q-learning), or a sample of it with ``deterministic=False``. Box actions are
        clipped to the env's bounds: what the env executes, and what an exported file's ``action`` gives (the
        unclipped mean is in ``dist_params``)."""
        batch, single = self._batch(obs)
        actions = self.policy.act(batch, self.rng, deterministic=deterministic).actions
        if not self.spec.discrete:
            actions = np.clip(actions, self.low, self.high)
        return actions[0] if single else actions

    __call__ = act

    def dist_params(self, obs: Any) -> np.ndarray:
        """The parameters of the policy's distribution for ``obs``, as an exported file's ``dist_params`` output
        (docs/export.md): logits ``[B, n]`` (actor-critic, Discrete), Q values ``[B, n]`` (apex), or the mean and
        log-std side by side ``[B, 2A]`` (actor-critic on a Box: the mean before clipping; sac: before the tanh).
        One observation gives one row."""
        import torch

        from zddrl.ops.export import policy_module  # export reads checkpoints through this module

        if self.weights is None:
            raise ValueError("this policy was built without its checkpoint's weights: load it with zddrl.load_policy")
        if self._exported is None:
            self._exported = policy_module(dict(self.weights), self.config)
        batch, single = self._batch(obs)
        with torch.no_grad():
            _, params = self._exported(torch.as_tensor(batch))
        out = params.numpy()
        return out[0] if single else out

    def _batch(self, obs: Any) -> tuple[np.ndarray, bool]:
        """``obs`` as a batch of the env's observation dtype, and whether it was one observation."""
        x = np.asarray(obs, dtype=np.dtype(self.spec.obs_dtype))
        single = x.shape == tuple(self.spec.obs_shape)
        batch = x[None] if single else x
        if batch.shape[1:] != tuple(self.spec.obs_shape):
            raise ValueError(f"observations of shape {list(x.shape)}, the policy takes {list(self.spec.obs_shape)}")
        return batch, single


def load_policy(path: str | Path, seed: int = 0, allow_code: Iterable[str] = ()) -> LoadedPolicy:
    """The policy of a checkpoint file, or of a run directory's final (else newest) checkpoint; CheckpointError if
    there is none. ``seed``: of the generator ``act(..., deterministic=False)`` samples with. ``allow_code``: the
    code its run names (``module:attr`` env, algorithm or network, as its config.toml says them) that may be
    imported: a checkpoint may come from anywhere (``checkpoints.read_checkpoint``)."""
    state, config = read_state(path, frozenset(allow_code))
    spec = probe_spec(config.env)
    version = int(state.get("policy_version", 0))
    weights = {"model": state["model"], "obs_rms": state.get("obs_rms")}
    return LoadedPolicy(checkpoint_policy(state, config, spec), config, spec, version, seed, weights)


def read_state(path: str | Path, allowed: frozenset[str] = frozenset()) -> tuple[dict[str, Any], Config]:
    """``read_checkpoint`` of a checkpoint file, or of a run directory's final (else newest) checkpoint. torch's
    warnings while probing the file (a TorchScript export, say) are kept off the console: the CheckpointError says
    in one line what the file is not."""
    file = Path(path)
    if file.is_dir():
        found = newest_state(file)
        if found is None:
            raise CheckpointError(f"{file} holds no checkpoint (RUN_DIR/checkpoints/*.pt)")
        file = found
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return read_checkpoint(file, allowed)


def newest_state(run_dir: Path) -> Path | None:
    """The run's final checkpoint (written when the learner stops), else its newest periodic one."""
    final = run_dir / "checkpoints" / "final.pt"
    return final if final.is_file() else latest_checkpoint(run_dir)


@dataclass(frozen=True)
class TrainResult:
    """What ``zddrl.train`` returns."""

    summary: dict[str, Any]
    """The run's summary.json (docs/run-directory.md)."""
    run_dir: Path
    policy: LoadedPolicy | None
    """The final checkpoint's policy (None if the run ended before its first update)."""


def train(
    config: str | Path | Config | Mapping[str, Any] | None = None,
    *,
    env: str | Callable[..., Any] | Mapping[str, Any] | None = None,
    run_dir: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    secure: bool = False,
    open_tcp: bool = False,
    progress: bool = True,
    **sections: Any,
) -> TrainResult:
    """Run broker, actors and learner on this machine, as `zddrl train CONFIG` does, until the first limit.

    ``config``: a TOML file, a ``Config``, a dict of sections, or None (the defaults). ``sections``: overrides by
    section, ``algo={"lr": 1e-3}``, and ``name="..."``; ``overrides``: dotted keys, ``{"algo.lr": 1e-3}``.
    ``env``: an env id, a dict of ``[env]`` keys, or a callable or class returning a gymnasium.Env (a script's or a
    notebook's own; ``env={"kwargs": ...}`` cannot then be given, pass ``overrides={"env.kwargs": ...}``).
    ``progress``: progress lines on a terminal. The processes meet on the local bus (ipc, owner-only directory) unless
    ``open_tcp`` (loopback ports any local user can reach); ``secure``: throwaway keys too.
    Raises ConfigError for a config or env that cannot run."""
    dotted = _dotted(env, overrides, sections)
    cfg = _config(config, dotted)
    run_path = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    made = not run_path.exists()
    if callable(env):
        cfg = cfg.replace({"env.id": pickled_env(env, run_path / ENV_FILE)})
    try:
        summary = run_training(cfg, run_path, show_progress=progress, secure=secure, open_tcp=open_tcp)
    except click.UsageError as exc:
        if made:  # refused before anything ran: what this call made goes again, as `zddrl train` does
            shutil.rmtree(run_path, ignore_errors=True)
        raise ConfigError(exc.format_message()) from None
    except click.exceptions.Exit as exc:
        if exc.exit_code == 130:
            raise KeyboardInterrupt from None
        raise RuntimeError(f"zddrl train ended with exit code {exc.exit_code}") from None
    except click.ClickException as exc:
        raise RuntimeError(exc.format_message()) from None
    final = newest_state(run_path)
    policy = load_policy(final, allow_code=cfg.references()) if final is not None else None  # the caller's own code
    return TrainResult(summary, run_path, policy)


def _dotted(
    env: str | Callable[..., Any] | Mapping[str, Any] | None, overrides: Mapping[str, Any] | None, sections: dict
) -> dict[str, Any]:
    """Every override as a dotted key (``section.key``)."""
    dotted = dict(overrides or {})
    for section, value in sections.items():
        if isinstance(value, Mapping):
            dotted.update({f"{section}.{k}": v for k, v in value.items()})
        elif section == "name":
            dotted["name"] = value
        else:
            raise TypeError(f"zddrl.train({section}=...) takes a dict of [{section}] keys, got {type(value).__name__}")
    if isinstance(env, str):
        dotted["env.id"] = env
    elif isinstance(env, Mapping):
        dotted.update({f"env.{k}": v for k, v in env.items()})
    return dotted


def _config(config: str | Path | Config | Mapping[str, Any] | None, dotted: dict[str, Any]) -> Config:
    if isinstance(config, Config):
        return config.replace(dotted) if dotted else config
    if isinstance(config, Mapping):
        built = Config.from_dict(dict(config))
        return built.replace(dotted) if dotted else built
    return load_config(config, dotted)
