"""The pixel path learns, through `zddrl train`, with the Atari examples' algorithm settings.

A policy that does not leave the uniform one on Atari can be a defect in the CNN path (frames, their order,
scaling, the torso's gradients) or settings that cannot work at the scale of the run. This test tells them apart:
Catch (Osband et al. 2020, bsuite) drawn in pixels, where the reward comes only at the end of each fall, so that
learning needs the frames, the actions and the returns to line up in time. With each example's `[algo]` and
`[model]` (the env replaced by this one; bf16 autocast, a speed option whose cost depends on the CPU, off), the
policy must catch at least four balls in five over 20 games (chance: about one in five) within the budget.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # starts real zddrl processes and learns

ROOT = Path(__file__).resolve().parent.parent
CELL = 6
"""Pixels per grid cell: a 7x7 grid is a 42x42 frame, the Nature CNN's smallest comfortable input."""
GRID = 7


class PixelCatch(gym.Env):
    """A ball falls one row per step from a random column of the top row; the paddle on the bottom row moves
    left, stays or moves right. When the ball reaches the bottom: +1 if the paddle is under it, else -1, and the
    episode ends (6 steps). Observations: ``[1, 42, 42]`` uint8 (ball and paddle drawn as 6x6 squares). A
    uniform policy catches about one ball in five (mean return about -0.6); the best one catches every ball."""

    metadata = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 255, (1, GRID * CELL, GRID * CELL), np.uint8)
        self.action_space = gym.spaces.Discrete(3)
        self.ball = (0, 0)
        self.paddle = GRID // 2

    def _obs(self) -> np.ndarray:
        frame = np.zeros(self.observation_space.shape, np.uint8)
        row, col = self.ball
        frame[0, row * CELL : (row + 1) * CELL, col * CELL : (col + 1) * CELL] = 255
        bottom = (GRID - 1) * CELL
        frame[0, bottom:, self.paddle * CELL : (self.paddle + 1) * CELL] = 128
        return frame

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.ball = (0, int(self.np_random.integers(GRID)))
        self.paddle = GRID // 2
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.paddle = min(GRID - 1, max(0, self.paddle + int(action) - 1))
        self.ball = (self.ball[0] + 1, self.ball[1])
        if self.ball[0] < GRID - 1:
            return self._obs(), 0.0, False, False, {}
        return self._obs(), 1.0 if self.paddle == self.ball[1] else -1.0, True, False, {}


def pixel_catch() -> gym.Env:
    """Env factory of the tests below (``tests.test_pixel_learning:pixel_catch``)."""
    return PixelCatch()


def test_a_uniform_policy_rarely_catches() -> None:
    """The bar the runs below must clear is far above chance."""
    env, rng, returns = PixelCatch(), np.random.default_rng(0), []
    for seed in range(400):
        env.reset(seed=seed)
        done, ret = False, 0.0
        while not done:
            _, reward, done, _, _ = env.step(int(rng.integers(3)))
            ret += reward
        returns.append(ret)
    assert -0.8 < np.mean(returns) < -0.4


@pytest.mark.parametrize("example", ["breakout_impala.toml", "pong_appo.toml"])
def test_the_atari_examples_settings_learn_from_pixels(
    example: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    )
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "zddrl",
            "train",
            str(ROOT / "examples" / example),
            "--run-dir",
            str(run_dir),
            "--until-return",
            "0.6",
            "--max-steps",
            "150000",
            "--max-seconds",
            "240",
            "--set",
            "env.id=tests.test_pixel_learning:pixel_catch",
            "--set",
            "env.atari=false",
            "--set",
            "env.episodic_life=false",
            "--set",
            "learner.autocast=off",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    with open(run_dir / "metrics.csv") as f:
        entropies = [float(r["entropy"]) for r in csv.DictReader(f) if r["entropy"]]
    assert summary["reached"], (summary, entropies[-5:])  # the entropy shows how far it left the uniform policy
