"""The broker: one public address; routes trajectories to learner shards and fans out parameters.

Sockets (all bound by the broker; clients learn the data ports from the welcome)::

    control       ROUTER  hello/welcome, heartbeats both ways, stats, status, parameter snapshots
    trajectories  PULL    actors PUSH trajectory messages here
    learners      ROUTER  learner shards (DEALER, identity = peer id): credit in, trajectories out,
                          parameters in
    params        PUB     every parameter version, to every actor's SUB

Flow control is credit-based: a learner shard grants credit (how many more trajectories it can
take), the broker reads the trajectory socket only while some shard has credit and sends each
message to the shard with the most credit left. With no credit, the broker stops reading, the
socket queues fill to their high-water marks and actors block in ``send``: backpressure, never an
unbounded buffer, never a silent drop. Every message read is forwarded or dropped with a reason,
so ``received == forwarded + sum(dropped) + in_flight`` always holds.
"""
from __future__ import annotations

import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import zmq
from loguru import logger

from . import protocol as P
from .config import BrokerConfig, split_endpoint

DROP_REASONS = ("malformed", "unknown_run", "stale", "unknown_version", "no_route")
POLL_TIMEOUT_S = 0.1
FORWARD_BURST = 256
"""Trajectories forwarded per poll wake-up at most (keeps control traffic responsive)."""
LOG_EVERY_S = 5.0


@dataclass
class Member:
    """One connected actor host or learner shard, as the broker sees it."""

    peer_id: str
    role: str
    identity: bytes
    host: str = ""
    pid: int = 0
    num_envs: int = 0
    joined: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    policy_version: int = -1
    credit: int = 0
    last_snapshot: float = 0.0
    counters: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    stats: dict[str, Any] = field(default_factory=dict)

    def row(self, now: float) -> dict[str, Any]:
        return {"role": self.role, "host": self.host, "pid": self.pid, "num_envs": self.num_envs,
                "policy_version": self.policy_version, "last_seen_s": round(now - self.last_seen, 3),
                "credit": self.credit, **self.counters, "stats": self.stats}


class RateLimitedLog:
    """Logs the first occurrence of a key at once, then at most once per LOG_EVERY_S with a count."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = defaultdict(int)

    def warning(self, key: str, text: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) >= LOG_EVERY_S:
            extra = f" ({self._suppressed[key]} more like it since the last line)" if self._suppressed[key] else ""
            logger.warning(text + extra)
            self._last[key] = now
            self._suppressed[key] = 0
        else:
            self._suppressed[key] += 1


class Broker:
    """Run with ``Broker(config).bind()`` then ``run(stop_event)``; ``close()`` in a finally."""

    def __init__(self, config: BrokerConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self.ctx = context or zmq.Context.instance()
        self.log = logger.bind(role="broker")
        self.members: dict[str, Member] = {}
        self.by_identity: dict[bytes, Member] = {}
        self.run_id = ""
        self.run_spec: dict | None = None
        self.params_frames: Sequence[Any] | None = None
        self.params_version = -1
        self.counters: dict[str, int] = defaultdict(int)
        self.dropped: dict[str, int] = {r: 0 for r in DROP_REASONS}
        self.in_flight = 0
        self.started = time.monotonic()
        self.ports: dict[str, int] = {}
        self._ratelog = RateLimitedLog()
        self._next_beat = 0.0
        self._poll_traj = False

    # ---------------------------------------------------------------- setup
    def bind(self) -> dict[str, int]:
        """Create and bind every socket; returns the bound ports."""
        host, port = split_endpoint(self.config.bind)
        c = self.config
        self.control = self._socket(zmq.ROUTER)
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.trajectories = self._socket(zmq.PULL)
        self.trajectories.setsockopt(zmq.RCVHWM, c.trajectory_hwm)
        self.learners = self._socket(zmq.ROUTER)
        self.learners.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.learners.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting shard reuses its identity
        self.learners.setsockopt(zmq.SNDHWM, 0)  # bounded by credit, not by HWM
        self.learners.setsockopt(zmq.RCVHWM, 0)  # parameters and credits must never be lost
        self.params = self._socket(zmq.PUB)
        self.params.setsockopt(zmq.SNDHWM, c.params_hwm)
        base = None if port == "*" else int(port)
        plan = [("control", self.control, base), ("trajectories", self.trajectories, c.trajectory_port),
                ("learners", self.learners, c.learner_port), ("params", self.params, c.params_port)]
        for offset, (name, sock, wanted) in enumerate(plan):
            if base is None and not wanted:
                sock.bind(f"tcp://{host}:*")
            else:
                sock.bind(f"tcp://{host}:{wanted or base + offset}")
            self.ports[name] = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.poller.register(self.learners, zmq.POLLIN)
        self.log.info(f"broker bound on {host}: {self.ports}")
        return dict(self.ports)

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes + P.MAX_HEADER_BYTES + 4096)
        return sock

    def close(self) -> None:
        for sock in (self.control, self.trajectories, self.learners, self.params):
            sock.close(linger=0)

    # ---------------------------------------------------------------- main loop
    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set. Never raises on bad input: drops, counts and logs it."""
        while not stop.is_set():
            self._update_trajectory_polling()
            events = dict(self.poller.poll(POLL_TIMEOUT_S * 1000))
            if self.control in events:
                self._drain(self.control, self._on_control)
            if self.learners in events:
                self._drain(self.learners, self._on_learner)
            if self.trajectories in events:
                self._forward_trajectories()
            now = time.monotonic()
            if now >= self._next_beat:
                self._send_heartbeats()
                self._purge_expired(now)
                self._next_beat = now + self.config.heartbeat_interval_s

    def _update_trajectory_polling(self) -> None:
        want = self._total_credit() > 0
        if want != self._poll_traj:
            if want:
                self.poller.register(self.trajectories, zmq.POLLIN)
            else:
                self.poller.unregister(self.trajectories)
            self._poll_traj = want

    def _total_credit(self) -> int:
        return sum(m.credit for m in self.members.values() if m.role == "learner")

    def _drain(self, sock: zmq.Socket, handler) -> None:
        for _ in range(FORWARD_BURST):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                identity, body = P.split_routed(frames)
                handler(identity, body)
            except P.ProtocolError as exc:
                self.counters["control_malformed"] += 1
                self._ratelog.warning("control_malformed", f"dropped a malformed control message: {exc}")

    # ---------------------------------------------------------------- trajectories
    def _forward_trajectories(self) -> None:
        for _ in range(FORWARD_BURST):
            if self._total_credit() <= 0:
                return
            try:
                frames = self.trajectories.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.in_flight += 1
            self.counters["received"] += 1
            nbytes = P.message_nbytes(frames)
            self.counters["bytes_in"] += nbytes
            self._route_trajectory(frames, nbytes)
            self.in_flight -= 1

    def _route_trajectory(self, frames: Sequence[Any], nbytes: int) -> None:
        try:
            msg = P.decode(frames, self.config.max_message_bytes)
            if not isinstance(msg, P.Trajectory):
                raise P.ProtocolError(f"a {msg.KIND} message arrived on the trajectory socket")
        except P.ProtocolError as exc:
            return self._drop("malformed", None, f"dropped a malformed trajectory: {exc}")
        actor = self.members.get(msg.sender)
        if actor is not None:
            actor.last_seen = time.monotonic()
        if msg.run_id != self.run_id:
            return self._drop("unknown_run", actor, f"dropped a trajectory of unknown run {msg.run_id!r} "
                                                    f"from {msg.sender} (current run {self.run_id!r})")
        if msg.policy_version > self.params_version:
            return self._drop("unknown_version", actor, f"dropped a trajectory from {msg.sender} with version "
                                                        f"{msg.policy_version} never published (latest "
                                                        f"{self.params_version})")
        if msg.policy_version < self.params_version - self._max_staleness():
            return self._drop("stale", actor, f"dropped stale data from {msg.sender}: version {msg.policy_version}"
                                              f", latest {self.params_version}")
        while True:
            shard = max((m for m in self.members.values() if m.role == "learner" and m.credit > 0),
                        key=lambda m: m.credit, default=None)
            if shard is None:
                return self._drop("no_route", actor, "dropped a trajectory: no learner shard can take it")
            try:
                self.learners.send_multipart([shard.peer_id.encode(), *frames], copy=False)
            except zmq.ZMQError as exc:  # the shard went away between credit and send
                self._ratelog.warning("shard_gone", f"learner shard {shard.peer_id} unreachable ({exc}); "
                                                    "its credit is withdrawn")
                shard.credit = 0
                continue
            shard.credit -= 1
            shard.counters["messages"] += 1
            shard.counters["bytes"] += nbytes
            self.counters["forwarded"] += 1
            self.counters["bytes_out"] += nbytes
            if actor is not None:
                actor.counters["messages"] += 1
                actor.counters["bytes"] += nbytes
                actor.counters["env_steps"] += msg.env_steps
            return None

    def _max_staleness(self) -> int:
        algo = (self.run_spec or {}).get("algo", {})
        return 0 if algo.get("mode", "sync") == "sync" else int(algo.get("max_staleness", 0))

    def _drop(self, reason: str, member: Member | None, text: str) -> None:
        self.dropped[reason] += 1
        if member is not None:
            member.counters[f"dropped_{reason}"] += 1
        self._ratelog.warning(f"drop_{reason}", text)

    # ---------------------------------------------------------------- control socket
    def _on_control(self, identity: bytes, frames: Sequence[Any]) -> None:
        msg = P.decode(frames, self.config.max_message_bytes)
        member = self.by_identity.get(identity)
        if member is not None:
            member.last_seen = time.monotonic()
        if isinstance(msg, P.Hello):
            self._on_hello(identity, msg)
        elif isinstance(msg, P.StatusRequest):
            self._send(self.control, identity, P.Status(body=self.status()))
        elif member is None:
            self._send(self.control, identity, P.Reject(reason="unknown peer: send hello first", rehello=True))
        elif isinstance(msg, P.Heartbeat):
            member.policy_version = msg.policy_version
            self._maybe_resend_params(member)
        elif isinstance(msg, P.ParamsRequest):
            member.policy_version = max(member.policy_version, msg.have_version)
            self._maybe_resend_params(member, force=True)
        elif isinstance(msg, P.Stats):
            member.stats = msg.stats
        elif isinstance(msg, P.Bye):
            self.log.info(f"{member.role} {member.peer_id} left: {msg.reason or 'bye'}")
            self._remove(member)
        else:
            raise P.ProtocolError(f"{msg.KIND} is not a control message")

    def _on_hello(self, identity: bytes, msg: P.Hello) -> None:
        if msg.role not in ("actor", "learner"):
            raise P.ProtocolError(f"hello with unknown role {msg.role!r}")
        if msg.role == "learner" and msg.run_id and msg.run_id != self.run_id:
            if msg.run is None:
                raise P.ProtocolError("a learner hello for a new run must carry the run spec")
            self._start_run(msg.run_id, msg.run)
        old = self.members.pop(msg.peer_id, None)
        if old is not None:
            self.by_identity.pop(old.identity, None)
        member = Member(peer_id=msg.peer_id, role=msg.role, identity=identity, host=msg.host, pid=msg.pid,
                        num_envs=msg.num_envs)
        if old is not None:
            member.counters = old.counters
        self.members[msg.peer_id] = member
        self.by_identity[identity] = member
        self.log.info(f"{msg.role} {msg.peer_id} joined from {msg.host or '?'} (pid {msg.pid}, {msg.num_envs} envs)")
        self._send(self.control, identity, self._welcome(msg.peer_id))
        if msg.role == "actor":
            self._maybe_resend_params(member, force=True)

    def _start_run(self, run_id: str, run: dict) -> None:
        self.log.info(f"run {run_id!r} starts (previous: {self.run_id or 'none'})")
        self.run_id, self.run_spec = run_id, run
        self.params_frames, self.params_version = None, -1
        for member in self.members.values():  # actors waiting without a run (or on an old one) get it now
            if member.role == "actor":
                self._send(self.control, member.identity, self._welcome(member.peer_id))

    def _welcome(self, peer_id: str) -> P.Welcome:
        c = self.config
        return P.Welcome(peer_id=peer_id, run_id=self.run_id, run=self.run_spec,
                         ports={k: v for k, v in self.ports.items() if k != "control"},
                         heartbeat_interval_s=c.heartbeat_interval_s, heartbeat_liveness=c.heartbeat_liveness,
                         max_message_bytes=c.max_message_bytes)

    def _maybe_resend_params(self, member: Member, force: bool = False) -> None:
        """Late joiners and subscribers that missed a PUB get the cached version directly."""
        if member.role != "actor" or self.params_frames is None or member.policy_version >= self.params_version:
            return
        now = time.monotonic()
        if not force and now - member.last_snapshot < self.config.heartbeat_interval_s:
            return
        member.last_snapshot = now
        self._send_frames(self.control, member.identity, self.params_frames)
        self.counters["params_snapshots"] += 1

    # ---------------------------------------------------------------- learner socket
    def _on_learner(self, identity: bytes, frames: Sequence[Any]) -> None:
        # Shards' data DEALERs use their peer id as ZeroMQ identity (their control link does not).
        member = self.members.get(identity.decode("utf-8", "replace"))
        try:
            msg = P.decode(frames, self.config.max_message_bytes)
        except P.ProtocolError as exc:
            self.counters["params_malformed"] += 1
            self._ratelog.warning("learner_malformed", f"dropped a malformed message from a learner: {exc}")
            return
        if member is None or member.role != "learner":
            self._send(self.learners, identity, P.Reject(reason="unknown learner: send hello first", rehello=True))
            return
        member.last_seen = time.monotonic()
        if isinstance(msg, P.Credit):
            if msg.credit <= 0 or msg.credit > 1 << 20:
                raise P.ProtocolError(f"credit must be in 1..2**20, got {msg.credit}")
            member.credit += msg.credit
        elif isinstance(msg, P.Parameters):
            self._on_params(member, msg, frames)
        else:
            raise P.ProtocolError(f"{msg.KIND} is not a learner-socket message")

    def _on_params(self, member: Member, msg: P.Parameters, frames: Sequence[Any]) -> None:
        if msg.run_id != self.run_id:
            self.counters["params_unknown_run"] += 1
            self._ratelog.warning("params_run", f"ignored parameters of run {msg.run_id!r} (current {self.run_id!r})")
            return
        if msg.policy_version <= self.params_version:
            self.counters["params_stale"] += 1
            self._ratelog.warning("params_stale", f"ignored parameters version {msg.policy_version}: "
                                                  f"{self.params_version} is already published")
            return
        self.params_frames, self.params_version = list(frames), msg.policy_version
        member.policy_version = msg.policy_version
        self.params.send_multipart(self.params_frames, copy=False)
        self.counters["params_published"] += 1
        self.counters["params_bytes"] += P.message_nbytes(frames)

    # ---------------------------------------------------------------- liveness
    def _send_heartbeats(self) -> None:
        for member in list(self.members.values()):
            self._send(self.control, member.identity, P.Heartbeat(peer_id="broker", policy_version=self.params_version))

    def _purge_expired(self, now: float) -> None:
        limit = self.config.heartbeat_interval_s * self.config.heartbeat_liveness
        for member in list(self.members.values()):
            if now - member.last_seen > limit:
                self.log.warning(f"{member.role} {member.peer_id} expired: silent for {now - member.last_seen:.1f} s")
                self._remove(member)

    def _remove(self, member: Member) -> None:
        self.members.pop(member.peer_id, None)
        self.by_identity.pop(member.identity, None)
        self.counters["expired_or_left"] += 1

    def _send(self, sock: zmq.Socket, identity: bytes, msg: P.Message) -> None:
        self._send_frames(sock, identity, P.encode(msg))

    def _send_frames(self, sock: zmq.Socket, identity: bytes, frames: Sequence[Any]) -> None:
        try:
            sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # peer gone or its queue is full: it will reconnect or re-ask
            self.counters["control_unroutable"] += 1

    # ---------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        c = self.counters
        dropped = sum(self.dropped.values())
        return {
            "broker": {"uptime_s": round(now - self.started, 3), "host": socket.gethostname(), "run_id": self.run_id,
                       "policy_version": self.params_version, "ports": self.ports,
                       "received": c["received"], "forwarded": c["forwarded"], "dropped": dict(self.dropped),
                       "in_flight": self.in_flight, "bytes_in": c["bytes_in"], "bytes_out": c["bytes_out"],
                       "accounted": c["received"] == c["forwarded"] + dropped + self.in_flight,
                       **{k: v for k, v in c.items() if k not in ("received", "forwarded", "bytes_in", "bytes_out")}},
            "members": {pid: m.row(now) for pid, m in self.members.items()},
        }
