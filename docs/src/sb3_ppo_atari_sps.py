#!/usr/bin/env python
"""Anchor: SB3 PPO on an Atari game from pixels (RL-Zoo Atari settings: 8 envs, n_steps 128, batch 256,
4 epochs, CnnPolicy, AtariWrapper, frame stack 4), CPU, for a fixed wall-clock budget.
Prints one JSON line: env steps (agent steps; x4 for frames), seconds, steps/s, threads.
Usage: sb3_ppo_atari_sps.py [--env BreakoutNoFrameskip-v4] [--seconds 120] [--threads 2]"""

import argparse, json, time

import ale_py
import gymnasium as gym
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_atari_env
from stable_baselines3.common.vec_env import VecFrameStack

gym.register_envs(ale_py)


class Budget(BaseCallback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def _on_training_start(self):
        self.t0 = time.perf_counter()

    def _on_step(self):
        return time.perf_counter() - self.t0 < self.seconds


p = argparse.ArgumentParser()
p.add_argument("--env", default="BreakoutNoFrameskip-v4")
p.add_argument("--seconds", type=float, default=120)
p.add_argument("--threads", type=int, default=2)
a = p.parse_args()
torch.set_num_threads(a.threads)
env = VecFrameStack(make_atari_env(a.env, n_envs=8, seed=1), n_stack=4)
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
    seed=1,
    verbose=0,
)
cb = Budget(a.seconds)
t0 = time.perf_counter()
model.learn(total_timesteps=10**8, callback=cb)
dt = time.perf_counter() - t0
print(
    json.dumps(
        {
            "impl": "sb3",
            "env": a.env,
            "env_steps": int(model.num_timesteps),
            "seconds": round(dt, 1),
            "sps": round(model.num_timesteps / dt, 1),
            "threads": a.threads,
        }
    )
)
