"""Environment construction, space checks and the actor's vectorised stepping.

Env ids are registered gymnasium ids or ``package.module:callable`` factories. Only Box and
Discrete observation/action spaces are supported; anything else is a clear error at start-up.

An id with a ``:`` names a module to import (ours, or gymnasium's ``module:Env-v0``), which runs its code.
An actor host learns the env id from the network, so it builds such an env only if its own command line
allows that exact id (``zddrl actor --allow-env``): ``env_refusal``. Ids of the local gymnasium registry
import nothing that is not already installed and registered here.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from zddrl.config import EnvConfig


class EnvError(ValueError):
    """An env that cannot be built or whose spaces zddrl cannot handle."""


@dataclass(frozen=True)
class EnvSpec:
    """What the policy network needs to know about an env."""

    obs_shape: tuple[int, ...]
    discrete: bool
    action_dim: int
    """Number of actions (Discrete) or the action vector length (Box)."""
    action_low: tuple[float, ...] = ()
    action_high: tuple[float, ...] = ()
    obs_dtype: str = "float32"
    """``float32`` or ``uint8`` (pixels): observations keep this dtype in the actor's buffer, on the wire and in
    the learner's batches; a model scales ``uint8`` inside its forward pass (zddrl.algos.cnn)."""


OBS_DTYPES = ("float32", "uint8")


def env_refusal(env_id: str, allowed: frozenset[str]) -> str:
    """Why a host that allows the ``module:callable`` ids ``allowed`` must not build ``env_id`` (nothing
    imported yet), or "": an id that names a module must be one of them."""
    if ":" in env_id and env_id not in allowed:
        return (
            f"env {env_id!r} names code to import, and this host does not allow it "
            f"(allow it on its command line: --allow-env {env_id})"
        )
    return ""


def env_factory(
    env_id: str, max_episode_steps: int = 0, allowed: frozenset[str] | None = None, render_mode: str | None = None
) -> Callable[[], gym.Env]:
    """A zero-argument constructor for ``env_id``; raises EnvError for unknown ids or bad factories, and (with
    ``allowed``: an actor host's list) for a ``module:callable`` id not in ``allowed``, before importing it.
    ``render_mode`` is passed to gymnasium's registered envs (a ``module:callable`` env renders as it was made)."""
    if allowed is not None and env_refusal(env_id, allowed):
        raise EnvError(env_refusal(env_id, allowed))
    module_name, _, attr = env_id.partition(":")
    if attr.isidentifier():  # "pkg.module:make_env"; gymnasium's "module:Env-v0" has a dash
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise EnvError(f"env factory {env_id!r} cannot be imported: {exc}") from None
        if not callable(fn):
            raise EnvError(f"env factory {env_id!r} is not callable")
        return lambda: _with_limit(fn(), max_episode_steps)
    try:
        gym.spec(env_id)
    except gym.error.Error as exc:
        raise EnvError(f"unknown gymnasium env id {env_id!r}: {exc}") from None
    kwargs: dict[str, Any] = {"max_episode_steps": max_episode_steps} if max_episode_steps else {}
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    return lambda: gym.make(env_id, **kwargs)


def make_factory(
    env: EnvConfig, allowed: frozenset[str] | None = None, render_mode: str | None = None
) -> Callable[[], gym.Env]:
    """``env_factory`` for a run's ``[env]`` section, with its wrappers (``env.atari``: ``atari_wrappers``)."""
    if not env.atari:
        return env_factory(env.id, env.max_episode_steps, allowed, render_mode)
    if allowed is not None and env_refusal(env.id, allowed):
        raise EnvError(env_refusal(env.id, allowed))
    _register_ale()
    try:
        gym.spec(env.id)
    except gym.error.Error as exc:
        raise EnvError(f"unknown Atari env id {env.id!r}: {exc}") from None
    # ALE ids skip frames themselves (v5: 4); AtariPreprocessing wants every frame to max-pool the last two.
    kwargs: dict[str, Any] = {"frameskip": 1, "repeat_action_probability": env.repeat_action_probability}
    if env.max_episode_steps:
        kwargs["max_episode_steps"] = env.max_episode_steps
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    return lambda: atari_wrappers(gym.make(env.id, **kwargs), env)


def evaluation_factory(env: EnvConfig, render_mode: str | None = None) -> Callable[[], gym.Env]:
    """``make_factory`` for evaluation episodes: whole games, the same whatever the training settings. In Atari
    games that wait for FIRE it is pressed after every lost life (``LifeLoss``; the marks it leaves are not
    used): a greedy policy that never learned to fire would otherwise look at a frozen screen until the time
    limit (a run with ``env.episodic_life`` never needed to)."""
    reference = dataclasses.replace(env, episodic_life=env.atari, backend="gymnasium")  # one env, with LifeLoss
    return make_factory(reference, render_mode=render_mode)


def _register_ale() -> None:
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


def _with_limit(env: gym.Env, max_episode_steps: int) -> gym.Env:
    if not isinstance(env, gym.Env):
        raise EnvError(f"env factory returned {type(env).__name__}, not a gymnasium.Env")
    return gym.wrappers.TimeLimit(env, max_episode_steps) if max_episode_steps else env


class EnvLatency(gym.Wrapper):
    """Benchmark knob (``train.env_latency_ms``): every ``step`` sleeps ``latency_ms`` first, as a remote or slow
    simulator would take that long to answer. Sleeping, not spinning, so that on a small host the latency of many
    actors overlaps as a remote simulator's would, and the CPU stays free for the rest of the system."""

    def __init__(self, env: gym.Env, latency_ms: float) -> None:
        super().__init__(env)
        self.latency_s = latency_ms / 1000.0

    def step(self, action: Any) -> Any:
        time.sleep(self.latency_s)
        return self.env.step(action)


def with_latency(make: Callable[[], gym.Env], latency_ms: float) -> Callable[[], gym.Env]:
    """``make`` with every env wrapped in ``EnvLatency`` (``make`` itself when ``latency_ms`` is 0)."""
    if latency_ms <= 0:
        return make
    return lambda: EnvLatency(make(), latency_ms)


def env_spec(env: gym.Env) -> EnvSpec:
    obs, act = env.observation_space, env.action_space
    if not isinstance(obs, gym.spaces.Box):
        raise EnvError(f"observation space {obs} is not supported (Box only)")
    # uint8 observations (pixels, 4x smaller) stay uint8; every other dtype travels as float32
    obs_dtype = "uint8" if obs.dtype == np.uint8 else "float32"
    if isinstance(act, gym.spaces.Discrete):
        return EnvSpec(obs_shape=tuple(obs.shape), discrete=True, action_dim=int(act.n), obs_dtype=obs_dtype)
    if isinstance(act, gym.spaces.Box) and len(act.shape) == 1:
        return EnvSpec(
            obs_shape=tuple(obs.shape),
            discrete=False,
            action_dim=int(act.shape[0]),
            action_low=tuple(float(x) for x in act.low),
            action_high=tuple(float(x) for x in act.high),
            obs_dtype=obs_dtype,
        )
    raise EnvError(f"action space {act} is not supported (Discrete or 1-D Box only)")


def probe_spec(env: EnvConfig | str, max_episode_steps: int = 0) -> EnvSpec:
    """Build one env of the run (its ``[env]`` section, or a bare id) to read its spaces (the learner never
    steps it)."""
    if isinstance(env, str):
        return spec_of(env_factory(env, max_episode_steps))
    return spec_of(make_factory(env))


def spec_of(make: Callable[[], gym.Env]) -> EnvSpec:
    """The spec of the env ``make`` builds (one built and closed)."""
    env = make()
    try:
        return env_spec(env)
    finally:
        env.close()


class ActorEnvs(Protocol):
    """What an actor host steps: ``VecEnv`` (gymnasium envs, one at a time) or ``AleVecEnv`` (ALE's C++ vector env).
    ``obs`` is the current observation of every env; ``step`` resets an env whose episode ended in the same step
    and hands back its final observation; ``finished`` collects ``(return, length)`` of the episodes that ended."""

    num_envs: int
    spec: EnvSpec
    dtype: np.dtype
    obs: np.ndarray
    life_lost: np.ndarray
    episodic_life: bool
    finished: list[tuple[float, int]]

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]: ...

    def close(self) -> None: ...


def actor_envs(
    env: EnvConfig, seeds: list[int], allowed: frozenset[str] | None = None, latency_ms: float = 0.0
) -> ActorEnvs:
    """An actor host's envs of a run's ``[env]`` section (``env.backend``), env ``i`` seeded with ``seeds[i]``."""
    if env.backend == "ale_vector":
        if latency_ms > 0:
            raise EnvError("env latency (a benchmark knob) wraps gymnasium envs: not with env.backend 'ale_vector'")
        return AleVecEnv(env, seeds)
    return VecEnv(with_latency(make_factory(env, allowed), latency_ms), seeds, env.episodic_life)


def env_action(spec: EnvSpec) -> Callable[[Any], Any]:
    """One policy action as the env takes it: an ``int`` (Discrete), or clipped to the bounds (Box)."""
    if spec.discrete:
        return int
    low, high = np.asarray(spec.action_low), np.asarray(spec.action_high)
    return lambda a: np.clip(a, low, high)


class VecEnv:
    """N envs stepped in one process with same-step auto-reset.

    ``step`` returns the next observations (already reset where an episode ended), rewards,
    terminated and truncated flags, and for each env whose episode ended the *final* observation of
    that episode (needed to bootstrap at truncation). Finished episodes' returns and lengths are
    collected in ``finished``. Env ``i`` is seeded with ``seeds[i]`` on its first reset; later
    resets continue that env's own generator, so each env has its own seed stream.
    """

    def __init__(self, make: Callable[[], gym.Env], seeds: list[int], episodic_life: bool = False) -> None:
        self.envs = [make() for _ in seeds]
        self.episodic_life = episodic_life
        """Whether rollouts carry ``life_lost`` (the envs are wrapped in ``LifeLoss``)."""
        self.life_lost = np.zeros(len(seeds), dtype=bool)
        """Of the last step: the envs whose game took a life and went on (``LifeLoss``)."""
        self.spec = env_spec(self.envs[0])
        self.num_envs = len(self.envs)
        self.dtype = np.dtype(self.spec.obs_dtype)
        """Observations keep the env's uint8 (pixels) from env to wire; anything else is float32."""
        self.obs = np.stack([np.asarray(env.reset(seed=s)[0], dtype=self.dtype) for env, s in zip(self.envs, seeds)])
        self.ep_return = np.zeros(self.num_envs, dtype=np.float64)
        self.ep_length = np.zeros(self.num_envs, dtype=np.int64)
        self.finished: list[tuple[float, int]] = []
        self.to_env = env_action(self.spec)

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        n = self.num_envs
        rewards = np.empty(n, dtype=np.float32)
        terminated = np.empty(n, dtype=bool)
        truncated = np.empty(n, dtype=bool)
        final_obs: dict[int, np.ndarray] = {}
        next_obs = self.obs.copy()
        for i, env in enumerate(self.envs):
            obs, r, term, trunc, info = env.step(self.to_env(actions[i]))
            rewards[i], terminated[i], truncated[i] = r, term, trunc
            self.life_lost[i] = info.get("life_lost", False)
            self.ep_return[i] += r
            self.ep_length[i] += 1
            if term or trunc:
                final_obs[i] = np.asarray(obs, dtype=self.dtype)
                self.finished.append((float(self.ep_return[i]), int(self.ep_length[i])))
                self.ep_return[i], self.ep_length[i] = 0.0, 0
                obs, _ = env.reset()
            next_obs[i] = obs
        self.obs = next_obs
        return next_obs, rewards, terminated, truncated, final_obs

    def close(self) -> None:
        for env in self.envs:
            env.close()


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
