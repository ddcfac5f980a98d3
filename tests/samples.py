"""Valid messages to build tests on, shared by the test folders (tests/ is on sys.path through conftest.py)."""

from __future__ import annotations

import numpy as np

from zddrl import protocol as P


def traj_arrays(
    T: int = 2, N: int = 2, obs_shape: tuple = (3,), discrete: bool = True, K: int = 0, seed: int = 0
) -> dict[str, np.ndarray]:
    """A valid trajectory's arrays (docs/protocol.md section 7); ``K`` truncations if K > 0."""
    rng = np.random.default_rng(seed)
    f32 = np.float32
    arrays = {
        "obs": rng.standard_normal((T, N, *obs_shape)).astype(f32),
        "actions": rng.integers(0, 2, (T, N), dtype=np.int64)
        if discrete
        else rng.standard_normal((T, N, 2)).astype(f32),
        "logp": rng.standard_normal((T, N)).astype(f32),
        "values": rng.standard_normal((T, N)).astype(f32),
        "rewards": np.ones((T, N), f32),
        "terminated": rng.random((T, N)) < 0.2,
        "truncated": np.zeros((T, N), bool),
        "next_obs": rng.standard_normal((N, *obs_shape)).astype(f32),
        "next_value": rng.standard_normal(N).astype(f32),
    }
    if K:
        arrays.update(
            trunc_idx=np.arange(K, dtype=np.int64),
            trunc_obs=rng.standard_normal((K, *obs_shape)).astype(f32),
            trunc_value=rng.standard_normal(K).astype(f32),
        )
    return arrays


def traj(arrays=None, **kw) -> P.Trajectory:
    """A trajectory: a valid one unless ``arrays`` (or a field) says otherwise."""
    arrays = traj_arrays() if arrays is None else arrays
    steps = arrays["rewards"].size if "rewards" in arrays else 0
    fields = dict(
        run_id="r-1",
        peer_id="actor-0",
        seq=3,
        policy_version=2,
        param_hash="0123456789abcdef",
        env_steps=steps,
        arrays=arrays,
        info={"actor_id": 0, "num_envs": 2, "total_env_steps": 8},
    )
    return P.Trajectory(**{**fields, **kw})


def cartpole_trajectory(T: int, N: int, peer_id: str = "a", seq: int = 0, **declared: np.ndarray) -> P.Trajectory:
    """A CartPole-shaped ([T, N, 4] observations, actions 0/1) trajectory, env 0 truncated at step 1, with the run's
    ``declared`` arrays (docs/protocol.md section 7.1)."""
    rng = np.random.default_rng(seq)
    truncated = np.zeros((T, N), dtype=bool)
    truncated[1, 0] = True
    arrays = {
        "obs": rng.standard_normal((T, N, 4)).astype(np.float32),
        "actions": rng.integers(0, 2, (T, N)),
        "logp": np.full((T, N), -0.69, np.float32),
        "values": np.zeros((T, N), np.float32),
        "rewards": np.ones((T, N), np.float32),
        "terminated": np.zeros((T, N), bool),
        "truncated": truncated,
        "next_obs": np.zeros((N, 4), np.float32),
        "next_value": np.zeros(N, np.float32),
        "trunc_idx": np.array([1 * N + 0]),
        "trunc_obs": np.zeros((1, 4), np.float32),
        "trunc_value": np.array([10.0], np.float32),
        **declared,
    }
    return P.Trajectory(
        run_id="r", peer_id=peer_id, seq=seq, policy_version=0, param_hash="", env_steps=T * N, arrays=arrays
    )


def pixel_trajectory(spec, T: int, N: int, seq: int = 0) -> P.Trajectory:
    """A rollout of ``T`` steps of ``N`` envs of the pixel env ``spec`` (an EnvSpec: uint8 frames, discrete)."""
    rng = np.random.default_rng(seq)
    terminated = np.zeros((T, N), dtype=bool)
    terminated[T // 2, 0] = True
    arrays = {
        "obs": rng.integers(0, 256, (T, N, *spec.obs_shape), dtype=np.uint8),
        "actions": rng.integers(0, spec.action_dim, (T, N)),
        "logp": np.full((T, N), -np.log(spec.action_dim), np.float32),
        "values": np.zeros((T, N), np.float32),
        "rewards": rng.integers(0, 2, (T, N)).astype(np.float32),
        "terminated": terminated,
        "truncated": np.zeros((T, N), bool),
        "next_obs": rng.integers(0, 256, (N, *spec.obs_shape), dtype=np.uint8),
        "next_value": np.zeros(N, np.float32),
    }
    return P.Trajectory(
        run_id="r", peer_id="a", seq=seq, policy_version=0, param_hash="", env_steps=T * N, arrays=arrays
    )


def rollout_of(
    peer: str,
    seq: int,
    version: int,
    T: int = 4,
    N: int = 1,
    logp: float = -0.69,
    trunc_at: tuple[int, int] | None = None,
    ep_returns: tuple[float, ...] = (),
) -> P.Trajectory:
    """A CartPole-shaped rollout of ``T`` steps of ``N`` envs from ``peer`` acting with ``version``: observations
    and actions drawn from a generator seeded with ``seq``, behaviour log-probabilities ``logp``, env
    ``trunc_at[1]`` truncated at step ``trunc_at[0]`` if given, ``ep_returns`` (episodes of length 10) ended."""
    rng = np.random.default_rng(seq)
    truncated = np.zeros((T, N), dtype=bool)
    trunc_idx = np.zeros(0, dtype=np.int64)
    if trunc_at is not None:
        truncated[trunc_at] = True
        trunc_idx = np.array([trunc_at[0] * N + trunc_at[1]])
    arrays = {
        "obs": rng.standard_normal((T, N, 4)).astype(np.float32),
        "actions": rng.integers(0, 2, (T, N)),
        "logp": np.full((T, N), logp, np.float32),
        "values": np.zeros((T, N), np.float32),
        "rewards": np.ones((T, N), np.float32),
        "terminated": np.zeros((T, N), bool),
        "truncated": truncated,
        "next_obs": np.zeros((N, 4), np.float32),
        "next_value": np.zeros(N, np.float32),
    }
    if len(trunc_idx):
        arrays.update(
            trunc_idx=trunc_idx,
            trunc_obs=np.full((len(trunc_idx), 4), float(seq), np.float32),
            trunc_value=np.zeros(len(trunc_idx), np.float32),
        )
    return P.Trajectory(
        run_id="r",
        peer_id=peer,
        seq=seq,
        policy_version=version,
        param_hash="",
        env_steps=T * N,
        arrays=arrays,
        info={"total_env_steps": (seq + 1) * T * N},
        ep_returns=list(ep_returns),
        ep_lengths=[10] * len(ep_returns),
    )
