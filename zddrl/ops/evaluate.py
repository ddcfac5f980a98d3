"""`zddrl eval`: deterministic evaluation of a checkpoint on fresh envs."""

from __future__ import annotations

from typing import Any

import numpy as np

from zddrl.actor.host import build_policy
from zddrl.algos.core import acting_model
from zddrl.algos.model import flatten_params
from zddrl.config import Config
from zddrl.envs import VecEnv, evaluation_factory
from zddrl.learner.runlog import load_checkpoint


def evaluate(checkpoint: str, episodes: int, seed: int) -> dict[str, Any]:
    """Mean and std of the return of ``episodes`` deterministic episodes on one env (its first reset is
    seeded with ``seed``; later resets continue that env's generator)."""
    state = load_checkpoint(checkpoint)
    config = Config.from_dict(state["config"])
    vec = VecEnv(evaluation_factory(config.env), [seed])
    model = acting_model(config, vec.spec)
    model.load_state_dict(state["model"])
    flat, layout = flatten_params(model)
    rms = state.get("obs_rms")
    extras = {} if rms is None else {"obs_mean": rms["mean"].numpy(), "obs_var": rms["var"].numpy()}
    policy = build_policy(flat, layout, extras, config, vec.spec, num_envs=1)
    rng = np.random.default_rng(seed)
    try:
        while len(vec.finished) < episodes:
            vec.step(policy.act(vec.obs, rng, deterministic=True).actions)
    finally:
        vec.close()
    returns = np.array([r for r, _ in vec.finished[:episodes]])
    return {
        "env_id": config.env.id,
        "episodes": episodes,
        "mean": float(returns.mean()),
        "std": float(returns.std()),
        "policy_version": int(state.get("policy_version", -1)),
    }
