#!/usr/bin/env python
"""Anchor benchmark: Stable-Baselines3 DQN on CartPole-v1 or SAC on Pendulum-v1 (CPU), RL-Zoo settings.

Measures the first time the target is reached: seconds from the start of learn() and total env steps; with
--stop-at-target learning ends there, so the whole process time is the time to solve.
  dqn: greedy evaluation (10 deterministic episodes on a separate env every --eval-every steps, default
       5000) reaches 475. Training-episode returns include epsilon-greedy exploration, so they are not the
       target (with RL-Zoo settings the last-20 training mean stayed at 22-408 through 150k steps).
  sac: the running mean of the last 20 finished training episodes reaches -200.
Prints one JSON line.

RL-Zoo settings (hyperparams/dqn.yml, sac.yml):
  dqn  CartPole-v1: lr 2.3e-3, batch 64, buffer 1e5, learning_starts 1000, gamma 0.99,
       target_update_interval 10, train_freq 256, gradient_steps 128, exploration_fraction 0.16,
       exploration_final_eps 0.04, net_arch [256, 256], 5e4 steps.
  sac  Pendulum-v1: lr 1e-3, defaults otherwise, 2e4 steps.
"""

import argparse
import collections
import json
import time

import numpy as np
import torch
from stable_baselines3 import DQN, SAC
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy


class Target(BaseCallback):
    def __init__(self, target, stop, eval_env=None, eval_every=0):
        super().__init__()
        self.target, self.stop = target, stop
        self.eval_env, self.eval_every, self.next_eval = eval_env, eval_every, eval_every
        self.evals = []
        self.returns = collections.deque(maxlen=20)
        self.hit_s = self.hit_steps = None

    def _on_training_start(self):
        self.t0 = time.perf_counter()

    def _hit(self):
        self.hit_s = time.perf_counter() - self.t0
        self.hit_steps = int(self.num_timesteps)
        return not self.stop

    def _on_step(self):
        if self.eval_env is not None:
            if self.hit_s is None and self.num_timesteps >= self.next_eval:
                self.next_eval += self.eval_every
                mean, _ = evaluate_policy(self.model, self.eval_env, n_eval_episodes=10, deterministic=True)
                self.evals.append((int(self.num_timesteps), float(mean)))
                if mean >= self.target:
                    return self._hit()
            for info in self.locals["infos"]:
                if info.get("episode") is not None:
                    self.returns.append(float(info["episode"]["r"]))
            return True
        for info in self.locals["infos"]:
            ep = info.get("episode")
            if ep is not None:
                self.returns.append(float(ep["r"]))
                if self.hit_s is None and len(self.returns) == 20 and np.mean(self.returns) >= self.target:
                    if not self._hit():
                        return False
        return True


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--algo", choices=["dqn", "sac"], required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--stop-at-target", action="store_true")
    p.add_argument("--total-timesteps", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=5000, help="dqn: steps between greedy evaluations")
    a = p.parse_args()
    torch.set_num_threads(1)
    t_setup = time.perf_counter()
    if a.algo == "dqn":
        env = make_vec_env("CartPole-v1", n_envs=1, seed=a.seed)
        model = DQN(
            "MlpPolicy",
            env,
            learning_rate=2.3e-3,
            batch_size=64,
            buffer_size=100_000,
            learning_starts=1000,
            gamma=0.99,
            target_update_interval=10,
            train_freq=256,
            gradient_steps=128,
            exploration_fraction=0.16,
            exploration_final_eps=0.04,
            policy_kwargs=dict(net_arch=[256, 256]),
            seed=a.seed,
            device="cpu",
        )
        target, total = 475.0, a.total_timesteps or 50_000
    else:
        env = make_vec_env("Pendulum-v1", n_envs=1, seed=a.seed)
        model = SAC("MlpPolicy", env, learning_rate=1e-3, seed=a.seed, device="cpu")
        target, total = -200.0, a.total_timesteps or 20_000
    setup_s = time.perf_counter() - t_setup
    eval_env = make_vec_env("CartPole-v1", n_envs=1, seed=10_000 + a.seed) if a.algo == "dqn" else None
    cb = Target(target, a.stop_at_target, eval_env, a.eval_every if a.algo == "dqn" else 0)
    model.learn(total_timesteps=total, callback=cb)
    print(
        json.dumps(
            {
                "impl": "sb3",
                "algo": a.algo,
                "seed": a.seed,
                "target": target,
                "hit_s": cb.hit_s,
                "hit_steps": cb.hit_steps,
                "env_steps": int(model.num_timesteps),
                "last20_mean": float(np.mean(cb.returns)) if cb.returns else None,
                "evals": cb.evals,
                "setup_s": round(setup_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
