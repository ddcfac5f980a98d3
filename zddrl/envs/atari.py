"""Atari games (ale_py's ids, ``env.atari``): zddrl's preprocessing of one gymnasium env, the reference path
(``atari_wrappers``, with ``FireReset`` and ``LifeLoss``), and ``env.backend "ale_vector"``, the same games on ALE's
own C++ vector env (``AleVecEnv``). Imports only zddrl.envs.spaces; zddrl.envs.make builds the reference path's
envs from an id, zddrl.envs.vector picks the backend."""

from __future__ import annotations

import re
from typing import Any

import gymnasium as gym
import numpy as np

from zddrl.config import EnvConfig
from zddrl.envs.spaces import EnvError, EnvSpec

ALE_VECTOR_KWARGS = "env.kwargs go to gymnasium's constructor: not with env.backend 'ale_vector'"


def register_ale() -> None:
    """gymnasium >= 1.0 registers the ALE ids only once ale_py is imported (an installed package, no remote code)."""
    try:
        import ale_py
    except ImportError:
        raise EnvError('env.atari needs ale-py and OpenCV: pip install -e ".[atari]"') from None
    gym.register_envs(ale_py)


def atari_wrappers(env: gym.Env, config: EnvConfig) -> gym.Env:
    """The DQN/IMPALA preprocessing (Mnih et al. 2015; Machado et al. 2018): ``noop_max`` random no-ops at reset,
    4 frames per step max-pooled over the last two, ``screen_size`` squared grayscale ``uint8``; FIRE at reset in
    games that wait for it; with ``episodic_life`` each lost life marked (``LifeLoss``); the last ``frame_stack``
    frames stacked (``[frame_stack, screen_size, screen_size]``). Rewards are clipped by the learner
    (``clip_rewards``) and episodes end at game over only: metrics see the true returns of whole games."""
    env = gym.wrappers.AtariPreprocessing(env, noop_max=config.noop_max, frame_skip=4, screen_size=config.screen_size)
    fire = "FIRE" in env.unwrapped.get_action_meanings()  # type: ignore[attr-defined]
    if fire:
        env = FireReset(env)
    if config.episodic_life:
        env = LifeLoss(env, fire)
    if config.frame_stack > 1:
        env = gym.wrappers.FrameStackObservation(env, config.frame_stack)
    return env


class FireReset(gym.Wrapper):
    """Press FIRE after each reset: games like Breakout do nothing until then (an agent that never fires
    sees a frozen screen until the time limit)."""

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        self.env.reset(**kwargs)
        obs, _, terminated, truncated, info = self.env.step(1)
        if terminated or truncated:
            obs, info = self.env.reset()
        return obs, info


class LifeLoss(gym.Wrapper):
    """``env.episodic_life``: ``info["life_lost"]`` is True at a step where the game took a life and goes on (the
    VecEnv sends it as the ``life_lost`` array, a terminal for the learner's returns), and FIRE is pressed right
    after it in games that wait for it (``fire``), its reward added to that step's. That press is a step the
    agent did not choose: it is not counted in env steps or episode lengths (nor is FireReset's at reset). The
    episode itself lasts to game over. Lives are ALE's ``info["lives"]``."""

    def __init__(self, env: gym.Env, fire: bool) -> None:
        super().__init__(env)
        self.fire = fire
        self.lives = 0

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        obs, info = self.env.reset(**kwargs)
        self.lives = int(info.get("lives", 0))
        return obs, info

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        lives = int(info.get("lives", self.lives))
        if lives < self.lives and not (terminated or truncated):
            if self.fire:
                obs, fire_reward, terminated, truncated, info = self.env.step(1)
                reward = float(reward) + float(fire_reward)
                lives = int(info.get("lives", lives))
            info = {**info, "life_lost": True}
        self.lives = lives
        return obs, reward, terminated, truncated, info


# ------------------------------------------------------------------------------------------ env.backend "ale_vector"
# Atari on ALE's own C++ vector env (ale_py.vector_env.AtariVectorEnv). Why: it steps, skips, max-pools, resizes and
# stacks the frames of all of an actor's envs in C++, where the reference path (atari_wrappers: gymnasium's
# AtariPreprocessing and FrameStackObservation, one Python env at a time) spends most of its time in Python
# (docs/benchmarks.md, "zddrl bench sample", both backends). The reference path stays the default; AleVecEnv's
# docstring lists how the preprocessing is matched to it.

ALE_ID = re.compile(r"^ALE/([A-Za-z0-9]+)-v5$")
MAX_FRAMES = 108_000
"""ALE v5's episode limit in frames (30 minutes of play), the reference path's too."""


def rom_name(env_id: str) -> str:
    """``ALE/MsPacman-v5`` -> ``ms_pacman`` (the ROM's name in ale_py); EnvError for any other id."""
    match = ALE_ID.match(env_id)
    if match is None:
        raise EnvError(f"env.backend 'ale_vector' takes ALE v5 ids such as ALE/Pong-v5, not {env_id!r}")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", match.group(1)).lower()


class AleVecEnv:
    """``ActorEnvs`` over one ``AtariVectorEnv`` of ``len(seeds)`` games, preprocessed as ``atari_wrappers`` does
    (frame skip and pooling, size, stack, no-ops, FIRE at reset, sticky actions, the 108,000-frame limit, the
    minimal action set, unclipped rewards; docs/configuration.md lists each, and the one difference: no
    ``episodic_life``). An episode that ends is reset in the same step (a partial reset of those envs), as
    ``VecEnv`` does, so a rollout never holds the extra step of gymnasium's next-step autoreset; the final
    observation of a truncated episode is kept for the bootstrap. One thread: an actor host is one process on one
    core."""

    episodic_life = False
    """Refused with this backend (``EnvConfig``): rollouts never carry ``life_lost``."""

    def __init__(self, env: EnvConfig, seeds: list[int]) -> None:
        try:
            from ale_py import roms
            from ale_py.vector_env import AtariVectorEnv
        except ImportError:
            raise EnvError('env.backend "ale_vector" needs ale-py: pip install -e ".[atari]"') from None
        game = rom_name(env.id)
        if roms.get_rom_path(game) is None:
            raise EnvError(f"ale-py has no ROM {game!r} (from env.id {env.id!r})")
        self.num_envs = len(seeds)
        self.vec = AtariVectorEnv(
            game,
            self.num_envs,
            num_threads=1,
            img_height=env.screen_size,
            img_width=env.screen_size,
            stack_num=env.frame_stack,
            frameskip=4,
            maxpool=True,
            noop_max=env.noop_max,
            use_fire_reset=True,
            episodic_life=False,
            reward_clipping=False,
            repeat_action_probability=env.repeat_action_probability,
            max_num_frames_per_episode=min(env.max_episode_steps or MAX_FRAMES, MAX_FRAMES),  # ALE v5 caps it too
            autoreset_mode="NextStep",
        )
        obs, _ = self.vec.reset(seed=np.asarray(seeds, dtype=np.int64))
        self.stack = env.frame_stack
        self.since_reset = np.zeros(self.num_envs, dtype=np.int64)
        """Steps since each env's reset: ALE pads a new episode's stack with black frames, the reference path
        with copies of its first frame, which ``_pad`` writes in for the first ``frame_stack - 1`` steps."""
        self.obs = self._pad(np.array(obs, dtype=np.uint8))
        self.spec = EnvSpec(
            obs_shape=tuple(self.obs.shape[1:]),
            discrete=True,
            action_dim=len(self.vec.ale.get_action_set()),
            obs_dtype="uint8",
        )
        self.dtype = np.dtype(np.uint8)
        self.life_lost = np.zeros(self.num_envs, dtype=bool)
        self.ep_return = np.zeros(self.num_envs, dtype=np.float64)
        self.ep_length = np.zeros(self.num_envs, dtype=np.int64)
        self.finished: list[tuple[float, int]] = []

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        obs, rewards, terminated, truncated, _ = self.vec.step(np.asarray(actions, dtype=np.int64))
        rewards = np.asarray(rewards, dtype=np.float32)
        terminated, truncated = np.asarray(terminated, dtype=bool), np.asarray(truncated, dtype=bool)
        self.ep_return += rewards
        self.ep_length += 1
        done = terminated | truncated
        next_obs = np.array(obs, dtype=np.uint8)
        final_obs: dict[int, np.ndarray] = {}
        self.since_reset += 1
        next_obs = self._pad(next_obs)
        if done.any():
            for i in np.flatnonzero(done):
                final_obs[int(i)] = next_obs[i].copy()
                self.finished.append((float(self.ep_return[i]), int(self.ep_length[i])))
            self.ep_return[done], self.ep_length[done], self.since_reset[done] = 0.0, 0, 0
            reset_obs, _ = self.vec.reset(options={"reset_mask": done})  # the others report their frames unchanged
            next_obs[done] = self._pad(np.array(reset_obs, dtype=np.uint8))[done]
        self.obs = next_obs
        return next_obs, rewards, terminated, truncated, final_obs

    def _pad(self, obs: np.ndarray) -> np.ndarray:
        """``obs`` with each young episode's black leading frames replaced by its first frame (in place)."""
        for i in np.flatnonzero(self.since_reset < self.stack - 1):
            first = self.stack - 1 - int(self.since_reset[i])
            obs[i, :first] = obs[i, first]
        return obs

    def close(self) -> None:
        self.vec.close()
