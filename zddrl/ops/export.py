"""`zddrl export`: a checkpoint's acting policy as one file that runs without zddrl (TorchScript or ONNX).

Why: a trained policy is served where zddrl is not (a robot, a game server, another team's stack). There it should
need torch alone (TorchScript, ``torch.jit.load``) or only an ONNX runtime: no config, no env, no zddrl code.

The file is a module ``obs -> (action, dist_params)`` on a batch ``[B, *obs_shape]`` (float32, or uint8 for pixel
envs, scaled inside as in training), with the deterministic action:

* actor-critic (PPO, IMPALA; MLP, CNN or a ``model.kind`` of the user's own), Discrete: the argmax of the logits;
  ``dist_params`` the logits ``[B, n]``. Box: the Gaussian's mean clipped to the action bounds; ``dist_params``
  ``concat(mean, log_std)`` ``[B, 2 * A]``.
* Ape-X (``DuelingQ``): the argmax of Q; ``dist_params`` the Q values ``[B, n]``.
* SAC (``SquashedGaussian``): ``tanh(mean)`` scaled to the bounds, as its actors act greedily; ``dist_params``
  ``concat(mean, log_std)`` ``[B, 2 * A]``.

A run with ``algo.normalize_obs`` feeds its network normalised observations: the checkpoint's statistics become
buffers of the module, applied as the actors apply them (float32, clipped to ``OBS_CLIP``), so the file alone is the
policy. Before the file is put in place it is loaded back (``torch.jit.load``, onnxruntime) and run on random
observations next to the checkpoint's network: a file that would act otherwise is never left behind. It carries a
JSON description (spaces, outputs, env id, policy version): ``zddrl.json`` among TorchScript's extra files, the
``zddrl`` entry of the ONNX model's ``metadata_props``.

Both writers are the TorchScript-based ones that torch >= 2.9 deprecates (``torch.jit.trace``,
``torch.onnx.export(dynamo=False)``): they still write a file that torch alone loads, and the ONNX one needs the
``onnx`` package but not ``onnxscript``. Their deprecation warnings are silenced here: a user can do nothing about them.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from loguru import logger
from torch import nn

from zddrl import __version__
from zddrl.algos.core import acting_model
from zddrl.algos.exported import ExportedPolicy
from zddrl.algos.spec import algorithm_of
from zddrl.config import Config
from zddrl.envs import EnvSpec, probe_spec
from zddrl.ops.api import read_state

FORMATS = ("torchscript", "onnx")
ONNX_HINT = 'pip install -c constraints.txt -e ".[onnx]"'
META_NAME = "zddrl.json"
"""TorchScript extra file (and, without the suffix, ONNX metadata key) holding the JSON description."""
ONNX_OPSET = 17
"""Run by every onnxruntime since 1.11 (2022)."""
INPUT_NAME, OUTPUT_NAMES = "obs", ("action", "dist_params")
TRACE_BATCH, CHECK_BATCH = 2, 7
"""The batch traced and the one the written file is checked on: two sizes, so that a file with the traced batch size
baked into it fails the check (not 1, whose dimension broadcasts: a trace could take it for a constant)."""
TOLERANCE = 1e-4
"""Largest difference of the file's outputs to the checkpoint's network, relative to the largest output (at least 1):
a runtime sums in its own order, and an output near 0 that is a sum of large terms carries their rounding errors, so
an elementwise relative bound would fail good files of deep networks. Any real defect (a statistic, a scale, a clip
lost) is off by far more."""


class ExportError(ValueError):
    """A checkpoint that cannot be exported, a missing package, or a file that does not compute the policy."""


def export_policy(
    checkpoint: str | Path, fmt: str, output: Path, allowed: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Write ``checkpoint``'s acting policy to ``output`` in ``fmt`` (one of ``FORMATS``), checked against the
    checkpoint's own network; returns the file's description with ``file``, ``format`` and ``max_error``.
    ``checkpoint`` may be a run directory (its final, else newest, checkpoint). ``allowed``: the code
    (``module:attr``) the run's config may name (``checkpoints.read_checkpoint``)."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt == "onnx":
        require_onnx()
    state, config = read_state(checkpoint, allowed)
    spec, net = policy_network(state, config)
    policy = exportable(config, net, spec, state.get("obs_rms"))
    meta = describe(config, spec, policy, int(state.get("policy_version", -1)))
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")  # the file appears only once it is known to be right
    try:
        WRITERS[fmt](policy, sample_obs(spec, TRACE_BATCH, seed=0), partial, meta)
        error = check_file(fmt, partial, policy, sample_obs(spec, CHECK_BATCH, seed=1))
        os.replace(partial, output)
    finally:
        partial.unlink(missing_ok=True)
    logger.info(f"exported {checkpoint} to {output} ({fmt}, {output.stat().st_size:,} bytes, max error {error:.2g})")
    return {**meta, "file": str(output), "format": fmt, "max_error": error}


def require_onnx() -> None:
    """ExportError with the install hint unless both ``onnx`` (the writer) and ``onnxruntime`` (the check) import."""
    for name in ("onnx", "onnxruntime"):
        try:
            importlib.import_module(name)
        except ImportError:
            raise ExportError(f"--format onnx needs the {name} package: {ONNX_HINT}") from None


def policy_network(state: dict[str, Any], config: Config) -> tuple[EnvSpec, nn.Module]:
    """The checkpoint's acting network with its weights, rebuilt as `zddrl eval` does: the spec of one env of the
    run, ``acting_model``. The one place this module builds a network."""
    spec = probe_spec(config.env)
    net = acting_model(config, spec)
    net.load_state_dict(state["model"])
    return spec, net.eval()


def policy_module(state: dict[str, Any], config: Config) -> ExportedPolicy:
    """The module an exported file holds, of a checkpoint's ``state`` (its ``model`` and ``obs_rms``): what
    ``zddrl.load_policy(...).dist_params`` runs."""
    spec, net = policy_network(state, config)
    return exportable(config, net, spec, state.get("obs_rms"))


def exportable(config: Config, net: nn.Module, spec: EnvSpec, obs_rms: dict[str, Any] | None) -> ExportedPolicy:
    """``net`` wrapped as the module the run's algorithm exports (its spec's ``export``)."""
    wrapped = algorithm_of(config).export(net, spec, obs_rms)
    if not isinstance(wrapped, ExportedPolicy):
        raise ExportError(
            f"algo.name {config.algo.name!r}: its spec's export gave a {type(wrapped).__name__}, "
            "not a zddrl.algos.exported.ExportedPolicy"
        )
    return wrapped.eval().requires_grad_(False)


def describe(config: Config, spec: EnvSpec, policy: ExportedPolicy, policy_version: int) -> dict[str, Any]:
    """The file's JSON description: enough to feed it and read its outputs without the run's config."""
    if spec.discrete:
        action: dict[str, Any] = {"kind": "discrete", "n": spec.action_dim}
    else:
        action = {
            "kind": "box",
            "shape": [spec.action_dim],
            "low": list(spec.action_low),
            "high": list(spec.action_high),
        }
    return {
        "zddrl_version": __version__,
        "env_id": config.env.id,
        "algorithm": config.algo.name,
        "network": type(policy.net).__name__,
        "obs_shape": list(spec.obs_shape),
        "obs_dtype": spec.obs_dtype,
        "obs_normalized": policy.normalized,
        "action_space": action,
        "inputs": {INPUT_NAME: f"{spec.obs_dtype} [B, {', '.join(map(str, spec.obs_shape))}]"},
        "outputs": policy.outputs(),
        "policy_version": policy_version,
    }


def sample_obs(spec: EnvSpec, batch: int, seed: int) -> torch.Tensor:
    """Random observations of the env's shape and dtype (any pixel value; normal floats)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, *spec.obs_shape)
    if spec.obs_dtype == "uint8":
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return torch.randn(shape, generator=gen)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without the deprecation warnings of torch's TorchScript-based tools (the module docstring says why)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def write_torchscript(policy: ExportedPolicy, example: torch.Tensor, path: Path, meta: dict[str, Any]) -> None:
    with _quiet(), torch.no_grad():
        traced = torch.jit.trace(policy, example)
        torch.jit.save(traced, str(path), _extra_files={META_NAME: json.dumps(meta)})


def write_onnx(policy: ExportedPolicy, example: torch.Tensor, path: Path, meta: dict[str, Any]) -> None:
    import onnx

    batch = {0: "batch"}
    with _quiet(), torch.no_grad():
        torch.onnx.export(
            policy,
            (example,),
            str(path),
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=list(OUTPUT_NAMES),
            dynamic_axes={name: batch for name in (INPUT_NAME, *OUTPUT_NAMES)},
            opset_version=ONNX_OPSET,
        )
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    entry = model.metadata_props.add()
    entry.key, entry.value = Path(META_NAME).stem, json.dumps(meta)
    onnx.save(model, str(path))


WRITERS: dict[str, Callable[[ExportedPolicy, torch.Tensor, Path, dict[str, Any]], None]] = {
    "torchscript": write_torchscript,
    "onnx": write_onnx,
}


def run_file(fmt: str, path: Path, obs: torch.Tensor) -> list[np.ndarray]:
    """``[action, dist_params]`` of the written file on ``obs``, run as its users will: torch alone, onnxruntime."""
    if fmt == "torchscript":
        with _quiet():
            loaded = torch.jit.load(str(path))
        with torch.no_grad():
            return [t.numpy() for t in loaded(obs)]
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return list(session.run(list(OUTPUT_NAMES), {INPUT_NAME: obs.numpy()}))


def check_file(fmt: str, path: Path, policy: ExportedPolicy, obs: torch.Tensor) -> float:
    """The largest difference of the file's outputs to ``policy``'s on ``obs``; ExportError beyond ``TOLERANCE``.
    A discrete action may differ only where the network's top two values tie within it."""
    with torch.no_grad():
        want = [t.numpy() for t in policy(obs)]
    got = run_file(fmt, path, obs)
    for name, g, w in zip(OUTPUT_NAMES, got, want):
        if g.shape != w.shape or g.dtype != w.dtype:
            raise ExportError(f"the {fmt} file's {name} is {g.dtype} {g.shape}, the network's {w.dtype} {w.shape}")
    errors = [float(np.max(np.abs(g.astype(np.float64) - w), initial=0.0)) for g, w in zip(got, want)]
    bound = TOLERANCE * max(1.0, float(np.max(np.abs(want[1]), initial=0.0)))
    if policy.discrete:  # the file's choice must be as good as the network's, by the network's own values
        rows = np.arange(len(obs))
        errors[0] = float(np.max(want[1][rows, want[0]] - want[1][rows, got[0]], initial=0.0))
    if max(errors) > bound:
        raise ExportError(f"the {fmt} file does not compute the checkpoint's policy (difference {max(errors):g})")
    return max(errors)
