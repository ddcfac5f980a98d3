#!/usr/bin/env python
"""Anchor benchmark: Stable-Baselines3 PPO on gymnasium CartPole-v1 (CPU).

Measures, for one seed / one config:
  * hit_s / hit_steps: wall-clock seconds (from the start of learn()) and total
    env steps (summed over all envs) at which the running mean of the last 20
    finished *training* episodes (stochastic policy, Monitor episode returns,
    in the order episodes finish) first reaches >= 475.  Needs 20 finished
    episodes.  null if never reached.
  * sps: total env steps / wall seconds of learn() (rollouts + PPO updates).
  * final eval: mean/std return of 10 deterministic episodes on a fresh env
    after training (not included in the timed part).
Prints exactly one JSON line at the end.

Configs:
  zoo      RL-Zoo tuned CartPole-v1 PPO: n_envs=8, n_steps=32, batch_size=256,
           gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0,
           learning_rate=lin_0.001, clip_range=lin_0.2, 1e5 steps.
  default  SB3 defaults, i.e. PPO("MlpPolicy", env) with n_envs=1
           (n_steps=2048, batch_size=64, n_epochs=10, lr=3e-4, gamma=0.99,
           gae_lambda=0.95, clip=0.2, ent_coef=0.0); --total-timesteps
           (default 200k) only sets when it stops.
A run is stopped by the callback after --time-cap seconds (default 300).
"""

import argparse
import collections
import json
import platform
import sys
import time

import gymnasium as gym
import numpy as np
import torch
import stable_baselines3 as sb3
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.monitor import Monitor


def linear(initial):
    # RL-Zoo "lin_X": X * progress_remaining (1 -> 0 over training)
    def f(progress_remaining):
        return progress_remaining * initial

    return f


class BenchCallback(BaseCallback):
    def __init__(self, threshold=475.0, window=20, time_cap=300.0, stop_at_target=False):
        super().__init__()
        self.stop_at_target = stop_at_target
        self.threshold = threshold
        self.window = window
        self.time_cap = time_cap
        self.returns = collections.deque(maxlen=window)
        self.n_episodes = 0
        self.hit_s = None
        self.hit_steps = None
        self.capped = False
        self.t0 = None
        self.t_end = None

    def _on_training_start(self):
        self.t0 = time.perf_counter()

    def _on_step(self):
        now = time.perf_counter() - self.t0
        for info in self.locals["infos"]:
            ep = info.get("episode")
            if ep is None:
                continue
            self.returns.append(float(ep["r"]))
            self.n_episodes += 1
            if self.hit_s is None and len(self.returns) == self.window and np.mean(self.returns) >= self.threshold:
                self.hit_s = now
                self.hit_steps = int(self.num_timesteps)
                if self.stop_at_target:
                    return False
        if now > self.time_cap:
            self.capped = True
            return False
        return True

    def _on_training_end(self):
        self.t_end = time.perf_counter()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", choices=["zoo", "default"], required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", default="1", help="'1' -> torch.set_num_threads(1); 'default' -> leave torch default")
    p.add_argument("--n-envs", type=int, default=None)
    p.add_argument("--total-timesteps", type=int, default=None)
    p.add_argument("--time-cap", type=float, default=300.0)
    p.add_argument(
        "--stop-at-target",
        action="store_true",
        help="end learn() as soon as mean(last 20) >= 475 (whole-command timing)",
    )
    args = p.parse_args()

    if args.threads != "default":
        torch.set_num_threads(int(args.threads))
    threads = torch.get_num_threads()

    t_setup = time.perf_counter()
    if args.config == "zoo":
        n_envs = args.n_envs or 8
        total = args.total_timesteps or 100_000
        env = make_vec_env("CartPole-v1", n_envs=n_envs, seed=args.seed)
        model = PPO(
            "MlpPolicy",
            env,
            n_steps=32,
            batch_size=256,
            gae_lambda=0.8,
            gamma=0.98,
            n_epochs=20,
            ent_coef=0.0,
            learning_rate=linear(0.001),
            clip_range=linear(0.2),
            seed=args.seed,
            device="cpu",
            verbose=0,
        )
    else:
        n_envs = args.n_envs or 1
        total = args.total_timesteps or 200_000
        env = make_vec_env("CartPole-v1", n_envs=n_envs, seed=args.seed)
        model = PPO("MlpPolicy", env, seed=args.seed, device="cpu", verbose=0)
    setup_s = time.perf_counter() - t_setup

    cb = BenchCallback(time_cap=args.time_cap, stop_at_target=args.stop_at_target)
    model.learn(total_timesteps=total, callback=cb)
    train_s = cb.t_end - cb.t0
    steps = int(model.num_timesteps)

    if args.stop_at_target:
        print(json.dumps({"hit_s": cb.hit_s, "hit_steps": cb.hit_steps, "setup_s": round(setup_s, 2)}), flush=True)
        return
    eval_env = Monitor(gym.make("CartPole-v1"))
    eval_env.reset(seed=10_000 + args.seed)
    t_eval = time.perf_counter()
    mean_r, std_r = evaluate_policy(model, eval_env, n_eval_episodes=10, deterministic=True)
    eval_s = time.perf_counter() - t_eval

    out = {
        "impl": "sb3",
        "config": args.config,
        "seed": args.seed,
        "threads": threads,
        "n_envs": n_envs,
        "total_timesteps_target": total,
        "env_steps": steps,
        "hit_s": None if cb.hit_s is None else round(cb.hit_s, 2),
        "hit_steps": cb.hit_steps,
        "sps": round(steps / train_s, 1),
        "train_s": round(train_s, 2),
        "setup_s": round(setup_s, 2),
        "eval_s": round(eval_s, 2),
        "episodes": cb.n_episodes,
        "last20_mean": round(float(np.mean(cb.returns)), 1) if cb.returns else None,
        "final_eval_mean": round(float(mean_r), 1),
        "final_eval_std": round(float(std_r), 1),
        "capped": cb.capped,
        "versions": {
            "python": platform.python_version(),
            "sb3": sb3.__version__,
            "torch": torch.__version__,
            "gymnasium": gym.__version__,
            "numpy": np.__version__,
        },
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
