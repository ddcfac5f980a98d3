"""`python -m benchmarks replay --service`: the replay service's insert and sample throughput, next to the local
buffer's.

Real processes on loopback: a `zddrl broker` and a `zddrl replay`; this process is the run's learner (a hello with
the run spec, version 0 published, then ``RemoteReplay``, the learner's own client) and its actor (a hello and a
PUSH of ready-made rollouts of ``T x N = 32 x 8`` steps, the local rows' workload). Per workload:

* **insert**: rollouts pushed as fast as the credit lets them, timed until the replay's ``inserted`` (read from its
  answers) counts them all: actor -> broker -> replay, checked (``replay.store.ReplayStore.take_in``: shapes, finite
  numbers, episode counting) and inserted;
* **sample** and **sample+update**: ``RemoteReplay.sample(256)`` (one request, one answer of 256 transitions over
  TCP, importance weights computed here), and the same with the batch's priority updates riding on the next request.

The ``cartpole`` workload's run is CartPole-v1; ``atari``'s is Breakout with the Atari wrappers (4x84x84 uint8),
which the replay builds once to learn the spaces.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from benchmarks.replay import BATCH, N_ENVS, T_STEPS, WORKLOADS, rollouts_of
from zddrl import protocol as P
from zddrl.algos.spec import algorithm_of
from zddrl.config import Config
from zddrl.envs import probe_spec
from zddrl.learner.node import run_bus_of
from zddrl.proc import free_ports, stop_processes
from zddrl.replay.client import RemoteReplay
from zddrl.transport.link import BrokerLink

ENVS: dict[str, dict[str, Any]] = {
    "cartpole": {"env.id": "CartPole-v1"},
    "atari": {"env.id": "ALE/Breakout-v5", "env.atari": True, "env.frame_stack": 4},
}
WAIT_S = 120.0


def _config(name: str, capacity: int) -> Config:
    over = {
        **ENVS[name],
        "algo.name": "apex",
        "algo.schedule": "async",
        "replay.placement": "service",
        "replay.capacity": capacity,
    }
    over.update({"env.rollout_len": T_STEPS, "env.num_envs": N_ENVS, "replay.memory_fraction": 0.95})
    return Config().replace(over)


def _wait(condition: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"benchmarks replay --service: timed out waiting for {what}")
        time.sleep(0.02)


class ServiceRig:
    """Broker and replay processes, this process's learner and actor links; ``close()`` stops everything."""

    def __init__(self, name: str, capacity: int, log_dir: Path) -> None:
        self.config = _config(name, capacity)
        self.spec = probe_spec(self.config.env)
        control, traj, learn, params, replay = free_ports(5)
        self.connect = f"tcp://127.0.0.1:{control}"
        broker = ["broker", "--bind", self.connect, "--trajectory-port", str(traj), "--learner-port", str(learn)]
        broker += ["--params-port", str(params), "--insecure"]
        bind = f"tcp://127.0.0.1:{replay}"
        self.procs = {
            "broker": self._start(log_dir / "broker.log", broker),
            "replay": self._start(log_dir / "replay.log", ["replay", "--connect", self.connect, "--bind", bind]),
        }
        self.ctx = zmq.Context()
        self.run_id = f"bench-replay-{uuid.uuid4().hex[:8]}"
        hello = P.Hello(
            role="learner",
            peer_id="learner-0",
            run_id=self.run_id,
            run=self.config.to_dict(),
            bus=run_bus_of(self.config, algorithm_of(self.config), probe_spec(self.config.env)),  # apex's actor_td
        )
        self.learner = BrokerLink(self.connect, hello, context=self.ctx).start()
        if self.learner.wait_welcome(WAIT_S) is None:
            raise RuntimeError("benchmarks replay --service: the broker did not welcome the learner")
        self.pub = self.ctx.socket(zmq.DEALER)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.IDENTITY, b"learner-0")
        self.pub.connect(self.learner.endpoint("learners"))
        flat = np.zeros(4, np.float32)
        self.pub.send_multipart(
            P.encode(
                P.Parameters(
                    run_id=self.run_id,
                    peer_id="learner-0",
                    policy_version=0,
                    param_hash=P.param_hash(flat),
                    layout=[["w", "float32", [4], 0]],
                    arrays={"flat": flat},
                )
            )
        )
        actor = P.Hello(role="actor", peer_id="actor-0", num_envs=N_ENVS)
        self.actor = BrokerLink(self.connect, actor, context=self.ctx).start()
        if self.actor.wait_welcome(WAIT_S, need_run=True) is None:
            raise RuntimeError("benchmarks replay --service: the broker did not welcome the actor")
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(self.actor.endpoint("trajectories"))
        self.remote = RemoteReplay([bind], self.config, self.spec, self.run_id, "learner-0", context=self.ctx)
        self.remote.room = 1 << 40  # no throttle: the bench measures what the path can take
        _wait(self._answers, "the replay to adopt the run")
        self.remote.counters["timeouts"] = 0  # requests sent before it adopted the run went unanswered, as they must

    @staticmethod
    def _start(log: Path, args: list[str]) -> subprocess.Popen:
        with open(log, "w") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "zddrl", *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def _answers(self) -> bool:
        self.remote.refresh(0.2)
        return any(p.last is not None for p in self.remote.peers)

    def inserted(self) -> int:
        self.remote.refresh(1.0)
        return max((p.last.inserted for p in self.remote.peers if p.last is not None), default=0)

    def push_rollouts(self, pool: list[dict[str, np.ndarray]], count: int, first_seq: int) -> float:
        """Seconds from the first push until the replay inserted ``count`` more rollouts."""
        start = self.inserted()
        t0 = time.perf_counter()
        for i in range(count):
            arrays = {k: v for k, v in pool[i % len(pool)].items() if k != "trunc_idx" or len(v)}
            arrays = _wire_arrays(arrays)
            msg = P.Trajectory(
                run_id=self.run_id,
                peer_id="actor-0",
                seq=first_seq + i,
                policy_version=0,
                param_hash="",
                env_steps=T_STEPS * N_ENVS,
                arrays=arrays,
            )
            self.push.send_multipart(P.encode(msg), copy=False)
        _wait(lambda: self.inserted() >= start + count * T_STEPS * N_ENVS, "the replay to insert the rollouts")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.remote.close()
        for link in (self.actor, self.learner):
            link.close("bench over")
        self.ctx.destroy(linger=0)
        stop_processes(self.procs, 5.0)


def _wire_arrays(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The bench pool's rollout as an actor sends it (logp, values, next_value and the truncation values added)."""
    T, N = a["rewards"].shape
    out = dict(a)
    out.update(
        logp=np.zeros((T, N), np.float32), values=np.zeros((T, N), np.float32), next_value=np.zeros(N, np.float32)
    )
    out["actor_td"] = np.zeros((T, N), np.float32)  # apex declares its actors' initial priorities
    if "trunc_idx" in out:
        out["trunc_value"] = np.zeros(len(out["trunc_idx"]), np.float32)
    else:
        out.pop("trunc_obs", None)
    return out


def bench_service(name: str, capacity: int, seconds: float, rollouts: int = 200) -> dict[str, Any]:
    """One workload's service row (module docstring)."""
    obs_shape, obs_dtype = WORKLOADS[name]
    pool = rollouts_of(obs_shape, obs_dtype)
    with tempfile.TemporaryDirectory(prefix="zddrl-bench-replay-") as tmp:
        rig = ServiceRig(name, capacity, Path(tmp))
        try:
            rig.push_rollouts(pool, 4, 0)  # warm: connections, the layout caches
            n = min(rollouts, max(4, capacity // (T_STEPS * N_ENVS)))
            insert_s = rig.push_rollouts(pool, n, 4)
            td = np.random.default_rng(0).standard_normal(BATCH).astype(np.float32)

            def rate(update: bool) -> float:
                done, t0 = 0, time.perf_counter()
                while done < 3 * BATCH or time.perf_counter() - t0 < seconds:
                    batch = rig.remote.sample(BATCH)
                    if batch is None:
                        raise RuntimeError("the replay service did not answer a sample request")
                    if update:
                        rig.remote.update_priorities(batch.ids, td)
                    done += len(batch.ids)
                return done / (time.perf_counter() - t0)

            return {
                "workload": name,
                "placement": "service",
                "capacity": capacity,
                "rollouts_timed": n,
                "insert_per_s": round(n * T_STEPS * N_ENVS / insert_s),
                "sample_per_s": round(rate(False)),
                "sample_update_per_s": round(rate(True)),
                "timeouts": rig.remote.counters["timeouts"],
            }
        finally:
            rig.close()
