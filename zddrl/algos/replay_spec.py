"""What the replay algorithms (Ape-X, SAC) share in their specs: the checks of a run and the buffer's figures.

Torch-free and gymnasium-free: spec modules import it when a config is read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zddrl.algos.spec import Figure
from zddrl.config import Config

if TYPE_CHECKING:  # pragma: no cover - types only: a spec module imports cheaply
    from zddrl.envs import EnvSpec

REPLAY_ALGO_FIGURES = (
    Figure("grad_steps", "perf"),
    Figure("grad_steps_total", "perf"),
    Figure("beta", "replay"),
    Figure("replay_size", "replay"),
    Figure("replay_fill", "replay"),
    Figure("replay_bytes", "replay"),
    Figure("replay_stale_updates", "replay"),
    Figure("replay_dropped_by_version", "replay"),
    Figure("nonfinite_td", "replay"),
    Figure("is_weight_mean"),
)
"""What ``replay_learner.ReplayLearner.update`` reports besides the algorithm's own step figures."""


def replay_algo_refusal(config: Config, env: EnvSpec) -> str:
    """Why a replay algorithm cannot run this config, whatever its env, or ""."""
    name = config.algo.name
    if config.model.kind != "mlp" and not config.model.is_custom:
        return f"algo.name {name!r} runs with model.kind 'mlp' or a network of your own (no built-in CNN for it yet)"
    if config.learner.autocast == "bf16":
        return f"algo.name {name!r} does not take learner.autocast = 'bf16' (the actor-critic algorithms only)"
    if config.env.episodic_life:
        return f"algo.name {name!r} does not take env.episodic_life (its n-step returns read no life_lost)"
    if config.algo.normalize_obs or config.algo.normalize_reward:
        return (
            f"algo.normalize_obs and algo.normalize_reward are not supported by {name!r} (stored transitions would "
            "change meaning as the statistics move)"
        )
    return ""
