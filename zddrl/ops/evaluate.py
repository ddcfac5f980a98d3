"""`zddrl eval`: deterministic episodes of a checkpoint's policy on a fresh env, optionally filmed.

One env, episodes one after another: its first reset is seeded with ``seed``, later resets continue its own
generator. The env is the run's evaluation env (``envs.evaluation_factory``: whole games, FIRE after a lost life
in the Atari games that wait for it); ``max_episode_steps`` cuts an episode after that many agent steps (counted
as truncated), so a policy that stalls a game cannot hold the command for the env's own limit (27,000 agent steps
in ALE). With ``video_dir`` each episode is written as ``episode-NNN.mp4`` (``ops.video``) from the env's
``rgb_array`` rendering.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np

from zddrl.config import Config, EnvConfig
from zddrl.envs import env_action, env_spec, evaluation_factory
from zddrl.ops.api import checkpoint_policy, read_state
from zddrl.ops.video import Mp4Writer, VideoError
from zddrl.proc import install_command

ATARI_FPS = 15.0
"""Agent steps per second of game time in Atari (60 frames a second, 4 frames a step): videos play in real time."""


class Episode(NamedTuple):
    ret: float
    steps: int
    truncated: bool
    """Ended by a time limit (``max_episode_steps`` or the env's own), not by the game."""
    seconds: float
    video: str | None


def evaluate(
    checkpoint: str,
    episodes: int,
    seed: int,
    max_episode_steps: int = 0,
    video_dir: Path | None = None,
    on_episode: Callable[[int, Episode], None] | None = None,
    allowed: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Mean and std of the return of ``episodes`` deterministic episodes, with each episode's figures;
    ``checkpoint`` may be a run directory (its final, else newest, checkpoint); ``on_episode(k, episode)`` is
    called as each one ends; ``allowed``: the code (``module:attr``) the run's config may name
    (``checkpoints.read_checkpoint``). A ``video_dir`` this call makes is removed again if it fails empty."""
    state, config = read_state(checkpoint, allowed)
    made = video_dir is not None and not video_dir.exists()
    try:
        return _evaluate(state, config, episodes, seed, max_episode_steps, video_dir, on_episode)
    except BaseException:
        if made and video_dir is not None and video_dir.is_dir() and not any(video_dir.iterdir()):
            video_dir.rmdir()
        raise


def _evaluate(
    state: dict[str, Any],
    config: Config,
    episodes: int,
    seed: int,
    max_episode_steps: int,
    video_dir: Path | None,
    on_episode: Callable[[int, Episode], None] | None,
) -> dict[str, Any]:
    if video_dir is not None:
        video_dir.mkdir(parents=True, exist_ok=True)
    env = evaluation_factory(config.env, render_mode="rgb_array" if video_dir is not None else None)()
    if max_episode_steps:
        env = gym.wrappers.TimeLimit(env, max_episode_steps)
    try:
        spec = env_spec(env)
        policy = checkpoint_policy(state, config, spec)
        act = _greedy(policy, spec.obs_dtype, env_action(spec), np.random.default_rng(seed))
        played = []
        for k in range(episodes):
            path = video_dir / f"episode-{k:03d}.mp4" if video_dir is not None else None
            played.append(_episode(env, act, seed if k == 0 else None, path, _fps(config.env, env)))
            if on_episode is not None:
                on_episode(k, played[-1])
    finally:
        env.close()
    returns = np.array([e.ret for e in played])
    return {
        "env_id": config.env.id,
        "episodes": episodes,
        "mean": float(returns.mean()),
        "std": float(returns.std()),
        "returns": [e.ret for e in played],
        "lengths": [e.steps for e in played],
        "truncated": sum(e.truncated for e in played),
        "videos": [e.video for e in played if e.video],
        "policy_version": int(state.get("policy_version", -1)),
    }


def _greedy(policy: Any, dtype: str, to_env: Callable[[Any], Any], rng: np.random.Generator) -> Callable:
    """``act(obs) -> env action``: the policy's deterministic action on one observation."""

    def act(obs: Any) -> Any:
        return to_env(policy.act(np.asarray(obs, dtype=dtype)[None], rng, deterministic=True).actions[0])

    return act


def _fps(env_config: EnvConfig, env: gym.Env) -> float:
    return ATARI_FPS if env_config.atari else float(env.metadata.get("render_fps") or 30)


def _episode(env: gym.Env, act: Callable, seed: int | None, video: Path | None, fps: float) -> Episode:
    """One episode to its end (filmed into ``video`` when given)."""
    t0 = time.monotonic()
    obs, _ = env.reset(seed=seed)
    writer = Mp4Writer(video, fps) if video is not None else None
    ret, steps, terminated, truncated = 0.0, 0, False, False
    try:
        if writer is not None:
            writer.add(_frame(env))
        while not (terminated or truncated):
            obs, reward, terminated, truncated, _ = env.step(act(obs))
            ret += float(reward)
            steps += 1
            if writer is not None:
                writer.add(_frame(env))
    finally:
        if writer is not None:
            writer.close()
    return Episode(ret, steps, bool(truncated and not terminated), time.monotonic() - t0, str(video) if video else None)


def _frame(env: gym.Env) -> np.ndarray:
    try:
        frame = env.render()
    except gym.error.DependencyNotInstalled as exc:  # classic control draws with pygame
        missing = str(exc).split(",")[0]  # gymnasium's own advice after the comma names another install command
        raise VideoError(f"--video needs the video extra ({missing}): {install_command('video')}") from None
    if not isinstance(frame, np.ndarray):
        raise VideoError(f"the env renders no rgb_array frames (render() gave {type(frame).__name__})")
    return frame
