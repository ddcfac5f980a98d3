"""One learner shard for the equivalence tests: trains on its share of fixed data, saves its parameters.

``python tests/shards/shard_worker.py MODE OUT`` with torchrun's variables set (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) runs one shard of a gloo group; without them, one learner on all data.
Every update has one trajectory from each of four actors (two from actor a in two updates); the
shards split them differently each update, mostly unevenly: the reward scaler's streams move between
shards, peer_id a's two trajectories of one update are trained on different shards, and shard 1 has
nothing at all in the last update.
"""

from __future__ import annotations

import sys

import numpy as np

from zddrl import protocol as P
from zddrl.algos.impala.learner import ImpalaLearner
from zddrl.algos.ppo.learner import PPOLearner
from zddrl.config import Config, run_kind
from zddrl.envs import EnvSpec
from zddrl.shards.group import ShardGroup
from zddrl.shards.launch import DevicePlan

SPEC = EnvSpec((4,), True, 2)
SENDERS = ("a", "b", "c", "d")
BATCHES = (("a", "b", "c", "d"), ("a", "a2", "b", "c", "d"), ("a", "a2", "b", "c", "d"), ("a", "b", "c", "d"))
"""Trajectories of each update: one per peer_id, and in two updates a second one of peer_id a ("a2")."""
SPLITS = (("a", "b"), ("a", "b"), ("a2", "c", "d"), SENDERS)
"""Shard 0's trajectories in each update (shard 1 takes the rest): even, uneven both ways with peer_id a's
two trajectories on different shards, all (shard 1 idle)."""
UPDATES = len(SPLITS)


def config(mode: str) -> Config:
    return Config().replace(
        {
            **run_kind(mode),
            "algo.epochs": 3,
            "algo.minibatches": 1,
            "algo.normalize_obs": True,
            "algo.normalize_reward": True,
            "algo.lr": 3e-3,
            "algo.ent_coef": 0.01,
        }
    )


def trajectory(name: str, update: int, T: int = 8, N: int = 3) -> P.Trajectory:
    peer_id, second = name[0], name.endswith("2")
    rng = np.random.default_rng(1000 * update + 10 * second + SENDERS.index(peer_id))
    terminated = rng.random((T, N)) < 0.1
    truncated = (rng.random((T, N)) < 0.05) & ~terminated
    trunc_idx = np.flatnonzero(truncated.reshape(-1))
    arrays = {
        "obs": rng.normal(1.0, 2.0, (T, N, 4)).astype(np.float32),
        "actions": rng.integers(0, 2, (T, N)),
        "logp": rng.uniform(-1.2, -0.3, (T, N)).astype(np.float32),
        "values": rng.normal(0, 1, (T, N)).astype(np.float32),
        "rewards": rng.normal(1, 1, (T, N)).astype(np.float32),
        "terminated": terminated,
        "truncated": truncated,
        "next_obs": rng.normal(0, 1, (N, 4)).astype(np.float32),
        "next_value": rng.normal(0, 1, N).astype(np.float32),
    }
    if len(trunc_idx):  # on the wire only when some episode was truncated (docs/protocol.md section 7)
        arrays.update(
            trunc_idx=trunc_idx,
            trunc_obs=rng.normal(0, 1, (len(trunc_idx), 4)).astype(np.float32),
            trunc_value=rng.normal(0, 1, len(trunc_idx)).astype(np.float32),
        )
    return P.Trajectory(
        run_id="r",
        peer_id=peer_id,
        seq=2 * update + second,
        policy_version=max(0, update - 1),
        param_hash="",
        env_steps=T * N,
        arrays=arrays,
    )


def exchanges(group: ShardGroup) -> list:
    """What ``ShardGroup.exchange`` returns for payloads that fit its first all-gather, that do not, and a mix."""
    small = {"records": [{"peer_id": "actor-0", "seq": group.rank}], "stop": False}
    big = {"blob": bytes([group.rank]) * (10_000 * (group.rank + 1))}
    return [
        group.exchange(small),
        group.exchange(big),
        group.exchange(small if group.rank else big),
        group.exchange(None),
    ]


def main(mode: str, out: str) -> None:
    group = ShardGroup.from_env(DevicePlan(("cpu",) * 2), timeout_s=60)
    if mode == "exchange":
        np.save(out, np.array(repr(exchanges(group))))
        group.close()
        return
    cls = ImpalaLearner if mode == "impala" else PPOLearner
    core = cls(config(mode), SPEC, group)
    for update in range(UPDATES):
        mine = [n for n in BATCHES[update] if not group.sharded or (n in SPLITS[update]) == (group.rank == 0)]
        core.update([trajectory(n, update) for n in mine], staleness=0.5 * update)
    flat, _, extra = core.params()
    np.savez(
        out,
        flat=flat,
        **extra,
        reward_var=np.array(core.reward_scaler.rms.var),
        returns_a=core.reward_scaler.returns["a"],
    )
    group.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
