"""`zddrl bench actor`: what a CNN costs an actor host, next to today's numpy-MLP actor.

* **inference**: one ``act`` on a batch of ``--envs`` Atari observations (``[4, 84, 84]`` uint8): the Nature CNN
  in numpy (im2col by ``sliding_window_view`` and one ``tensordot`` per layer, the best numpy offers) against
  torch on one thread (``actor.torch_policy.TorchPolicy``, what actors use), and the IMPALA CNN in torch; the
  CartPole MLP in numpy for scale. Medians of ``--repeats`` calls, measured alternately.
* **start-up and memory**: a fresh process that does what an actor does before its first rollout (import the
  actor host, build its envs, build the policy from a parameter buffer, act once): seconds to that first
  action, and the process's RSS then. For CartPole with the numpy MLP and for Breakout with each CNN.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from zddrl.bench.common import timed_json_run
from zddrl.config import Config, EnvConfig, ModelConfig
from zddrl.envs import EnvSpec

FRAMES = (4, 84, 84)
ATARI = EnvConfig(id="ALE/Breakout-v5", atari=True, num_envs=8)
KINDS = {"mlp": ModelConfig(), "nature_cnn": ModelConfig(kind="nature_cnn", hidden=(512,))}
KINDS["impala_cnn"] = ModelConfig(kind="impala_cnn", hidden=(256,))


def _conv(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int) -> np.ndarray:
    """``[N, C, H, W] -> [N, O, H', W']``, valid padding: im2col as a strided view, then one matmul."""
    k = w.shape[2]
    windows = sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]  # [N, C, H', W', k, k]
    out = np.tensordot(windows, w, axes=([1, 4, 5], [1, 2, 3]))  # [N, H', W', O]
    return np.maximum(out.transpose(0, 3, 1, 2) + b[None, :, None, None], 0.0)


def numpy_nature_cnn(weights: dict[str, np.ndarray], obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Nature CNN actor-critic of zddrl.algos.cnn in numpy: ``(logits [N, A], values [N])``."""
    x = obs.astype(np.float32) * np.float32(1.0 / 255.0)
    for i, stride in ((0, 4), (2, 2), (4, 1)):
        x = _conv(x, weights[f"torso.conv.{i}.weight"], weights[f"torso.conv.{i}.bias"], stride)
    h = np.maximum(x.reshape(len(x), -1) @ weights["torso.fc.weight"].T + weights["torso.fc.bias"], 0.0)
    logits = h @ weights["pi.0.weight"].T + weights["pi.0.bias"]
    return logits, (h @ weights["v.0.weight"].T + weights["v.0.bias"])[:, 0]


def _timed(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def inference(envs: int, repeats: int) -> dict[str, float]:
    """Milliseconds per ``act`` on ``envs`` observations, each way (see the module docstring)."""
    import torch

    from zddrl.algos.actor_critic import actor_critic_network
    from zddrl.algos.flat import unflatten
    from zddrl.algos.model import ActorCritic, flatten_params
    from zddrl.algos.policy import NumpyPolicy
    from zddrl.algos.torch_policy import TorchPolicy

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (envs, *FRAMES), np.uint8)
    spec = EnvSpec(FRAMES, True, 4, obs_dtype="uint8")
    policies, weights = {}, {}
    for kind in ("nature_cnn", "impala_cnn"):
        flat, layout = flatten_params(ActorCritic(spec, KINDS[kind]))
        policies[kind] = TorchPolicy(actor_critic_network(spec, KINDS[kind]), flat, layout, spec)
        weights[kind] = unflatten(flat, layout)
    mlp_spec = EnvSpec((4,), True, 2)
    mlp = NumpyPolicy(*flatten_params(ActorCritic(mlp_spec, KINDS["mlp"])), "tanh", True)
    vectors = rng.standard_normal((envs, 4)).astype(np.float32)
    logits, _ = numpy_nature_cnn(weights["nature_cnn"], pixels)  # the numpy forward is the same network
    reference = policies["nature_cnn"].net(torch.from_numpy(pixels))[0].detach().numpy()
    np.testing.assert_allclose(logits, reference, rtol=1e-3, atol=1e-4)
    calls = {
        "numpy_nature_cnn_ms": lambda: numpy_nature_cnn(weights["nature_cnn"], pixels),
        "torch_nature_cnn_ms": lambda: policies["nature_cnn"].act(pixels, rng),
        "torch_impala_cnn_ms": lambda: policies["impala_cnn"].act(pixels, rng),
        "numpy_mlp_cartpole_ms": lambda: mlp.act(vectors, rng),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(3):  # alternate, so that machine noise hits every way alike
        for name, call in calls.items():
            times[name].append(1000 * _timed(call, max(1, repeats // 3)))
    return {name: round(statistics.median(t), 3) for name, t in times.items()}


_STARTUP = """
import json, sys, time
t0 = time.monotonic()
import numpy as np
from zddrl.actor.host import action_rng, env_seeds
from zddrl.algos.actor_critic import actor_critic_policy
from zddrl.config import Config
from zddrl.envs import actor_envs
from zddrl.proc import rss_mb
config = Config.from_dict(json.loads(sys.argv[1]))
vec = actor_envs(config.env, env_seeds(1, 0, config.env.num_envs))
saved = np.load(sys.argv[2], allow_pickle=False)
policy = actor_critic_policy(saved["flat"], json.loads(sys.argv[3]), config.model, vec.spec)
policy.act(vec.obs, action_rng(1, 0))
print(json.dumps({"startup_s": time.monotonic() - t0, "rss_mb": rss_mb(), "torch": "torch" in sys.modules}))
"""


def startup(config: Config) -> dict[str, Any]:
    """A fresh actor-like process (see the module docstring): seconds to its first action, its RSS then."""
    from zddrl.algos.model import ActorCritic, flatten_params
    from zddrl.envs import probe_spec

    flat, layout = flatten_params(ActorCritic(probe_spec(config.env), config.model))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "flat.npz"
        np.savez(path, flat=flat)
        cmd = [sys.executable, "-c", _STARTUP, json.dumps(config.to_dict()), str(path), json.dumps(layout)]
        wall, result = timed_json_run(cmd, "the start-up probe", timeout=300)
    return {**result, "process_s": round(wall, 3), "startup_s": round(result["startup_s"], 3)}


def run_actor_bench(envs: int, repeats: int) -> dict[str, Any]:
    cartpole = Config(name="bench-actor").replace({"env.num_envs": envs})
    runs = {"mlp/CartPole-v1": cartpole}
    for kind in ("nature_cnn", "impala_cnn"):
        atari = {f"env.{k}": v for k, v in ATARI.__dict__.items() if k != "num_envs"}
        model = {f"model.{k}": list(v) if isinstance(v, tuple) else v for k, v in KINDS[kind].__dict__.items()}
        runs[f"{kind}/{ATARI.id}"] = Config(name="bench-actor").replace({**atari, **model, "env.num_envs": envs})
    return {
        "envs": envs,
        "inference": inference(envs, repeats),
        "startup": {name: startup(config) for name, config in runs.items()},
    }


@click.command("actor")
@click.option("--envs", type=click.IntRange(1, 256), default=8, show_default=True, help="Envs per actor (batch).")
@click.option("--repeats", type=click.IntRange(3, 10_000), default=30, show_default=True, help="Calls per way.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def actor(envs: int, repeats: int, as_json: bool) -> None:
    """Actor inference (numpy vs torch for the CNNs), start-up time and RSS next to the numpy-MLP actor."""
    result = run_actor_bench(envs, repeats)
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"one act() on {envs} observations, one thread (medians of {repeats}):")
    for name, ms in result["inference"].items():
        click.echo(f"  {name.removesuffix('_ms'):<22} {ms:>9.2f} ms")
    click.echo("actor start-up (import, envs, policy, first action) and RSS:")
    for name, row in result["startup"].items():
        click.echo(
            f"  {name:<28} {row['startup_s']:>6.2f} s in-process, {row['process_s']:>6.2f} s with the interpreter,"
            f" {row['rss_mb']:>6.0f} MB, torch {'yes' if row['torch'] else 'no'}"
        )
