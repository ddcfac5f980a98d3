"""An env class of one's own, defined in this script (or a notebook cell), trained with ``zddrl.train``.

    python examples/plugins/custom_env.py [RUN_DIR]

No module to install and no id to register: ``zddrl.train`` pickles the class by value into the run directory and
the learner and actors it starts on this machine build the env from that file (docs/extending.md).
"""

import sys

import gymnasium as gym
import numpy as np

import zddrl


class GoToZero(gym.Env):
    """Move a point on a line to 0: observation its position, actions left/stay/right, +10 on arrival, -0.1 a step."""

    def __init__(self, size: float = 5.0) -> None:
        self.size = size
        self.observation_space = gym.spaces.Box(-size, size, (1,), np.float32)
        self.action_space = gym.spaces.Discrete(3)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.x, self.t = float(self.np_random.uniform(-self.size, self.size)), 0
        return np.array([self.x], np.float32), {}

    def step(self, action):
        self.x = float(np.clip(self.x + (int(action) - 1) * 0.5, -self.size, self.size))
        self.t += 1
        arrived = abs(self.x) < 0.25
        return np.array([self.x], np.float32), 10.0 if arrived else -0.1, arrived, self.t >= 50, {}


if __name__ == "__main__":
    result = zddrl.train(
        env=GoToZero,
        run_dir=sys.argv[1] if len(sys.argv) > 1 else None,
        algo={"lr": 1e-3},
        train={"until_return": 9.0, "max_steps": 50_000, "max_seconds": 120},
    )
    print(f"reached {result.summary['reached']}, return {result.summary['return_mean_20']}, in {result.run_dir}")
    print("from +3 the policy moves", ["left", "nowhere", "right"][int(result.policy.act(np.array([3.0])))])
