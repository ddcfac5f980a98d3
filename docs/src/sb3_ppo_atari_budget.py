#!/usr/bin/env python
"""The single-process baseline of docs/benchmarks.md "Breakout for a fixed budget": SB3 PPO with the RL-Zoo Atari
settings of ../shared/anchors/sb3_ppo_atari_sps.py (8 envs, n_steps 128, batch 256, 4 epochs, CnnPolicy,
AtariWrapper, frame stack 4, CPU), trained for a wall-clock budget that counts from the process's start, as
`zddrl train --max-seconds` does. Prints one JSON line: env steps, seconds, steps/s and the mean game score of the
last 20 episodes (Monitor's, before the AtariWrapper's reward clipping and life losses), with the curve.

Runs in its own venv: pip install torch==2.13.0 stable-baselines3 gymnasium ale-py opencv-python-headless
Usage: sb3_ppo_atari_budget.py [--env BreakoutNoFrameskip-v4] [--seconds 600] [--threads 2] [--seed 1]"""

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402

import ale_py  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback  # noqa: E402
from stable_baselines3.common.env_util import make_atari_env  # noqa: E402
from stable_baselines3.common.vec_env import VecFrameStack  # noqa: E402

gym.register_envs(ale_py)


class Budget(BaseCallback):
    """Stops at the budget; records (seconds since start, env steps, mean score of the last 20 episodes)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.curve, self.scores = seconds, [], []

    def _on_step(self) -> bool:
        for info in self.locals.get("infos", []):
            if "episode" in info:  # Monitor's whole-game score (the AtariWrapper's life losses end no episode here)
                self.scores.append(float(info["episode"]["r"]))
                self.curve.append(
                    (
                        round(time.perf_counter() - T_START, 1),
                        int(self.num_timesteps),
                        float(np.mean(self.scores[-20:])),
                    )
                )
        return time.perf_counter() - T_START < self.seconds


p = argparse.ArgumentParser()
p.add_argument("--env", default="BreakoutNoFrameskip-v4")
p.add_argument("--seconds", type=float, default=600)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--seed", type=int, default=1)
a = p.parse_args()
torch.set_num_threads(a.threads)
env = VecFrameStack(make_atari_env(a.env, n_envs=8, seed=a.seed), n_stack=4)
model = PPO(
    "CnnPolicy",
    env,
    n_steps=128,
    n_epochs=4,
    batch_size=256,
    learning_rate=2.5e-4,
    clip_range=0.1,
    vf_coef=0.5,
    ent_coef=0.01,
    device="cpu",
    seed=a.seed,
    verbose=0,
)
cb = Budget(a.seconds)
model.learn(total_timesteps=10**9, callback=cb)
dt = time.perf_counter() - T_START
print(
    json.dumps(
        {
            "impl": "sb3",
            "env": a.env,
            "env_steps": int(model.num_timesteps),
            "seconds": round(dt, 1),
            "sps": round(model.num_timesteps / dt, 1),
            "threads": a.threads,
            "episodes": len(cb.scores),
            "score_mean_20": float(np.mean(cb.scores[-20:])) if cb.scores else None,
            "curve": cb.curve,
        }
    )
)
