"""Building blocks of `zddrl bench bus`: payloads, shared counters and the worker processes.

Every worker is its own spawned process, so the broker's Python loop, a zmq.proxy forwarder and
the two endpoints compete for the cores as they would in a deployment. Workers are driven and
read through shared memory (``RawValue``/``RawArray``) rather than pipes: a load and a store cost
far less than a message per trajectory, and the cost is the same on every path measured.
"""

from __future__ import annotations

import importlib
import json
import math
import multiprocessing as mp
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import click
import numpy as np
import zmq
from loguru import logger

from zddrl import protocol as P
from zddrl.transport.channel import CREDIT_WINDOW

HWM = 16
"""Queue depth of every bench socket: BrokerConfig.trajectory_hwm, so all paths buffer alike."""
IO_TIMEOUT_MS = 100
"""Blocking socket calls give up after this so that workers notice a new mode promptly."""
T_STEPS, N_ENVS = 16, 4
RUN_SPEC = {"name": "bench-bus"}
"""A learner hello needs a run spec, which the broker passes on unread."""
RUN_BUS = {"sync": True, "max_staleness": 0, "max_in_flight": HWM}
"""What the broker reads of the bench's run (the hello's ``bus``). The bench's sender pushes without waiting for
credit, as far as its socket's HWM lets it: HWM trajectories in flight is what it does, so that is what the run
declares (the broker returns its credit HWM / 2 at a time)."""
SENDER_ID, LEARNER_ID = "bench-actor", "bench-learner"
DEFAULT_BROKER = "zddrl.broker:Broker"

SPAWN = mp.get_context("spawn")


# --------------------------------------------------------------------------------------------
# Payloads
# --------------------------------------------------------------------------------------------


PIXEL_T, PIXEL_N, PIXEL_FRAME = 128, 8, (4, 84, 84)
"""An Atari rollout as examples/pong_ppo.toml's actors send it: 128 steps x 8 envs of 4 stacked 84x84 uint8 frames."""


def pixel_rollout_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """The nine arrays of a ``PIXEL_T`` x ``PIXEL_N`` Atari rollout: uint8 frame stacks, four actions."""
    arrays = rollout_arrays(PIXEL_T, PIXEL_N, 1, seed)
    rng = np.random.default_rng(seed)
    arrays["obs"] = rng.integers(0, 256, (PIXEL_T, PIXEL_N, *PIXEL_FRAME), np.uint8)
    arrays["next_obs"] = rng.integers(0, 256, (PIXEL_N, *PIXEL_FRAME), np.uint8)
    return arrays


PIXEL_ROLLOUT_BYTES = (
    (PIXEL_T * PIXEL_N + PIXEL_N) * math.prod(PIXEL_FRAME) + PIXEL_T * PIXEL_N * (8 + 3 * 4 + 2) + PIXEL_N * 4
)
"""29,149,728 bytes (obs and next_obs; actions, logp, values, rewards, the two flags; next_value): the payload size
``zddrl bench bus`` measures with a pixel rollout instead of float rows."""


def trajectory_arrays(payload_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The arrays ``zddrl.actor.rollout.collect`` sends for a typical rollout (no truncation in it), as close to
    ``payload_bytes`` as their layout allows (observations fill it; under by less than one obs row per step).
    ``PIXEL_ROLLOUT_BYTES`` exactly is an Atari rollout (``pixel_rollout_arrays``).

    Same names, dtypes and layout as an actor's (9 arrays: the per-message cost of the bus grows with
    their number, so a single big array would flatter it).
    """
    if payload_bytes == PIXEL_ROLLOUT_BYTES:
        return pixel_rollout_arrays(seed)
    T, N = T_STEPS, N_ENVS
    fixed = T * N * (8 + 3 * 4 + 2) + N * 4  # actions, logp/values/rewards, terminated/truncated, next_value
    dim = (payload_bytes - fixed) // (4 * (T * N + N))
    if dim < 1:
        raise ValueError(f"payload {payload_bytes} B is too small for a trajectory (>= 2048 B)")
    return rollout_arrays(T, N, dim, seed)


def rollout_arrays(T: int, N: int, dim: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The nine arrays of a ``T`` x ``N`` rollout of ``dim``-float observations and two actions, as an actor sends
    them (no truncation in it)."""
    rng = np.random.default_rng(seed)
    f32 = np.float32
    return {
        "obs": rng.standard_normal((T, N, dim), f32),
        "actions": rng.integers(0, 2, (T, N), np.int64),
        "logp": rng.standard_normal((T, N), f32),
        "values": rng.standard_normal((T, N), f32),
        "rewards": np.ones((T, N), f32),
        "terminated": np.zeros((T, N), bool),
        "truncated": np.zeros((T, N), bool),
        "next_obs": rng.standard_normal((N, dim), f32),
        "next_value": np.zeros(N, f32),
    }


def trajectory(run_id: str, seq: int, arrays: dict[str, np.ndarray]) -> P.Trajectory:
    """A trajectory as an actor sends it; two episodes ended in it (their figures ride in the header)."""
    return P.Trajectory(
        run_id=run_id,
        peer_id=SENDER_ID,
        seq=seq,
        policy_version=0,
        param_hash="0" * 16,
        env_steps=arrays["rewards"].size,
        arrays=arrays,
        info={"total_env_steps": seq * arrays["rewards"].size},
        ep_returns=[21.0, 34.0],
        ep_lengths=[21, 34],
    )


def parameters(run_id: str, version: int, flat: np.ndarray) -> P.Parameters:
    """A policy version the way LearnerNode._publish builds one (hash over the flat buffer)."""
    return P.Parameters(
        run_id=run_id,
        peer_id=LEARNER_ID,
        policy_version=version,
        param_hash=P.param_hash(flat),
        layout=[["w", "float32", [int(flat.size)], 0]],
        arrays={"flat": flat},
        meta={"rollout_len": T_STEPS},
    )


# --------------------------------------------------------------------------------------------
# Shared counters
# --------------------------------------------------------------------------------------------


class Counters:
    """Messages, payload bytes and the monotonic time of the last message: one writer, one reader.

    A seqlock (slot 3 odd while writing) lets the reader get a consistent triple without a lock
    on the writer's per-message path.
    """

    def __init__(self) -> None:
        self.raw = SPAWN.RawArray("d", 4)

    def publish(self, n: int, nbytes: int, t: float) -> None:
        raw = self.raw
        raw[3] += 1
        raw[0], raw[1], raw[2] = n, nbytes, t
        raw[3] += 1

    def read(self) -> tuple[float, float, float]:
        raw = self.raw
        while True:
            seq = raw[3]
            if seq % 2 == 0:
                n, nbytes, t = raw[0], raw[1], raw[2]
                if raw[3] == seq:
                    return n, nbytes, t


# --------------------------------------------------------------------------------------------
# Process management
# --------------------------------------------------------------------------------------------


class Workers:
    """Spawned worker processes; ``stop()`` (also on ``with`` exit) terminates, then kills, each one."""

    def __init__(self) -> None:
        self.procs: list[Any] = []

    def start(self, name: str, target: Callable[..., None], *args: Any) -> Any:
        proc = SPAWN.Process(target=target, args=args, name=name, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def check(self) -> None:
        for proc in self.procs:
            if not proc.is_alive():
                raise RuntimeError(f"bench worker {proc.name} exited early (code {proc.exitcode})")

    def wait(self, condition: Callable[[], object], timeout_s: float, what: str) -> None:
        """Poll ``condition`` until true; fail after ``timeout_s`` or as soon as a worker died."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(0.002)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(timeout=3)
            if proc.is_alive():
                logger.warning(f"bench worker {proc.name} ignored SIGTERM: killing it")
                proc.kill()
                proc.join(timeout=3)
        self.procs.clear()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process, all threads (libzmq's I/O thread too); None off Linux."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def setup_worker(role: str) -> zmq.Context:
    # Ctrl-C reaches the whole process group; only the parent handles it and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = SPAWN.parent_process()
    if parent is not None:  # a parent killed without its finally must not leave busy orphans behind
        threading.Thread(target=_exit_with, args=(parent,), name="parent-watch", daemon=True).start()
    from zddrl.logs import configure

    configure("WARNING", role=role)  # drops and failures still show; per-peer INFO lines would flood
    return zmq.Context.instance()


def _exit_with(parent: Any) -> None:
    parent.join()
    os._exit(0)


def socket_of(ctx: zmq.Context, kind: int, **opts: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    return sock


def client_credentials(keys_dir: str | None, role: str) -> Any:
    """``keys.Credentials`` of ``role`` from a closed bus's key directory; None on the open bus."""
    if keys_dir is None:
        return None
    from zddrl.keys import credentials

    return credentials(keys_dir, role, role)


def signed(params: P.Parameters, creds: Any) -> P.Parameters:
    """``params`` as a learner with ``creds`` publishes them: signed on a closed bus, as they are on an open one."""
    if creds is None:
        return params
    from zddrl.transport.signatures import signed_params

    return signed_params(params, creds.signer)


def link_of(connect: str, hello: P.Hello, subscribe: bool = False, keys_dir: str | None = None):
    from zddrl.transport.link import BrokerLink

    creds = client_credentials(keys_dir, hello.role)
    if creds is not None and hello.run is not None:  # a learner announcing its run signs it, as LearnerNode does
        from zddrl.transport.signatures import signed_hello

        hello = signed_hello(hello, creds.signer)
    link = BrokerLink(connect, hello, subscribe_params=subscribe, credentials=creds).start()
    if link.wait_welcome(30, need_run=True) is None:
        raise RuntimeError(f"no welcome with a run from the broker at {connect}")
    return link


def make_hello(role: str, peer_id: str, run_id: str = "") -> P.Hello:
    from zddrl.transport.link import hello_fields

    run, bus = (RUN_SPEC, RUN_BUS) if role == "learner" else (None, None)
    return P.Hello(role=role, peer_id=peer_id, run_id=run_id, run=run, bus=bus, **hello_fields())


# --------------------------------------------------------------------------------------------
# Workers (process entry points)
# --------------------------------------------------------------------------------------------


def sender_main(
    endpoint: str, control: str | None, run_id: str, payloads: list[int], mode: Any, keys_dir: str | None = None
) -> None:
    """An actor pushing encoded trajectories of payload ``mode.value - 1`` while ``mode.value > 0``.

    On the broker paths (``control`` set) it joins as an actor first, so the broker's per-actor
    accounting runs as in production; with ``keys_dir``, on a closed bus.
    """
    ctx = setup_worker("bench-sender")
    link = link_of(control, make_hello("actor", SENDER_ID), keys_dir=keys_dir) if control else None
    sock = socket_of(ctx, zmq.PUSH, SNDHWM=HWM, SNDTIMEO=IO_TIMEOUT_MS)
    creds = client_credentials(keys_dir, "actor")
    if creds is not None:  # a CURVE client of the broker, or of the receiver on the direct path
        creds.apply(sock)
    sock.connect(endpoint)
    arrays = [trajectory_arrays(p, seed=i) for i, p in enumerate(payloads)]
    seq = 0
    try:
        while True:
            k = mode.value
            if k <= 0:
                time.sleep(0.005)
                continue
            try:  # a fresh header per message, as an actor encodes each rollout it sends
                sock.send_multipart(P.encode(trajectory(run_id, seq, arrays[k - 1])), copy=False)
            except zmq.Again:  # queue full for IO_TIMEOUT_MS: look at the mode again
                continue
            seq += 1
    finally:
        if link is not None:
            link.close()


def receiver_main(
    path: str,
    endpoint: str,
    control: str | None,
    run_id: str,
    counters: Counters,
    window: int = CREDIT_WINDOW,
    keys_dir: str | None = None,
) -> None:
    """The learner end: decode every message and count it. On the broker path it is a learner shard's
    data channel (zddrl.transport.channel.DataChannel: the same credit policy, the same decode)."""
    ctx = setup_worker("bench-receiver")
    if control is None:
        sock = socket_of(ctx, zmq.PULL, RCVHWM=HWM, RCVTIMEO=IO_TIMEOUT_MS)
        if keys_dir is not None:  # ZeroMQ's CURVE alone, one hop: the receiver serves with the broker's pair
            from zddrl.keys import server_keys

            server = server_keys(keys_dir)
            sock.curve_server, sock.curve_secretkey, sock.curve_publickey = True, server.secret, server.public
        if path.startswith("direct"):
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
        _count(lambda: _recv_decoded(sock), counters)
        return
    from zddrl.transport.channel import DataChannel

    # Same order as LearnerNode.run: hello (starts the run), then the data channel (credit), then v0.
    link = link_of(control, make_hello("learner", LEARNER_ID, run_id), keys_dir=keys_dir)
    try:
        channel = DataChannel(link, LEARNER_ID, link.welcome.max_message_bytes, window)
        channel.send(signed(parameters(run_id, 0, np.zeros(16, np.float32)), link.credentials))

        def receive() -> P.Message | None:
            msg = channel.recv(IO_TIMEOUT_MS)
            if isinstance(msg, P.Trajectory):
                channel.ack()
            return msg

        _count(receive, counters)
    finally:
        link.close()


def _recv_decoded(sock: zmq.Socket) -> P.Message | None:
    try:
        return P.decode(sock.recv_multipart(copy=False))
    except zmq.Again:
        return None


def _count(receive: Callable[[], P.Message | None], counters: Counters) -> None:
    """Count the decoded trajectories ``receive`` returns (None: nothing yet)."""
    n = nbytes = 0
    while True:
        msg = receive()
        if not isinstance(msg, P.Trajectory):
            continue
        n += 1
        nbytes += sum(a.nbytes for a in msg.arrays.values())
        counters.publish(n, nbytes, time.monotonic())


def proxy_main(front_port: int, back_port: int) -> None:
    """The reference forwarder: zmq.proxy, PULL frontend -> PUSH backend, all in C."""
    ctx = setup_worker("bench-proxy")
    front = socket_of(ctx, zmq.PULL, RCVHWM=HWM)
    back = socket_of(ctx, zmq.PUSH, SNDHWM=HWM)
    front.bind(f"tcp://127.0.0.1:{front_port}")
    back.bind(f"tcp://127.0.0.1:{back_port}")
    zmq.proxy(front, back)


def load_broker(spec: str) -> type:
    """``module:Class`` of the broker to run (a prototype can be measured with the same harness)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name or "Broker")


def broker_main(ports: list[int], spec: str = DEFAULT_BROKER, keys_dir: str | None = None, bind: str = "") -> None:
    """A real broker through its Python API, on the given control/trajectory/learner/params ports (a closed bus
    with ``keys_dir``), or on the local bus ``bind`` (``ipc://DIR/control``; ``ports`` unused)."""
    setup_worker("bench-broker")
    from zddrl.config import BrokerConfig

    if bind:
        config = BrokerConfig(bind=bind, keys=keys_dir or "")
    else:
        control, traj, learners, params = ports
        config = BrokerConfig(
            bind=f"tcp://127.0.0.1:{control}",
            trajectory_port=traj,
            learner_port=learners,
            params_port=params,
            keys=keys_dir or "",
        )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # let run() return so close() runs
    broker = load_broker(spec)(config)
    try:
        broker.bind()
        broker.run(stop)
    finally:
        broker.close()


def subscriber_main(control: str, index: int, slots: Any, keys_dir: str | None = None) -> None:
    """An actor holding verified parameters (BrokerLink checks the hash before keeping them).

    Reports ``slots[2i] = version`` after ``slots[2i+1] = time``: the parent reads the version
    first, so a version it sees always comes with its own time.
    """
    setup_worker("bench-subscriber")
    link = link_of(control, make_hello("actor", f"bench-sub-{index}"), subscribe=True, keys_dir=keys_dir)
    version = -1
    try:
        while True:
            params = link.wait_params(newer_than=version, timeout_s=0.5)
            if params is None:
                continue
            slots[2 * index + 1] = time.monotonic()
            slots[2 * index] = params.policy_version
            version = params.policy_version
    finally:
        link.close()


def shared_slots(n: int) -> Any:
    slots = SPAWN.RawArray("d", 2 * n)
    for i in range(n):
        slots[2 * i] = -1
    return slots


def shared_mode() -> Any:
    return SPAWN.RawValue("i", 0)


def timed_json_run(cmd: Sequence[str], what: str, timeout: float = 1800) -> tuple[float, dict[str, Any]]:
    """Run ``cmd`` (a benchmark's subprocess: an SB3 anchor, a start-up probe); its wall seconds and the JSON object
    on its last stdout line. A failure is one CLI error naming ``what``, with the end of its stderr."""
    t0 = time.perf_counter()
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise click.ClickException(f"{what} failed: {done.stderr[-2000:]}")
    return wall, json.loads(done.stdout.strip().splitlines()[-1])
