"""`zddrl eval`: a line per episode, a step limit per episode, FIRE after a lost life, MP4 videos that play."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from zddrl.algos.core import acting_model
from zddrl.config import Config, EnvConfig
from zddrl.envs import evaluation_factory, probe_spec

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("ale_py")
pytestmark = pytest.mark.slow  # zddrl eval processes, Atari games played to their end


def checkpoint(tmp_path: Path, game: str) -> Path:
    """A checkpoint as the learner writes one (config, model, version), of an untrained CNN policy."""
    config = Config().replace(
        {
            "env.id": f"ALE/{game}-v5",
            "env.atari": True,
            "env.screen_size": 42,
            "model.kind": "nature_cnn",
            "model.hidden": [64],
            "algo.name": "impala",
            "algo.schedule": "async",
        }
    )
    torch.manual_seed(0)
    model = acting_model(config, probe_spec(config.env))
    path = tmp_path / "final.pt"
    torch.save({"config": config.to_dict(), "model": model.state_dict(), "policy_version": 7}, path)
    return path


def zddrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zddrl", *args], capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_eval_writes_a_line_per_episode_cuts_long_ones_and_films_them(tmp_path: Path) -> None:
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg")
    ckpt, videos = checkpoint(tmp_path, "Pong"), tmp_path / "videos"
    done = zddrl("eval", str(ckpt), "--episodes", "2", "--max-episode-steps", "60", "--video", str(videos), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["lengths"] == [60, 60] and result["truncated"] == 2 and result["policy_version"] == 7
    lines = [line for line in done.stderr.splitlines() if line.startswith("episode ")]
    assert len(lines) == 2 and "episode 2/2: return" in lines[1] and "in 60 steps (cut by the step limit)" in lines[1]
    assert result["videos"] == [str(videos / "episode-000.mp4"), str(videos / "episode-001.mp4")]
    reader = imageio_ffmpeg.read_frames(result["videos"][0])
    meta = next(reader)
    frames = [np.frombuffer(f, np.uint8) for f in reader]
    assert meta["codec"].startswith("h264") and tuple(meta["size"]) == (160, 210), meta
    assert len(frames) == 61 and meta["fps"] == 15  # the first frame, then one per agent step
    assert frames[30].reshape(210, 160, 3).std() > 10  # a game, not a blank screen


def test_eval_without_video_prints_the_summary_line(tmp_path: Path) -> None:
    done = zddrl("eval", str(checkpoint(tmp_path, "Pong")), "--episodes", "1", "--max-episode-steps", "20")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.splitlines()
    assert out[0].startswith("episode 1/1: return") and out[-1].startswith("1 episodes of ALE/Pong-v5: return")


def test_the_evaluation_env_fires_after_a_lost_life() -> None:
    """Breakout waits for FIRE after each lost life: a policy that never presses it (NOOP only) would stall each
    game until the time limit. The evaluation env presses it, so the lives run out and the game ends."""
    env = evaluation_factory(EnvConfig(id="ALE/Breakout-v5", atari=True, screen_size=42))()
    try:
        env.reset(seed=1)
        lives, terminated, steps = [], False, 0
        while not terminated and steps < 5000:
            _, _, terminated, truncated, info = env.step(0)
            lives.append(info["lives"])
            steps += 1
        assert terminated and lives[0] == 5 and lives[-1] == 0, (steps, lives[-1])
    finally:
        env.close()
