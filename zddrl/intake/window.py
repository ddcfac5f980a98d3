"""The credit window of a consumer of a run's async stream (a learner shard, a replay service): how much it asks for."""

from __future__ import annotations

import math

from zddrl.config import Config


def stream_window(config: Config, consumers: int = 1) -> int:
    """The credit window of one of ``consumers`` sharing a run's async stream (learner shards, replay services):
    about one batch of rollouts in all. Every rollout queued ahead of the update is acted by a policy a version
    older by the time it is trained on, so a deep queue is stale data (docs/benchmarks.md, the replay service)."""
    per_batch = math.ceil(config.algo.batch_size / (config.env.rollout_len * config.env.num_envs))
    return math.ceil(per_batch / consumers) + 1
