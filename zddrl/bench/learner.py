"""`zddrl bench learner`: learner throughput with 1 and N shards, and parameter broadcast at scale.

Throughput: each configuration runs as real shard processes (gloo on the CPU, the same
``ShardGroup`` and cores the learner uses) that train on fixed synthetic CartPole-shaped
trajectories; the global batch is the same whatever the shard count. Reported: samples
trained per second of update time, and the share of it spent in collectives (all-reduce and
exchange). A 1-shard run with as many torch threads as the N-shard run has cores is printed too:
shards are one way to use cores, threads another.

Broadcast: a ~10M-parameter ActorCritic's flat buffer is published through a real broker to 1
and 4 subscribing actor links (BrokerLink: chunk and whole-buffer hashes verified) in 4 MiB
chunks, in float32 and in bfloat16; time from the first send to the last subscriber holding the
verified version. Beside it, in the same run: pickle round trip (dumps + loads) of the same
state dict, in this process only (zddrl never unpickles what came off a socket).
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np
from loguru import logger

from zddrl import protocol as P
from zddrl.bench import common as C
from zddrl.bench.broadcast import BenchPublisher
from zddrl.bench.learner_profile import format_profile, profile_updates
from zddrl.config import AUTOCASTS, Config, ConfigError, kind_label, load_config, run_kind
from zddrl.learner.runlog import describe_hardware, hardware
from zddrl.proc import free_ports
from zddrl.shards.launch import DevicePlan, Rendezvous, plan_devices, shard_environments

if TYPE_CHECKING:
    from zddrl.envs import EnvSpec

BROADCAST_REPS = 9
BROADCAST_TIMEOUT_S = 60.0
BIG_MODEL: dict[str, Any] = {"obs_dim": 64, "hidden": [2240, 2240], "actions": 4}
"""An ActorCritic of ~10.4M parameters (two 2240-wide MLPs on 64-dim observations)."""


# --------------------------------------------------------------------------------------------
# Throughput: one shard process (run as `python -m zddrl.bench.learner SPEC_JSON OUT`)
# --------------------------------------------------------------------------------------------


def _cartpole() -> EnvSpec:
    from zddrl.envs import EnvSpec

    return EnvSpec((4,), True, 2)


def _synthetic(actor: int, update: int, T: int, N: int, spec: EnvSpec | None = None) -> P.Trajectory:
    """A rollout of ``T`` steps of ``N`` envs shaped as ``spec`` says (CartPole's if None; random observations and
    actions)."""
    spec = spec or _cartpole()
    rng = np.random.default_rng(1000 * update + actor)
    terminated = rng.random((T, N)) < 0.02
    truncated = np.zeros((T, N), bool)

    def obs(*lead: int) -> np.ndarray:
        if spec.obs_dtype == "uint8":
            return rng.integers(0, 256, (*lead, *spec.obs_shape), dtype=np.uint8)
        return rng.normal(0, 1, (*lead, *spec.obs_shape)).astype(np.float32)

    actions = (
        rng.integers(0, spec.action_dim, (T, N))
        if spec.discrete
        else rng.uniform(-1, 1, (T, N, spec.action_dim)).astype(np.float32)
    )
    arrays: dict[str, np.ndarray]
    arrays = {
        "obs": obs(T, N),
        "actions": actions,
        "logp": np.full((T, N), -0.69, np.float32),
        "values": rng.normal(0, 1, (T, N)).astype(np.float32),
        "rewards": np.ones((T, N), np.float32),
        "terminated": terminated,
        "truncated": truncated,
        "next_obs": obs(N),
        "next_value": np.zeros(N, np.float32),
    }
    return P.Trajectory(
        run_id="bench",
        peer_id=f"actor-{actor}",
        seq=update,
        policy_version=update,
        param_hash="",
        env_steps=T * N,
        arrays=arrays,
    )


def shard_main(spec: dict[str, Any], out: str) -> None:
    """Train ``spec["updates"]`` timed updates on this shard's share of every batch; rank 0 writes the figures.
    With ``spec["config"]`` the run's model, algorithm and batch on rollouts shaped as its env's (probed here)."""
    from zddrl.algos.spec import algorithm_of
    from zddrl.shards.group import ShardGroup

    group = ShardGroup.from_env(DevicePlan(tuple(spec["devices"])), timeout_s=120)
    config, env_spec, T, N, actors = _workload(spec)
    core = algorithm_of(config).learner(config, env_spec, group)
    mine = [s for s in range(actors) if s % group.world_size == group.rank]
    data = [[_synthetic(s, u, T, N, env_spec) for s in mine] for u in range(spec["updates"] + 1)]
    core.update(data[0])  # warm-up: allocations, first collectives
    comm0, t0 = group.comm_s, time.perf_counter()
    for batch in data[1:]:
        core.update(batch)
    wall = time.perf_counter() - t0
    profiled = profile_updates(core.update, data[1:], wall) if spec.get("profile") else None
    if group.is_main:
        figures: dict[str, Any] = {"wall_s": wall, "comm_s": group.comm_s - comm0, "samples_per_update": T * N * actors}
        figures |= {"profile": profiled} if profiled else {}
        figures |= {"autocast_choice": core.autocast._asdict()}
        Path(out).write_text(
            json.dumps(
                {**figures, "model": config.model.kind, "mode": kind_label(config.algo.name, config.algo.schedule)}
            )
        )
    group.close()


def _workload(spec: dict[str, Any]) -> tuple[Config, EnvSpec, int, int, int]:
    """(config, env spec, T, N, rollouts per update) of a throughput run: the file's, or CartPole with the options'."""
    from zddrl.envs import probe_spec

    autocast = {"learner.autocast": spec["autocast"], "learner.torch_threads": spec["threads"]}
    if spec.get("config"):
        config = load_config(spec["config"]).replace(autocast)
        T, N = config.env.rollout_len, config.env.num_envs
        return config, probe_spec(config.env), T, N, max(1, config.algo.batch_size // (T * N))
    config = Config().replace(
        {
            **run_kind(spec["mode"]),
            "algo.epochs": spec["epochs"],
            "algo.minibatches": spec["minibatches"],
            "model.hidden": spec["hidden"],
            **autocast,
        }
    )
    return config, _cartpole(), 32, 16, spec["batch"] // (32 * 16)


def run_throughput(devices: tuple[str, ...], threads: int, options: dict[str, Any]) -> dict[str, Any]:
    """One shard process per entry of ``devices`` ("cpu", "cuda:0", ...), each with ``threads`` torch threads.
    ``options``: ``updates``, ``autocast``, and ``config`` (a run config file) or ``mode``, ``epochs``,
    ``minibatches``, ``hidden``, ``batch`` (CartPole-shaped rollouts)."""
    shards = len(devices)
    spec = {**options, "threads": threads, "devices": list(devices)}
    envs = shard_environments(DevicePlan(devices), Rendezvous()) if shards > 1 else [dict(os.environ)]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "figures.json")
        procs = [
            subprocess.Popen([sys.executable, "-m", "zddrl.bench.learner", json.dumps(spec), out], env=env)
            for env in envs
        ]
        try:
            codes = [p.wait(timeout=900) for p in procs]
        finally:
            for p in procs:
                p.kill()
        if any(codes):
            raise click.ClickException(f"a benchmark shard failed (exit codes {codes})")
        figures = json.loads(Path(out).read_text())
    updates = options["updates"]
    row = {
        "config": options.get("config"),  # the run's own model and algorithm, else these options':
        **{k: None if options.get("config") else options.get(k) for k in ("hidden", "epochs", "minibatches")},
        "mode": figures["mode"],
        "model": figures["model"],
        "autocast": options["autocast"],
        "autocast_mode": figures["autocast_choice"]["mode"],
        "autocast_reason": figures["autocast_choice"]["reason"],
        "shards": shards,
        "device": devices[0],
        "threads_per_shard": threads,
        "batch": figures["samples_per_update"],
        "updates": updates,
        "samples_per_s": round(figures["samples_per_update"] * updates / figures["wall_s"], 1),
        "update_ms": round(1e3 * figures["wall_s"] / updates, 2),
        "collective_share": round(figures["comm_s"] / figures["wall_s"], 3),
    }
    if "profile" in figures:
        row["profile"] = figures["profile"]
    what = options.get("config") or f"hidden {options.get('hidden')}"
    logger.info(
        f"{shards} shard(s) on {devices[0]} x {threads} thread(s), {what}, autocast {options['autocast']} "
        f"({row['autocast_mode']}: {row['autocast_reason']}): "
        f"{row['samples_per_s']:.0f} samples/s, collectives {100 * row['collective_share']:.0f} %"
    )
    return row


# --------------------------------------------------------------------------------------------
# Broadcast of a ~10M-parameter model
# --------------------------------------------------------------------------------------------


def big_model(hidden: list[int]) -> tuple[np.ndarray, list, dict]:
    """The flat buffer, layout and state dict of a real ActorCritic (~10M parameters with the default
    2240x2240 on 64-dim observations)."""
    from zddrl.algos.model import ActorCritic, flatten_params
    from zddrl.config import ModelConfig
    from zddrl.envs import EnvSpec

    model = ActorCritic(EnvSpec((BIG_MODEL["obs_dim"],), True, BIG_MODEL["actions"]), ModelConfig(hidden=tuple(hidden)))
    flat, layout = flatten_params(model)
    return flat, layout, model.state_dict()


class ChunkPublisher(BenchPublisher):
    """The main learner shard's side of a broadcast (``bench bus``'s publisher, joined as the run's
    learner), sending a version as the learner does: ``params.split`` (chunks, hashes, precision)."""

    def publish(
        self, flat: np.ndarray, layout: list | None = None, dtype: str = "float32", chunk_bytes: int = 4 << 20
    ) -> float:
        """Split (hash, convert) and send version ``self.version``; returns the time the work started."""
        from zddrl.transport.params import split

        started = time.monotonic()
        for msg in split(
            run_id=self.run_id,
            peer_id=C.LEARNER_ID,
            version=self.version,
            flat=flat,
            layout=layout or [["w", "float32", [flat.size], 0]],
            chunk_bytes=chunk_bytes,
            dtype=dtype,
        ):
            self.sock.send_multipart(P.encode(msg), copy=False)
        return started


def run_broadcast(counts: list[int], dtypes: list[str], chunk_bytes: int, hidden: list[int]) -> tuple[list[dict], dict]:
    flat, layout, state = big_model(hidden)
    rows = []
    with C.Workers() as workers:
        ports = free_ports(4)
        workers.start("bcast-broker", C.broker_main, ports, C.DEFAULT_BROKER)
        slots = C.shared_slots(max(counts))
        pub = ChunkPublisher(f"tcp://127.0.0.1:{ports[0]}", ports[2])  # version 0: 16 zeros
        started = 0
        try:
            for count in sorted(counts):
                for index in range(started, count):
                    workers.start(f"subscriber-{index}", C.subscriber_main, f"tcp://127.0.0.1:{ports[0]}", index, slots)
                started = count
                pub.version += 1
                pub.publish(flat, layout, "float32", chunk_bytes)  # newcomers get it whole (snapshot)
                _wait(workers, slots, count, pub.version)
                for dtype in dtypes:
                    rows.append(_broadcast_row(workers, pub, slots, flat, layout, count, dtype, chunk_bytes))
        finally:
            pub.close()
    return rows, _pickle_row(state)


def _broadcast_row(
    workers: C.Workers,
    pub: ChunkPublisher,
    slots: Any,
    flat: np.ndarray,
    layout: list,
    count: int,
    dtype: str,
    chunk_bytes: int,
) -> dict[str, Any]:
    latencies = []
    for rep in range(BROADCAST_REPS + 1):  # the first warms the path and is not kept
        pub.version += 1
        flat[0] = pub.version  # every version has its own hashes
        sent = pub.publish(flat, layout, dtype, chunk_bytes)
        _wait(workers, slots, count, pub.version)
        if rep:
            latencies.append((max(slots[2 * i + 1] for i in range(count)) - sent) * 1e3)
    itemsize = 4 if dtype == "float32" else 2
    row = {
        "params": int(flat.size),
        "wire_bytes": int(flat.size * itemsize),
        "param_dtype": dtype,
        "chunks": -(-flat.size * itemsize // chunk_bytes),
        "subscribers": count,
        "latency_ms": round(statistics.median(latencies), 1),
        "min_ms": round(min(latencies), 1),
        "max_ms": round(max(latencies), 1),
        "reps": BROADCAST_REPS,
    }
    logger.info(f"broadcast {flat.size / 1e6:.1f}M params {dtype} to {count}: median {row['latency_ms']} ms")
    return row


def _wait(workers: C.Workers, slots: Any, count: int, version: int) -> None:
    workers.wait(
        lambda: all(slots[2 * i] >= version for i in range(count)),
        BROADCAST_TIMEOUT_S,
        f"{count} subscribers to hold parameters version {version}",
    )


def _pickle_row(state: dict) -> dict[str, Any]:
    """dumps + loads of the state dict, median of a few: the cost before any byte has moved."""
    times = []
    for _ in range(BROADCAST_REPS):
        t0 = time.perf_counter()
        pickle.loads(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
        times.append((time.perf_counter() - t0) * 1e3)
    return {"codec": "pickle state_dict dumps+loads (in process)", "ms": round(statistics.median(times), 1)}


# --------------------------------------------------------------------------------------------
# Report and command
# --------------------------------------------------------------------------------------------


def format_report(report: dict[str, Any]) -> str:
    lines = [
        "Learner throughput (samples trained per second of update time; same global batch; x base: against the "
        "first row of the same model and device: 1 shard, 1 thread, autocast off)",
        describe_hardware(report["hardware"]),
        f"{'model':>14} {'autocast':>8} {'device':>7} {'shards':>6} {'threads':>7} {'samples/s':>10} {'update ms':>9} "
        f"{'collectives':>11} {'x base':>9}",
    ]
    base = {}
    for r in report["throughput"]:
        name = r["model"] if r["config"] else "x".join(map(str, r["hidden"]))
        key = (name, r["device"])
        if r["shards"] == 1 and r["threads_per_shard"] == 1 and r["autocast"] == "off":
            base[key] = r["samples_per_s"]
        ratio = f"{r['samples_per_s'] / base[key]:>8.2f}x" if key in base else f"{'-':>9}"
        cast = r["autocast"] if r["autocast"] != "auto" else f"auto:{r.get('autocast_mode', '?')}"
        lines.append(
            f"{name:>14} {cast:>8} {r['device']:>7} {r['shards']:>6} {r['threads_per_shard']:>7} "
            f"{r['samples_per_s']:>10.0f} {r['update_ms']:>9.1f} {100 * r['collective_share']:>10.0f}% "
            f"{ratio}"
        )
        lines += format_profile(r) if "profile" in r else []
    lines += [
        f"autocast auto chose {r['autocast_mode']}: {r['autocast_reason']}"
        for r in report["throughput"]
        if r["autocast"] == "auto"
    ]
    if report["broadcast"]:
        lines += [
            "",
            f"Parameter broadcast, {report['broadcast'][0]['params'] / 1e6:.1f}M parameters, "
            "send -> last subscriber holds the verified version",
            f"{'dtype':>9} {'MB':>6} {'chunks':>6} {'subscribers':>11} {'median ms':>9} {'min':>6} {'max':>6}",
        ]
        for r in report["broadcast"]:
            lines.append(
                f"{r['param_dtype']:>9} {r['wire_bytes'] / 1e6:>6.1f} {r['chunks']:>6} {r['subscribers']:>11} "
                f"{r['latency_ms']:>9.1f} {r['min_ms']:>6.1f} {r['max_ms']:>6.1f}"
            )
        lines.append(f"{report['pickle']['codec']}: {report['pickle']['ms']:.1f} ms (no transport, no hashing)")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--shards", default="1,2", show_default=True, help="Shard counts to measure, comma-separated.")
@click.option(
    "--hidden",
    "hiddens",
    multiple=True,
    default=["64,64", "256,256"],
    show_default=True,
    help="Hidden layer sizes of a model to measure (repeatable).",
)
@click.option("--mode", type=click.Choice(["sync", "async", "impala"]), default="sync", show_default=True)
@click.option(
    "--batch",
    type=click.IntRange(512),
    default=8192,
    show_default=True,
    help="Global batch in env steps (a multiple of 512).",
)
@click.option("--updates", type=click.IntRange(1), default=5, show_default=True, help="Timed updates per run.")
@click.option("--epochs", type=click.IntRange(1), default=4, show_default=True)
@click.option("--minibatches", type=click.IntRange(1), default=4, show_default=True)
@click.option("--subscribers", default="1,4", show_default=True, help="Broadcast subscriber counts.")
@click.option("--dtypes", default="float32,bfloat16", show_default=True, help="Broadcast transport precisions.")
@click.option("--chunk-bytes", type=click.IntRange(1024), default=4 << 20, show_default=True)
@click.option(
    "--broadcast-hidden",
    default=",".join(map(str, BIG_MODEL["hidden"])),
    show_default=True,
    help="Hidden sizes of the broadcast model (64-dim observations, 4 actions).",
)
@click.option(
    "--gpus",
    default=None,
    help="Measure shards on these devices instead ('0', '0,1': 1 shard on the "
    "first, then one per device), as `zddrl learner --gpus` takes them.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Measure this run's learner instead: its model, mode, batch and epochs on rollouts shaped as its env's "
    "(--hidden, --mode, --batch, --epochs, --minibatches do not apply).",
)
@click.option(
    "--autocast",
    "autocasts",
    default="off",
    show_default=True,
    help="learner.autocast values to measure, comma-separated (off,bf16,auto: side by side; auto's row says what it "
    "chose on this host and why).",
)
@click.option("--no-broadcast", is_flag=True, help="Skip the broadcast measurement.")
@click.option(
    "--profile",
    is_flag=True,
    help="Run the timed updates again under torch.profiler: the update's time by region (forward, value passes, "
    "backward, gradient averaging and clipping, optimizer, other) and the costliest operators.",
)
def learner(
    as_json,
    shards,
    hiddens,
    mode,
    batch,
    updates,
    epochs,
    minibatches,
    subscribers,
    dtypes,
    chunk_bytes,
    broadcast_hidden,
    gpus,
    config_path,
    autocasts,
    no_broadcast,
    profile,
) -> None:
    """Learner throughput with 1 and N shards (CPU, or --gpus), and ~10M-parameter broadcast (fp32/bf16 chunks
    vs pickle)."""
    casts = [c.strip() for c in autocasts.split(",") if c.strip()]
    if not casts or not set(casts) <= set(AUTOCASTS):
        raise click.UsageError(f"--autocast takes values of {AUTOCASTS}, got {autocasts!r}")
    if config_path is not None:
        try:
            algo = load_config(config_path).algo
            mode = kind_label(algo.name, algo.schedule)
        except ConfigError as exc:
            raise click.UsageError(f"--config: {exc}") from None
        if mode not in ("sync", "async", "impala"):
            raise click.UsageError(f"--config: mode {mode!r} has no on-policy learner to measure here")
    if batch % 512:
        raise click.UsageError("--batch must be a multiple of 512 (trajectories of 32 steps x 16 envs)")
    if gpus is None:  # CPU shards, and the same cores as threads of one shard
        counts = _ints(shards)
        runs = [(("cpu",) * n, 1) for n in counts] + ([(("cpu",), max(counts))] if max(counts) > 1 else [])
    else:
        try:
            devices = plan_devices(gpus).devices
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        runs = [(devices[:1], 1)] + ([(devices, 1)] if len(devices) > 1 else [])
    common = {"updates": updates, "mode": mode, "epochs": epochs, "minibatches": minibatches, "batch": batch}
    common["profile"] = profile
    models = [{"config": config_path}] if config_path else [{"hidden": _ints(h)} for h in hiddens]
    throughput = [
        run_throughput(devices, threads, {**common, **model, "autocast": cast})
        for model in models
        for devices, threads in runs
        for cast in casts
    ]
    broadcast, pickled = (
        ([], None)
        if no_broadcast
        else run_broadcast(_ints(subscribers), dtypes.split(","), chunk_bytes, _ints(broadcast_hidden))
    )
    report = {"throughput": throughput, "broadcast": broadcast, "pickle": pickled, "hardware": hardware()}
    click.echo(json.dumps(report) if as_json else format_report(report))


if __name__ == "__main__":
    shard_main(json.loads(sys.argv[1]), sys.argv[2])
