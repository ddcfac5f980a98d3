"""Simulated actors of `python -m benchmarks fleet`: hundreds per process, each its own identity with real sockets.

A worker process runs its actors on one thread and one epoll selector. Each actor has its own control DEALER
(hello, heartbeats at the broker's interval, credit, rehello and reconnect as docs/protocol.md sections 5.1,
5.2 and 5.4 say), its own params SUB and its own trajectories PUSH, with the high-water marks, heartbeat and
reconnect timings and stats map of `zddrl actor` (imported from its modules, not copied). There are no
environments and no policy: every trajectory carries the arrays of a CartPole rollout (32 steps x 4 envs,
prepared once) under a fresh header per message (``seq``, the version held, and the send time in ``info``),
encoded as an actor encodes each rollout. An actor sends only while fewer than ``max_in_flight`` of its
trajectories since its last welcome are uncredited.

The SUBs are read at each heartbeat, not polled: the bench's learner publishes one version, before any actor
joins, so they carry nothing after the snapshot that follows each welcome on control; polling them would only
double the poll set.
"""

from __future__ import annotations

import heapq
import random
import resource
import selectors
import time
import uuid
from collections import deque
from typing import Any, cast

import numpy as np
import zmq

from zddrl import protocol as P
from zddrl.actor.host import TRAJECTORY_SNDHWM, ActorTimers
from zddrl.bench import common as C
from zddrl.protocol.rules import run_bus
from zddrl.transport.fallback import RECONNECT_INITIAL_S, RECONNECT_MAX_S
from zddrl.transport.link import PARAMS_RCVHWM, hello_fields
from zddrl.transport.session import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS

T_STEPS, N_ENVS, OBS_DIM = 32, 4, 4
"""A CartPole rollout: 32 steps of 4 envs, 4 observation floats (about 5 KiB of arrays)."""
SOCKETS_PER_ACTOR = 3
"""Control DEALER, params SUB, trajectories PUSH."""
FDS_PER_SOCKET = 2
"""A ZeroMQ socket holds its mailbox's eventfd and, connected, one TCP descriptor."""
FD_MARGIN = 64
MAX_POLL_MS = 100
"""The loop looks at the mode (send or not) at least this often."""
RETRY_S, RETRY_MAX_S = 0.001, 0.02
"""After its PUSH refused a message (not connected yet, or its HWM reached: without credit, on the zmq.proxy path),
an actor waits this long before it tries again, twice as long after each refusal in a row up to RETRY_MAX_S; the
others go on."""
BURST_S = 0.02
"""A paced worker sends at most this many seconds' worth of its rate at once after a late wake-up."""
SLOTS = (
    "joined",
    "ready",
    "sent",
    "credited",
    "hello_out",
    "heartbeat_out",
    "stats_out",
    "heartbeat_in",
    "credit_in",
    "welcome_in",
    "params_in",
    "reject_in",
    "reconnects",
    "send_again",
    "malformed_in",
)
"""A worker's shared counters (totals since it started; ``joined``, ``ready``: actors now)."""
S = {name: i for i, name in enumerate(SLOTS)}


def raise_nofile(needed: int, who: str) -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; RuntimeError if ``needed`` does not fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise RuntimeError(
            f"{who} needs about {needed} file descriptors but RLIMIT_NOFILE allows {hard}: raise the hard limit "
            "(ulimit -Hn, limits.conf) or measure fewer actors"
        )
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def worker_fds(actors: int) -> int:
    return actors * SOCKETS_PER_ACTOR * FDS_PER_SOCKET + FD_MARGIN


def cartpole_arrays(seed: int) -> dict[str, np.ndarray]:
    """The nine arrays of a CartPole rollout as ``zddrl.actor.rollout.collect`` sends them (no truncation)."""
    return C.rollout_arrays(T_STEPS, N_ENVS, OBS_DIM, seed)


class SimActor:
    """One simulated actor's state: its sockets, its session (since the last welcome) and its credit."""

    def __init__(self, actor_id: int, hello: P.Hello, arrays: dict[str, np.ndarray]) -> None:
        self.actor_id, self.hello, self.arrays = actor_id, hello, arrays
        self.peer_id = hello.peer_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.control: zmq.Socket | None = None
        self.fd = -1
        """The control DEALER's ZMQ_FD (what the worker's selector waits on)."""
        self.sub: zmq.Socket | None = None
        self.push: zmq.Socket | None = None
        self.ports: dict[str, int] = {}
        self.run_id = ""
        self.max_in_flight = 1
        self.version, self.param_hash = -1, ""
        self.sent = self.credited = 0
        """Since the last welcome (docs/protocol.md section 5.4)."""
        self.seq = 0
        self.interval, self.liveness = HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS
        self.deadline = 0.0
        """Silent past this (monotonic): the broker is gone, join again."""
        self.next_beat = 0.0
        self.welcomed = False
        self.backoff = RECONNECT_INITIAL_S
        self.queued = False
        """In its worker's queue of actors that may send."""
        self.retry_s = RETRY_S
        self.timers = ActorTimers()
        """What `zddrl actor` reports from: this actor's steps and rollouts, nothing waited or sent."""

    @property
    def ready(self) -> bool:
        return self.push is not None and self.version >= 0 and bool(self.run_id)

    def can_send(self) -> bool:
        return self.ready and self.sent - self.credited < self.max_in_flight

    def trajectory(self) -> P.Trajectory:
        steps = T_STEPS * N_ENVS
        return P.Trajectory(
            run_id=self.run_id,
            peer_id=self.peer_id,
            seq=self.seq,
            policy_version=self.version,
            param_hash=self.param_hash,
            env_steps=steps,
            arrays=self.arrays,
            info={
                "actor_id": self.actor_id,
                "num_envs": N_ENVS,
                "total_env_steps": (self.seq + 1) * steps,
                "incarnation": self.incarnation,
                "t_send": time.monotonic(),
            },
            ep_returns=[21.0],
            ep_lengths=[21],
        )

    def stats(self) -> P.Stats:
        """The stats map `zddrl actor` sends every STATS_EVERY_S (actor/host.py ``_report``): its timers' figures
        (``ActorTimers.stats``), those of a healthy actor, a first-observation hash of its own."""
        self.timers.env_steps, self.timers.rollouts = self.seq * T_STEPS * N_ENVS, self.seq
        figures = {
            **self.timers.stats(),
            "num_envs": N_ENVS,
            "run_id": self.run_id,
            "policy_version": self.version,
            "param_hash": self.param_hash,
            "reconnects": 0,
            "rss_mb": 100.0,
            "first_obs_hash": f"{self.actor_id:016x}",
        }
        return P.Stats(peer_id=self.peer_id, role="actor", stats=figures)


class SimWorker:
    """The actors of one process, on one thread: ``run(mode)`` serves them until the process is stopped.

    ``mode.value``: 0 heartbeats only, 1 send trajectories (at ``rate`` per second over all its actors, round
    robin among those with credit; ``rate`` 0: as fast as their credit allows). With ``proxy``, ``control`` is a
    zmq.proxy forwarder's frontend, which the actors push to with no control plane and no credit. With ``stats``
    each actor that holds a version also sends a stats message with each heartbeat, as `zddrl actor` does once a
    second.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        control: str,
        host: str,
        first_id: int,
        count: int,
        counts: Any,
        rate: float,
        proxy: bool = False,
        stats: bool = True,
    ) -> None:
        self.ctx, self.endpoint, self.counts, self.rate, self.proxy = ctx, control, counts, rate, proxy
        self.stats = stats
        self.connect_host = control.rsplit(":", 1)[0]
        self.selector = selectors.DefaultSelector()
        """epoll over the control DEALERs' ZMQ_FDs: a wake-up costs what is ready, not what is open (zmq.Poller
        looks at all 256 sockets at each wake-up: that made the sims use more CPU than the broker)."""
        self.beats: list[tuple[float, int]] = []
        self.queue: deque[SimActor] = deque()
        self.tokens, self.t_tokens = 0.0, time.monotonic()
        self.blocked: list[tuple[float, int, SimActor]] = []
        """A heap of actors whose PUSH refused a message: (when it may try again, actor id, actor)."""
        arrays = cartpole_arrays(first_id)
        pid = hello_fields()["pid"]
        self.actors = [
            SimActor(i, P.Hello(role="actor", peer_id=f"sim-{i}", host=host, pid=pid, num_envs=N_ENVS), arrays)
            for i in range(first_id, first_id + count)
        ]
        now = time.monotonic()
        for k, actor in enumerate(self.actors):
            if self.proxy:
                self._open_bare(actor)
                continue
            self._open(actor, now)
            self._schedule(actor, k, now + random.uniform(0, HEARTBEAT_INTERVAL_S))  # actors start at random

    def _open_bare(self, actor: SimActor) -> None:
        """The zmq.proxy path: no broker, no control plane, no credit: a PUSH to the forwarder, bounded by its HWM."""
        actor.push = self.ctx.socket(zmq.PUSH)
        actor.push.setsockopt(zmq.LINGER, 0)
        actor.push.setsockopt(zmq.SNDHWM, TRAJECTORY_SNDHWM)
        actor.push.connect(self.endpoint)
        actor.run_id, actor.version, actor.param_hash = "bench-fleet-proxy", 0, "0" * 16
        actor.max_in_flight = 1 << 62
        self.counts[S["joined"]] += 1
        self.counts[S["ready"]] += 1
        self._enqueue(actor)

    # ---------------------------------------------------------------- sessions
    def _open(self, actor: SimActor, now: float) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        actor.control = sock
        actor.deadline = now + actor.interval * actor.liveness
        actor.fd = cast(int, sock.getsockopt(zmq.FD))
        self.selector.register(actor.fd, selectors.EVENT_READ, actor)
        self._send_control(actor, actor.hello, "hello_out", now)

    def _close_session(self, actor: SimActor) -> None:
        """The broker went silent: close control and SUB (the PUSH stays until the next welcome)."""
        if actor.control is not None:
            self.selector.unregister(actor.fd)
            actor.control.close(linger=0)
            actor.control = None
        if actor.sub is not None:
            actor.sub.close(linger=0)
            actor.sub = None
        if actor.welcomed:
            self.counts[S["joined"]] -= 1
            actor.welcomed = False

    def _schedule(self, actor: SimActor, k: int, at: float) -> None:
        actor.next_beat = at
        heapq.heappush(self.beats, (at, k))

    def _on_welcome(self, actor: SimActor, msg: P.Welcome, now: float) -> None:
        self.counts[S["welcome_in"]] += 1
        if not actor.welcomed:
            self.counts[S["joined"]] += 1
            actor.welcomed, actor.backoff = True, RECONNECT_INITIAL_S
        was_ready = actor.ready
        actor.interval, actor.liveness = msg.heartbeat_interval_s, msg.heartbeat_liveness
        actor.deadline = now + actor.interval * actor.liveness
        if msg.run_id and msg.run_id != actor.run_id:  # versions are only comparable within one run
            actor.version, actor.param_hash = -1, ""
        actor.run_id = msg.run_id
        actor.sent = actor.credited = 0  # a new session: what the old one had in flight is gone
        if msg.run is not None:
            actor.max_in_flight = run_bus(msg.bus).max_in_flight  # the window the broker returns credit by
            self._connect_data(actor, msg.ports)
        if actor.ready != was_ready:
            self.counts[S["ready"]] += 1 if actor.ready else -1
        self._enqueue(actor)

    def _connect_data(self, actor: SimActor, ports: dict[str, int]) -> None:
        if actor.push is None or ports["trajectories"] != actor.ports.get("trajectories"):
            if actor.push is not None:
                actor.push.close(linger=0)
            actor.push = self.ctx.socket(zmq.PUSH)
            actor.push.setsockopt(zmq.LINGER, 0)
            actor.push.setsockopt(zmq.SNDHWM, TRAJECTORY_SNDHWM)
            actor.push.connect(f"{self.connect_host}:{ports['trajectories']}")
        if actor.sub is None or ports["params"] != actor.ports.get("params"):
            if actor.sub is not None:
                actor.sub.close(linger=0)
            actor.sub = self.ctx.socket(zmq.SUB)
            actor.sub.setsockopt(zmq.LINGER, 0)
            actor.sub.setsockopt(zmq.RCVHWM, PARAMS_RCVHWM)
            actor.sub.setsockopt(zmq.SUBSCRIBE, P.PREAMBLE)
            actor.sub.connect(f"{self.connect_host}:{ports['params']}")
        actor.ports = dict(ports)

    def _on_params(self, actor: SimActor, msg: P.Message) -> None:
        """Keep the newest version of the run (the bench learner's versions are one chunk, hashed by the broker)."""
        self.counts[S["params_in"]] += 1
        if isinstance(msg, P.Parameters) and msg.run_id == actor.run_id and msg.policy_version > actor.version:
            was_ready = actor.ready
            actor.version, actor.param_hash = msg.policy_version, msg.param_hash
            if actor.ready and not was_ready:
                self.counts[S["ready"]] += 1
                self._enqueue(actor)

    def _on_message(self, actor: SimActor, msg: P.Message, now: float) -> None:
        assert actor.control is not None
        actor.deadline = now + actor.interval * actor.liveness  # any message is a sign of life
        if isinstance(msg, P.Heartbeat):
            self.counts[S["heartbeat_in"]] += 1
            if msg.interval_s > 0 and msg.interval_s != actor.interval:  # the broker's fleet grew or shrank
                actor.interval = msg.interval_s
                actor.deadline = now + actor.interval * actor.liveness
                if actor.next_beat > now + actor.interval:
                    self._schedule(actor, actor.actor_id - self.actors[0].actor_id, now + actor.interval)
        elif isinstance(msg, P.Credit):
            self.counts[S["credit_in"]] += 1
            credit = min(msg.credit, actor.sent - actor.credited)  # never more than was sent
            actor.credited += credit
            self.counts[S["credited"]] += credit
            self._enqueue(actor)
        elif isinstance(msg, P.Welcome):
            self._on_welcome(actor, msg, now)
        elif isinstance(msg, (P.Parameters, P.ParamChunk)):
            self._on_params(actor, msg)
        elif isinstance(msg, P.Reject):
            self.counts[S["reject_in"]] += 1
            if msg.reason.startswith(P.REFUSED_PREFIX):
                raise RuntimeError(f"the broker refused {actor.peer_id}: {msg.reason}")
            if msg.rehello:
                self._send_control(actor, actor.hello, "hello_out", now)

    def _drain(self, actor: SimActor, sock: zmq.Socket, now: float) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = P.decode(frames)
            except P.ProtocolError:
                self.counts[S["malformed_in"]] += 1
                continue
            if sock is actor.sub:
                self._on_params(actor, msg)
            else:
                self._on_message(actor, msg, now)

    def _send_control(self, actor: SimActor, msg: P.Message, counter: str, now: float) -> None:
        """Send on the control DEALER (never blocking: a periodic message that cannot go now is replaced by the
        next), then read what is there: a send handles the socket's pending commands, which can consume the
        ZMQ_FD wake-up of a message that arrived meanwhile (ZeroMQ's FD is edge-like: check ZMQ_EVENTS after
        every send, and drain until EAGAIN after every wake-up)."""
        assert actor.control is not None
        try:
            actor.control.send_multipart(P.encode(msg), zmq.NOBLOCK)
            self.counts[S[counter]] += 1
        except zmq.Again:
            pass
        if cast(int, actor.control.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._drain(actor, actor.control, now)

    # ---------------------------------------------------------------- heartbeats and liveness
    def _beat_due(self, now: float) -> None:
        while self.beats and self.beats[0][0] <= now:
            at, k = heapq.heappop(self.beats)
            actor = self.actors[k]
            if at != actor.next_beat:
                continue  # superseded
            if actor.control is None:  # waiting to join again
                self.counts[S["reconnects"]] += 1
                self._open(actor, now)
                self._schedule(actor, k, now + actor.interval)
                continue
            if now > actor.deadline:  # silent too long: close, back off, join again with a new DEALER
                self._close_session(actor)
                actor.backoff = min(actor.backoff * 2, RECONNECT_MAX_S)
                self._schedule(actor, k, now + actor.backoff)
                continue
            if actor.sub is not None:
                self._drain(actor, actor.sub, now)
            beat = P.Heartbeat(peer_id=actor.peer_id, policy_version=actor.version)
            self._send_control(actor, beat, "heartbeat_out", now)
            if self.stats and actor.ready and actor.control is not None:
                self._send_control(actor, actor.stats(), "stats_out", now)
            self._schedule(actor, k, now + actor.interval)

    # ---------------------------------------------------------------- trajectories
    def _enqueue(self, actor: SimActor) -> None:
        if not actor.queued and actor.can_send():
            actor.queued = True
            self.queue.append(actor)

    def _send_next(self, now: float) -> bool:
        """Send one trajectory from the next actor with credit whose PUSH takes it; False if none does."""
        while self.queue:
            actor = self.queue.popleft()
            actor.queued = False
            if not actor.can_send():
                continue
            assert actor.push is not None
            try:  # a full PUSH is found before a trajectory is encoded for nothing
                if not cast(int, actor.push.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
                    raise zmq.Again()
                actor.push.send_multipart(P.encode(actor.trajectory()), zmq.NOBLOCK, copy=False)
            except zmq.Again:  # not connected yet, or its queue is full: this one tries again later
                self.counts[S["send_again"]] += 1
                heapq.heappush(self.blocked, (now + actor.retry_s, actor.actor_id, actor))
                actor.retry_s = min(actor.retry_s * 2, RETRY_MAX_S)
                continue
            actor.retry_s = RETRY_S
            actor.sent += 1
            actor.seq += 1
            self.counts[S["sent"]] += 1
            self._enqueue(actor)
            return True
        return False

    def _send_due(self, sending: bool, now: float) -> None:
        while self.blocked and self.blocked[0][0] <= now:
            self._enqueue(heapq.heappop(self.blocked)[2])
        if not sending:
            self.tokens, self.t_tokens = 0.0, now
            return
        if self.rate <= 0:  # as fast as credit allows: one round over the actors that may send
            for _ in range(len(self.queue)):
                if not self._send_next(now):
                    return
            return
        burst = max(1.0, self.rate * BURST_S)
        self.tokens = min(burst, self.tokens + (now - self.t_tokens) * self.rate)
        self.t_tokens = now
        while self.tokens >= 1.0 and self._send_next(now):
            self.tokens -= 1.0

    def _timeout_ms(self, sending: bool, now: float) -> int:
        wait = MAX_POLL_MS / 1000
        if self.beats:
            wait = min(wait, self.beats[0][0] - now)
        if sending and self.queue:
            wait = min(wait, 0.0 if self.rate <= 0 else (1.0 - self.tokens) / self.rate)
        elif sending and self.blocked:
            wait = min(wait, self.blocked[0][0] - now)
        return max(0, int(wait * 1000 + 0.999))

    def run(self, mode: Any) -> None:
        while True:
            sending = mode.value == 1
            now = time.monotonic()
            for key, _ in self.selector.select(self._timeout_ms(sending, now) / 1000):
                actor = key.data
                if actor.control is not None:
                    self._drain(actor, actor.control, time.monotonic())
            now = time.monotonic()
            self._beat_due(now)
            self._send_due(sending, now)


def worker_main(
    control: str,
    worker: int,
    first_id: int,
    count: int,
    counts: Any,
    mode: Any,
    rate: float,
    proxy: bool = False,
    stats: bool = True,
) -> None:
    """A worker process: ``count`` actors ``sim-<first_id>...`` reporting host ``sim-<worker>`` (``proxy``: pushing
    to a zmq.proxy frontend at ``control``, see SimWorker)."""
    C.setup_worker(f"bench-fleet-sim-{worker}")
    raise_nofile(worker_fds(count), f"a fleet worker with {count} actors")
    ctx = zmq.Context(io_threads=1)
    ctx.setsockopt(zmq.MAX_SOCKETS, count * SOCKETS_PER_ACTOR + FD_MARGIN)  # ZeroMQ's default is 1023 sockets
    SimWorker(ctx, control, f"sim-{worker}", first_id, count, counts, rate, proxy, stats).run(mode)
