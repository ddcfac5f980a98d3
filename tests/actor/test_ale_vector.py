"""env.backend = "ale_vector": ALE's C++ vector env behind the actor's VectorEnv interface, preprocessed as the
gymnasium reference path is (zddrl.envs.AleVecEnv)."""

from __future__ import annotations

import numpy as np
import pytest

from zddrl.config import Config, ConfigError, EnvConfig
from zddrl.envs import AleVecEnv, EnvError, VecEnv, make_factory, rom_name, vector_env

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
    cfg = pong(max_episode_steps=400, noop_max=0)  # frames, as the reference path counts them: ~100 agent steps
    ale = AleVecEnv(cfg, [3, 4])
    try:
        steps, truncated = 0, np.zeros(2, dtype=bool)
        while not truncated.any() and steps < 200:
            obs, _, terminated, truncated, final = ale.step(np.array([0, 1]))
            steps += 1
        assert truncated.all() and not terminated.any() and set(final) == {0, 1}, (steps, truncated)
        assert all(not np.array_equal(final[i], obs[i]) for i in (0, 1))  # obs is the new episode's first frame
        assert all((obs[i, k] == obs[i, 3]).all() for i in (0, 1) for k in range(3))
        assert [n for _, n in ale.finished] == [steps, steps] and ale.ep_length.tolist() == [0, 0]
        _, _, terminated, truncated, final = ale.step(np.array([0, 1]))  # no wasted autoreset step follows
        assert not (terminated | truncated).any() and final == {} and ale.ep_length.tolist() == [1, 1]
    finally:
        ale.close()


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


def test_vector_env_builds_the_configured_backend() -> None:
    config = Config().replace({"env.id": "ALE/Pong-v5", "env.atari": True, "env.backend": "ale_vector"})
    vec = vector_env(config.env, [1])
    try:
        assert isinstance(vec, AleVecEnv)
    finally:
        vec.close()
    with pytest.raises(EnvError, match="latency"):
        vector_env(config.env, [1], latency_ms=5)


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
