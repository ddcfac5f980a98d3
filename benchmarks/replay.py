"""`python -m benchmarks replay`: insert and sample throughput of the learner-local prioritized replay buffer (and, with
``--service``, of a replay service on the bus: bench/replay_service.py).

For each workload (CartPole-sized 4 x float32 observations; Atari's 4x84x84 uint8 frames) one
``algos.replay_buffer.prioritized.PrioritizedReplay`` is built at ``--capacity`` (10^6), or at the largest round
capacity whose bytes fit in ``--memory-fraction`` of the memory available now, whichever is
smaller (the row says which and why: 10^6 Atari frames are 28 GB). Then, in one process:

* **fill**: rollouts inserted into the empty buffer until it is full (the first touch of every page
  is in this figure);
* **insert**: rollouts inserted into the full buffer for ``--seconds`` (every insert overwrites the
  oldest block: the steady state of a long run);
* **sample**: ``sample(256)`` for ``--seconds``, the buffer full;
* **sample+update**: ``sample(256)`` and ``update_priorities`` of the batch, a learner's step without
  the network.

Rollouts are ``T x N = 32 x 8`` steps as an actor ships them, with rare episode ends (their final
observations included), so a block is 256 transitions and 8 observation-only slots. Throughputs are
transitions per second. Bytes: ``nbytes`` over the capacity (a slot), over the transitions a full
buffer holds (a transition: the observation-only slots included), next to the bare minimum of a
transition sharing its next observation (``obs + action + 4 B reward + 1 B done``) and a plain
``(s, a, r, s', done)`` row.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import click
import numpy as np

from benchmarks.replay_learners import bench_learners, format_learner_rows
from zddrl.algos.replay_buffer.prioritized import PrioritizedReplay, available_memory, replay_nbytes

WORKLOADS: dict[str, tuple[tuple[int, ...], Any]] = {"cartpole": ((4,), np.float32), "atari": ((4, 84, 84), np.uint8)}
ACTION_DTYPE = np.int64
"""The wire's discrete actions."""
BATCH, T_STEPS, N_ENVS = 256, 32, 8
TARGET_CAPACITY = 10**6
P_END = 0.002
"""Chance that an episode terminates (and, apart, is truncated) after a step: CartPole's 500-step limit."""


def fitting_capacity(requested: int, obs_shape: tuple[int, ...], obs_dtype: Any, budget: float) -> tuple[int, str]:
    """``requested``, or the largest capacity with two significant digits whose bytes fit ``budget``; and why."""
    if replay_nbytes(requested, obs_shape, obs_dtype, (), ACTION_DTYPE) <= budget:
        return requested, ""
    per_slot = replay_nbytes(requested, obs_shape, obs_dtype, (), ACTION_DTYPE) / requested
    fit = int(budget / per_slot)
    step = 10 ** max(0, len(str(fit)) - 2)
    capacity = fit // step * step
    while capacity > step and replay_nbytes(capacity, obs_shape, obs_dtype, (), ACTION_DTYPE) > budget:
        capacity -= step
    need = replay_nbytes(requested, obs_shape, obs_dtype, (), ACTION_DTYPE)
    return capacity, (
        f"capacity {requested:,} would need {need / 2**30:.1f} GiB; {capacity:,} is the largest round one within "
        f"{budget / 2**30:.1f} GiB"
    )


def rollouts_of(
    obs_shape: tuple[int, ...], obs_dtype: Any, count: int = 2, seed: int = 0
) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    T, N = T_STEPS, N_ENVS
    out = []
    for _ in range(count):
        terminated, truncated = rng.random((T, N)) < P_END, rng.random((T, N)) < P_END
        trunc_idx = np.flatnonzero(truncated & ~terminated)
        if np.issubdtype(obs_dtype, np.integer):
            obs = rng.integers(0, 256, (T * N + N + len(trunc_idx), *obs_shape), dtype=np.uint8).astype(obs_dtype)
        else:
            obs = rng.standard_normal((T * N + N + len(trunc_idx), *obs_shape)).astype(obs_dtype)
        out.append(
            {
                "obs": obs[: T * N].reshape(T, N, *obs_shape),
                "actions": rng.integers(0, 2, (T, N), dtype=ACTION_DTYPE),
                "rewards": np.ones((T, N), np.float32),
                "terminated": terminated,
                "truncated": truncated,
                "next_obs": obs[T * N : T * N + N],
                "trunc_idx": trunc_idx,
                "trunc_obs": obs[T * N + N :],
            }
        )
    return out


def _rate(step: Callable[[], int], seconds: float, min_calls: int = 3) -> float:
    """Items per second of ``step`` (which returns how many it handled), repeated for about ``seconds``."""
    done, calls, t0 = 0, 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - t0 < seconds:
        done += step()
        calls += 1
    return done / (time.perf_counter() - t0)


def bench_workload(name: str, capacity: int, seconds: float, budget: float, seed: int = 0) -> dict[str, Any]:
    """One workload's row (module docstring)."""
    obs_shape, obs_dtype = WORKLOADS[name]
    used, note = fitting_capacity(capacity, obs_shape, obs_dtype, budget)
    buf = PrioritizedReplay(used, obs_shape, obs_dtype, (), ACTION_DTYPE, n_step=3, seed=seed, memory_fraction=1.0)
    pool = rollouts_of(obs_shape, obs_dtype, seed=seed)
    count = 0

    def insert() -> int:
        nonlocal count
        arrays = pool[count % len(pool)]
        count += 1
        buf.insert_arrays(arrays, version=count)
        return arrays["rewards"].size

    t0 = time.perf_counter()
    filled = 0
    while buf.written < used:
        filled += insert()
    fill_s = time.perf_counter() - t0
    td = np.random.default_rng(seed).standard_normal(BATCH)

    def sample_update() -> int:
        batch = buf.sample(BATCH)
        buf.update_priorities(batch.ids, td)
        return BATCH

    rates = {
        "insert_per_s": _rate(insert, seconds),
        "sample_per_s": _rate(lambda: len(buf.sample(BATCH).ids), seconds),
        "sample_update_per_s": _rate(sample_update, seconds),
    }
    obs_bytes = int(np.prod(obs_shape)) * np.dtype(obs_dtype).itemsize
    action_bytes = np.dtype(ACTION_DTYPE).itemsize
    transitions_when_full = used * (T_STEPS * N_ENVS) / (T_STEPS * N_ENVS + N_ENVS)
    return {
        "workload": name,
        "obs_shape": list(obs_shape),
        "obs_dtype": np.dtype(obs_dtype).name,
        "capacity_requested": capacity,
        "capacity": used,
        "capacity_note": note,
        "nbytes": buf.nbytes,
        "bytes_per_slot": round(buf.nbytes / used, 1),
        "bytes_per_transition": round(buf.nbytes / transitions_when_full, 1),
        "bare_min_bytes": obs_bytes + action_bytes + 4 + 1,
        "naive_bytes": 2 * obs_bytes + action_bytes + 4 + 1,
        "fill_s": round(fill_s, 2),
        "fill_per_s": round(filled / fill_s),
        **{k: round(v) for k, v in rates.items()},
        "held": len(buf),
    }


def format_rows(rows: list[dict[str, Any]]) -> str:
    header = ["workload", "capacity", "GiB", "B/slot", "B/trans", "bare min", "naive", "fill/s", "insert/s", "sample/s"]
    header.append("smp+upd/s")
    body = [
        [
            r["workload"],
            f"{r['capacity']:,}",
            f"{r['nbytes'] / 2**30:.2f}",
            f"{r['bytes_per_slot']:,.0f}",
            f"{r['bytes_per_transition']:,.0f}",
            f"{r['bare_min_bytes']:,}",
            f"{r['naive_bytes']:,}",
            f"{r['fill_per_s']:,}",
            f"{r['insert_per_s']:,}",
            f"{r['sample_per_s']:,}",
            f"{r['sample_update_per_s']:,}",
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *body]]
    return "\n".join(lines + [f"note: {r['workload']}: {r['capacity_note']}" for r in rows if r["capacity_note"]])


@click.command("replay")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--capacity", type=click.IntRange(1000), default=TARGET_CAPACITY, show_default=True)
@click.option("--workloads", default="cartpole,atari", show_default=True, help="Comma-separated: cartpole, atari.")
@click.option("--seconds", type=click.FloatRange(0.01), default=3.0, show_default=True, help="Timed window per figure.")
@click.option(
    "--memory-fraction",
    type=click.FloatRange(0.01, 0.95),
    default=0.5,
    show_default=True,
    help="Share of the available memory one buffer may take (a smaller capacity is used, and said, beyond it).",
)
@click.option(
    "--learner-threads",
    default="1,2",
    show_default=True,
    help="Torch threads to time the apex and sac learner cores with ('' skips them).",
)
@click.option(
    "--service",
    is_flag=True,
    help="Also time a `zddrl replay` service (real broker and replay processes; bench/replay_service.py).",
)
@click.option(
    "--service-capacity",
    type=click.IntRange(1000),
    default=100_000,
    show_default=True,
    help="The service's buffer (its throughput hardly depends on it; 10^5 Atari frames are 2.8 GB).",
)
def replay(
    as_json: bool,
    capacity: int,
    workloads: str,
    seconds: float,
    memory_fraction: float,
    learner_threads: str,
    service: bool,
    service_capacity: int,
) -> None:
    """Insert and sample throughput of the local prioritized replay buffer (and, with --service, of a replay
    service on the bus), its bytes per transition, and the gradient steps/s of the apex and sac learner cores."""
    names = [w.strip() for w in workloads.split(",") if w.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise click.BadParameter(f"unknown workloads {unknown}; known: {sorted(WORKLOADS)}", param_hint="--workloads")
    rows = []
    for name in names:  # one buffer at a time: each is freed before the next is built
        rows.append(bench_workload(name, capacity, seconds, memory_fraction * available_memory()))
    services = []
    if service:
        from benchmarks.replay_service import bench_service

        for name in names:
            services.append(bench_service(name, service_capacity, seconds))
            local = next(r for r in rows if r["workload"] == name)
            for key in ("insert_per_s", "sample_per_s", "sample_update_per_s"):
                services[-1][f"{key}_vs_local"] = round(services[-1][key] / max(local[key], 1), 3)
    threads = [int(t) for t in learner_threads.split(",") if t.strip()]
    learners = bench_learners(threads, seconds) if threads else []
    if as_json:
        report = {"bench": "replay", "batch": BATCH, "rollout": {"T": T_STEPS, "N": N_ENVS}, "results": rows}
        click.echo(json.dumps({**report, "service": services, "learners": learners}))
        return
    click.echo(format_rows(rows))
    for s in services:
        click.echo(
            f"service {s['workload']}: insert {s['insert_per_s']:,}/s ({s['insert_per_s_vs_local']}x local), sample "
            f"{s['sample_per_s']:,}/s ({s['sample_per_s_vs_local']}x), sample+update {s['sample_update_per_s']:,}/s "
            f"({s['sample_update_per_s_vs_local']}x)"
        )
    if learners:
        click.echo("\n" + format_learner_rows(learners))
