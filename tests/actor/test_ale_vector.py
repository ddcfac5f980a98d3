"""env.backend = "ale_vector": ALE's C++ vector env behind the actor's ActorEnvs interface, preprocessed as the
gymnasium reference path is (zddrl.envs.AleVecEnv)."""

from __future__ import annotations

import numpy as np
import pytest

from zddrl.config import Config, ConfigError, EnvConfig
from zddrl.envs import AleVecEnv, EnvError, SlowEnvs, VecEnv, actor_envs, evaluation_factory, make_factory, rom_name

pytest.importorskip("ale_py")


def pong(**kw) -> EnvConfig:
    return EnvConfig(id="ALE/Pong-v5", atari=True, **kw)


@pytest.mark.parametrize("size", [84, 42])
def test_the_spec_is_the_reference_paths(size: int) -> None:
    cfg = pong(screen_size=size, frame_stack=4)
    ref, ale = VecEnv(make_factory(cfg), [1, 2]), AleVecEnv(cfg, [1, 2])
    try:
        assert ale.spec == ref.spec and ale.obs.shape == (2, 4, size, size) and ale.obs.dtype == np.uint8
    finally:
        ref.close()
        ale.close()


def test_frames_match_the_reference_path_once_the_games_are_in_step() -> None:
    """Without no-ops and sticky actions both are deterministic. Their one difference is FIRE at reset (ALE presses
    it for one frame, the reference for one agent step of 4): Breakout's frames then differ only where the ball
    is, and every stack starts as the reference's does, with copies of the first frame (ALE's own are black)."""
    cfg = EnvConfig(id="ALE/Breakout-v5", atari=True, noop_max=0, repeat_action_probability=0.0)
    ref, ale = VecEnv(make_factory(cfg), [1]), AleVecEnv(cfg, [1])
    try:
        for _ in range(8):
            diff = np.abs(ref.obs.astype(np.int16) - ale.obs.astype(np.int16))
            assert (diff > 0).mean() < 0.01, (diff > 0).mean()
            assert all(ale.obs[0, k].mean() > 20 for k in range(4))  # no black padding frame
            ref.step(np.array([0]))
            ale.step(np.array([0]))
    finally:
        ref.close()
        ale.close()


def test_an_episode_ends_and_restarts_in_the_same_step_with_its_final_frame_kept() -> None:
    """Breakout played at random ends its games at different steps: only the env that ended is reset (a partial
    reset), in that same step, with a fresh stack; the others go on. A truncated episode (ALE counts the limit in
    frames after the reset) hands back its final frame for the bootstrap, as every ended episode does."""
    ale = AleVecEnv(EnvConfig(id="ALE/Breakout-v5", atari=True), [3, 4, 5])
    rng, partial, ended = np.random.default_rng(0), 0, np.zeros(3, dtype=bool)
    try:
        for _ in range(3000):
            before = ale.ep_length.copy()
            obs, _, terminated, truncated, final = ale.step(rng.integers(0, 4, size=3))
            done = terminated | truncated
            assert set(final) == set(np.flatnonzero(done))  # as VecEnv: the rollout keeps those of truncations
            for i in np.flatnonzero(done):
                assert ale.ep_length[i] == 0 and ale.finished[-1][1] >= 1
                assert all((obs[i, k] == obs[i, 3]).all() for k in range(3))  # a new episode, stacked as the reference
            assert (ale.ep_length[~done] == before[~done] + 1).all()  # the others go on: no wasted autoreset step
            partial += int(done.any() and not done.all())
            ended |= done
            if ended.all():
                break
        assert ended.all() and partial >= 1, (ended, partial)
    finally:
        ale.close()
    short = AleVecEnv(pong(max_episode_steps=400, noop_max=0), [3])  # frames: ~100 agent steps
    try:
        for _ in range(200):
            obs, _, terminated, truncated, final = short.step(np.array([0]))
            if truncated[0]:
                break
        assert truncated[0] and not terminated[0] and not np.array_equal(final[0], obs[0]), truncated
        assert 90 <= short.finished[-1][1] <= 110, short.finished
    finally:
        short.close()


def test_the_same_seeds_give_the_same_games() -> None:
    runs = []
    for _ in range(2):
        ale = AleVecEnv(pong(), [7, 8])
        frames = [ale.obs.copy()]
        for _ in range(30):
            frames.append(ale.step(np.array([2, 3]))[0].copy())
        ale.close()
        runs.append(np.stack(frames))
    assert np.array_equal(runs[0], runs[1])


def test_evaluation_of_an_ale_vector_run_uses_the_reference_env() -> None:
    """Evaluations (the learner's, `zddrl eval`) play one env of the reference path, whatever the actors' backend."""
    env = evaluation_factory(pong(backend="ale_vector"))()
    try:
        assert env.reset(seed=1)[0].shape == (4, 84, 84)
    finally:
        env.close()


def test_actor_envs_builds_the_configured_backend() -> None:
    config = Config().replace({"env.id": "ALE/Pong-v5", "env.atari": True, "env.backend": "ale_vector"})
    vec = actor_envs(config.env, [1])
    try:
        assert isinstance(vec, AleVecEnv)
    finally:
        vec.close()
    with pytest.raises(EnvError, match="latency"):
        SlowEnvs(latency_ms=5)(config.env, [1])


def test_rom_names_and_refusals() -> None:
    assert rom_name("ALE/Pong-v5") == "pong" and rom_name("ALE/MsPacman-v5") == "ms_pacman"
    with pytest.raises(EnvError, match="ALE v5 ids"):
        rom_name("PongNoFrameskip-v4")
    with pytest.raises(EnvError, match="no ROM"):
        AleVecEnv(EnvConfig(id="ALE/NoSuchGame-v5", atari=True), [1])
    with pytest.raises(ConfigError, match="needs env.atari"):
        EnvConfig(id="CartPole-v1", backend="ale_vector")
    with pytest.raises(ConfigError, match="episodic_life"):
        pong(backend="ale_vector", episodic_life=True)
    with pytest.raises(ConfigError, match="env.backend must be one of"):
        pong(backend="envpool")
