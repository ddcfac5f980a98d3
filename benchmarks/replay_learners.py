"""Gradient steps per second of the replay modes' learner cores: what bounds a replay run's speed.

A replay run takes ``replay.replay_ratio`` gradient steps per env step, so its env steps/s cannot exceed the
core's gradient steps/s over the ratio. Each bundled example's core (`examples/cartpole_apex.toml`,
`examples/pendulum_sac.toml`: networks, batch, priorities as configured) is filled with synthetic rollouts of the
env's shapes past ``learning_starts`` and timed over its own ``update`` calls (sampling, the step, the priority
update, target refreshes), with 1 and 2 torch threads, in this process.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from zddrl.algos.apex.learner import ApexLearner
from zddrl.algos.sac.learner import SACLearner
from zddrl.config import load_config
from zddrl.envs import EnvSpec, probe_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LEARNER_EXAMPLES = {"apex": EXAMPLES / "cartpole_apex.toml", "sac": EXAMPLES / "pendulum_sac.toml"}


def _rollout(spec: EnvSpec, T: int, N: int, version: int, rng: np.random.Generator) -> SimpleNamespace:
    f32 = np.float32
    if spec.discrete:
        actions: np.ndarray = rng.integers(spec.action_dim, size=(T, N))
    else:
        low, high = np.asarray(spec.action_low, f32), np.asarray(spec.action_high, f32)
        actions = rng.uniform(low, high, (T, N, spec.action_dim)).astype(f32)
    arrays = {
        "obs": rng.standard_normal((T, N, *spec.obs_shape)).astype(f32),
        "actions": actions,
        "logp": np.zeros((T, N), f32),
        "values": np.zeros((T, N), f32),
        "rewards": rng.standard_normal((T, N)).astype(f32),
        "terminated": rng.random((T, N)) < 0.01,
        "truncated": np.zeros((T, N), bool),
        "next_obs": rng.standard_normal((N, *spec.obs_shape)).astype(f32),
        "next_value": np.zeros(N, f32),
    }
    return SimpleNamespace(arrays=arrays, policy_version=version, peer_id="bench", seq=version)


def bench_learner(mode: str, threads: int, seconds: float) -> dict[str, Any]:
    config = load_config(LEARNER_EXAMPLES[mode], {"learner.torch_threads": threads})
    spec = probe_spec(config.env)
    core = (ApexLearner if mode == "apex" else SACLearner)(config, spec)
    T, N = config.env.rollout_len, config.env.num_envs
    rng = np.random.default_rng(0)
    version = 0
    while len(core.source) < config.replay.learning_starts:
        core.update([_rollout(spec, T, N, version, rng)])
        version += 1
    t0, steps0 = time.perf_counter(), core.grad_steps
    while time.perf_counter() - t0 < seconds or core.grad_steps - steps0 < 20:
        core.update([_rollout(spec, T, N, version, rng)])
        version += 1
    elapsed = time.perf_counter() - t0
    steps = core.grad_steps - steps0
    return {
        "mode": mode,
        "config": str(LEARNER_EXAMPLES[mode].relative_to(EXAMPLES.parent)),
        "threads": threads,
        "grad_steps_per_s": round(steps / elapsed, 1),
        "ms_per_grad_step": round(1000 * elapsed / steps, 3),
        "batch": config.replay.batch_size,
        "hidden": list(config.model.hidden),
        "env_steps_per_s_bound": round(steps / elapsed / config.replay.replay_ratio, 1),
    }


def bench_learners(threads: list[int], seconds: float) -> list[dict[str, Any]]:
    """Each example's core with 1..n threads, in this process set up as a learner process is (subnormals flushed)."""
    before = torch.get_num_threads()
    torch.set_flush_denormal(True)
    try:
        return [bench_learner(mode, n, seconds) for mode in LEARNER_EXAMPLES for n in threads]
    finally:
        torch.set_num_threads(before)


def format_learner_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'mode':5} {'threads':>7} {'grad steps/s':>12} {'ms/step':>8} {'env steps/s bound':>17}  config"]
    for r in rows:
        lines.append(
            f"{r['mode']:5} {r['threads']:>7} {r['grad_steps_per_s']:>12,.1f} {r['ms_per_grad_step']:>8.2f} "
            f"{r['env_steps_per_s_bound']:>17,.1f}  {r['config']}"
        )
    return "\n".join(lines)
