"""A relay: a broker whose learner is another broker (``zddrl broker --upstream tcp://ROOT:PORT``).

Actors join a relay exactly as they join a root broker (same protocol, same welcome, same credit). The relay:

* takes its run from its upstream's welcome (the run spec and its signature, passed on untouched) and welcomes
  its actors into it; it takes no learners;
* forwards each admitted trajectory upstream on one PUSH, frames untouched (peer id, run id and version are the
  actor's), with credit end to end: it holds ``window`` unacknowledged at most, and reads its actors' socket only
  while it has credit left, so a learner that stops reading stops the root, the root stops acknowledging, the
  relay stops reading, and its actors block in their own window. Every trajectory read is forwarded or dropped
  with a reason: ``received == forwarded + dropped + in_flight`` holds here as at any broker;
* subscribes to its upstream's parameter versions, checks them as its own learners' would be checked
  (``publisher.Publisher``: every hash, and the signature against its pinned learner keys on a closed bus), and
  publishes and caches them for its actors (a late joiner gets the newest version from the relay);
* reports its subtree upstream (subtree messages: its actors, before each is welcomed, and its counters), so
  that the root's fleet message and ``zddrl status`` count the relay's actors (broker/subtree.py).

The upstream session itself (sockets, heartbeats, silence, fallback list) is ``uplink.Uplink``; this module is the
relay's side of the broker loop (``Broker._serve_upstream``, ``_joined``, ``_forget``).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import zmq

from zddrl import keys
from zddrl import protocol as P
from zddrl.broker.broker import Broker
from zddrl.broker.membership import Member, credit_batch_of, staleness_of
from zddrl.broker.routing import FORWARD_BURST, Router
from zddrl.broker.uplink import Uplink
from zddrl.config import AlgoConfig, BrokerConfig
from zddrl.transport import signatures as signing
from zddrl.transport.io import NOBLOCK, recv_frames, send_frames
from zddrl.transport.link import BYE_LINGER_MS

WINDOW_PER_ACTOR_WINDOWS = 2
"""The automatic upstream window is this many times the sum of the relay's actors' windows."""
REFUSED_LEARNER = "a relay takes no learners or replays: connect them to the root broker"


class RelayRefused(RuntimeError):
    """The upstream broker refused the relay's hello (the message says why); retrying would not help."""


class UpstreamRouter(Router):
    """The relay's data path: an admitted trajectory goes upstream while the relay holds credit."""

    uplink: Uplink | None = None

    def _deliver(self, frames: Sequence[Any], nbytes: int, actor: Member | None, env_steps: int) -> None:
        up = self.uplink
        if up is None or up.push is None or self.credit <= 0:
            self.drop("no_route", actor, "dropped a trajectory: no upstream session with credit")
            return
        try:
            send_frames(up.push, frames, NOBLOCK)
        except zmq.ZMQError as exc:  # no high-water mark on this socket: not expected, but never lost silently
            self.drop("no_route", actor, f"dropped a trajectory: the upstream socket refused it ({exc})")
            return
        up.sent += 1
        self.credit -= 1
        self.forwarded(nbytes, actor, env_steps)


def max_in_flight_of(run: dict) -> int:
    """An actor's window in the run (algo.max_in_flight; credit_batch_of has checked it)."""
    algo = run.get("algo", {}) if isinstance(run, dict) else {}
    limit = algo.get("max_in_flight", AlgoConfig.max_in_flight) if isinstance(algo, dict) else 1
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1 else 1


class Relay(Broker):
    """``Relay(config).bind()`` then ``run(stop)``, ``close()`` in a finally, as a Broker; ``config.upstream`` set.

    ``credentials``: the relay's client keys towards its upstream on a closed bus (docs/security.md)."""

    ROUTER = UpstreamRouter
    router: UpstreamRouter

    def __init__(
        self, config: BrokerConfig, context: zmq.Context | None = None, credentials: keys.Credentials | None = None
    ) -> None:
        super().__init__(config, context)
        self.log = self.log.bind(role="relay")
        self.credentials = credentials
        self.uplink: Uplink | None = None
        self._subtree_seq = 0
        self._actor_window = AlgoConfig.max_in_flight

    def bind(self) -> dict[str, int]:
        ports = super().bind()
        peer_id = f"relay-{socket.gethostname()}-{ports['control']}"
        hello = P.Hello(role="relay", peer_id=peer_id, host=socket.gethostname(), pid=os.getpid())
        self.uplink = Uplink(self.config.upstream, hello, self.ctx, self.credentials)
        self.router.uplink = self.uplink
        self.log.info(f"relay {peer_id}: upstream {self.config.upstream}")
        return ports

    def close(self) -> None:
        up = self.uplink
        if up is not None and up.control is not None:
            up.send(P.Bye(peer_id=up.hello.peer_id, reason="relay stopping"))
            up.close(time.monotonic(), linger_ms=BYE_LINGER_MS)
        super().close()

    @property
    def window(self) -> int:
        """Trajectories the relay may have pushed upstream and not had acknowledged (BrokerConfig.upstream_window)."""
        auto = WINDOW_PER_ACTOR_WINDOWS * self._actor_window * max(1, len(self.fleet))
        return self.config.upstream_window or auto

    # ---------------------------------------------------------------- the broker loop's hooks
    def _serve_upstream(self, events: dict) -> None:
        up = self.uplink
        assert up is not None, "bind() first"
        now = time.monotonic()
        if up.control is None:
            if now >= up.reopen_at:
                self.poller.register(up.open(now), zmq.POLLIN)
        else:
            if up.control in events:
                self._drain_upstream(up.control, now)
            if up.sub is not None and up.sub in events:
                self._drain_upstream(up.sub, now)
            if up.control is not None and now >= up.next_beat:
                up.send(P.Heartbeat(peer_id=up.hello.peer_id, policy_version=self.publisher.version))
                self._report(full=True)
                up.next_beat = now + up.interval_s
            if up.control is not None and now > up.deadline:
                self._end_session(now, "silent")
        # Credit only within a session of this relay's run: what is pushed to another run is dropped upstream.
        live = up.push is not None and up.welcome is not None and bool(self.run_id) and up.welcome.run_id == self.run_id
        self.router.credit = max(0, self.window - up.in_flight) if live else 0

    def _joined(self, member: Member) -> None:
        if member.role == "actor":  # upstream learns of it before it can send anything (it is welcomed next)
            self._report(full=False, actors={member.peer_id: _entry(member)})

    def _forget(self, member: Member) -> None:
        super()._forget(member)
        if member.role == "actor":
            self._report(full=False, left=[member.peer_id])

    def _hello_refused(self, identity: bytes, msg: P.Hello, user: str) -> bool:
        if msg.role in ("learner", "replay"):  # the data's end belongs at the root
            self.counters["learner_refused"] += 1
            self._ratelog.warning("learner_refused", f"refused learner {msg.peer_id}: {REFUSED_LEARNER}")
            self._send(self.control, identity, P.Reject(reason=f"{P.REFUSED_PREFIX}{REFUSED_LEARNER}"))
            return True
        return super()._hello_refused(identity, msg, user)

    # ---------------------------------------------------------------- upstream messages
    def _drain_upstream(self, sock: zmq.Socket, now: float) -> None:
        for _ in range(FORWARD_BURST):
            if self.uplink is None or self.uplink.control is None:
                return  # the session ended (a refusal) while draining
            try:
                frames = recv_frames(sock, NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._decode(frames)
            except P.ProtocolError as exc:
                self.counters["upstream_malformed"] += 1
                self._ratelog.warning("upstream_malformed", f"dropped a malformed message from upstream: {exc}")
                continue
            if sock is self.uplink.control:
                self.uplink.beat_heard(now)
            try:
                self._on_upstream(msg, frames, now)
            except RelayRefused:
                raise
            except Exception as exc:  # noqa: BLE001
                # Whatever the upstream sends (a welcome without a port, say), the relay keeps serving its actors.
                self.counters["upstream_errors"] += 1
                self._ratelog.warning(
                    "upstream_error", f"error handling a {msg.KIND} from upstream ({type(exc).__name__}: {exc})"
                )

    def _on_upstream(self, msg: P.Message, frames: Sequence[Any], now: float) -> None:
        up = self.uplink
        assert up is not None
        if isinstance(msg, (P.Parameters, P.ParamChunk)):
            self._on_upstream_params(msg, frames)
        elif isinstance(msg, P.Credit):
            if 0 < msg.credit <= 1 << 20:
                up.credit(msg.credit)
            else:
                self.counters["upstream_malformed"] += 1
        elif isinstance(msg, P.Welcome):
            self._on_upstream_welcome(msg, now)
        elif isinstance(msg, P.Heartbeat):
            up.heard_interval(msg.interval_s, now)
        elif isinstance(msg, P.Reject):
            self.log.warning(f"upstream rejected us: {msg.reason}")
            if msg.reason.startswith(P.REFUSED_PREFIX):
                raise RelayRefused(f"the upstream broker at {up.brokers.current} refused this relay: {msg.reason}")
            if msg.rehello:
                up.send(up.hello)
        # any message keeps the session alive (beat_heard); fleet and status messages are not for a relay

    def _on_upstream_welcome(self, welcome: P.Welcome, now: float) -> None:
        up = self.uplink
        assert up is not None
        if up.sub is not None:
            self.poller.unregister(up.sub)
        self.poller.register(up.welcomed(welcome, now), zmq.POLLIN)
        at = f" at {up.brokers.current}" if len(up.brokers) > 1 else ""
        self.log.info(f"welcomed by the upstream broker{at}: run {welcome.run_id or '(none yet)'}")
        if welcome.run_id and welcome.run is not None and welcome.run_id != self.run_id:
            why = ""
            if self.guard.pins is not None:
                why = signing.run_refusal(
                    welcome.run_id, welcome.run, welcome.run_signer, welcome.run_signature, self.guard.pins
                )
            try:
                staleness, credit_batch = staleness_of(welcome.run), credit_batch_of(welcome.run)
            except P.ProtocolError as exc:
                why = why or str(exc)
            if why:
                self.counters["runs_refused"] += 1
                self.log.error(f"upstream run {welcome.run_id!r} refused: {why}")
            else:
                self.run_seal = (welcome.run_signer, welcome.run_signature)
                self._actor_window = max_in_flight_of(welcome.run)
                self._start_run(welcome.run_id, welcome.run, staleness, credit_batch)
        self._report(full=True)

    def _on_upstream_params(self, msg: P.Parameters | P.ParamChunk, frames: Sequence[Any]) -> None:
        """A version's message from upstream: published on to the actors once checked (Publisher.add), as a learner's
        would be; on a closed bus its head must be signed by the run's learner."""
        if self.auth is not None and isinstance(msg, P.Parameters) and msg.signer != self.run_seal[0]:
            self.counters["params_signature"] += 1
            self._ratelog.warning(
                "params_signature", f"dropped version {msg.policy_version}: signed by {msg.signer!r}, not the run's"
            )
            return
        if msg.run_id == self.run_id and msg.policy_version <= self.publisher.version:
            # A snapshot of what the PUB brought already (the upstream sends one after each hello): not news.
            self.counters["upstream_params_held"] += 1
            return
        if self.publisher.add(msg, frames, self.run_id):
            self.policy_version = self.publisher.version
            self.health.published(self.policy_version, self.publisher.cache.param_hash)

    def _end_session(self, now: float, why: str) -> None:
        up = self.uplink
        assert up is not None and up.control is not None
        for sock in (up.control, up.sub):
            if sock is not None:
                self.poller.unregister(sock)
        silent = up.brokers.current
        wait_s = up.close(now)
        self.log.warning(f"upstream {why}: " + up.brokers.moving(silent, wait_s))

    # ---------------------------------------------------------------- reports
    def _report(self, full: bool, actors: dict[str, dict] | None = None, left: Sequence[str] = ()) -> None:
        """A subtree message upstream (only within a session: the full report after the next welcome catches up)."""
        up = self.uplink
        if up is None or up.welcome is None:
            return
        versions: dict[str, int] = {}
        if full:
            joined = [m for m in self.members.values() if m.role == "actor"]
            actors = {m.peer_id: _entry(m) for m in joined}
            versions = {m.peer_id: m.policy_version for m in joined}
        self._subtree_seq += 1
        msg = P.Subtree(
            peer_id=up.hello.peer_id,
            seq=self._subtree_seq,
            full=full,
            actors=actors or {},
            left=list(left),
            counters=self.accounting(),
            versions=versions,
        )
        up.send(msg)

    def accounting(self) -> dict[str, int]:
        """The relay's trajectory counters, as its subtree reports carry them."""
        r, c = self.router, self.counters
        up = self.uplink
        return {
            "received": c["received"],
            "forwarded": c["forwarded"],
            "in_flight": r.in_flight,
            **{f"dropped_{k}": v for k, v in r.dropped.items()},
            "upstream_acked": up.acked_total if up is not None else 0,
            "upstream_in_flight": up.in_flight if up is not None else 0,
            "upstream_lost": up.lost if up is not None else 0,
            "window": self.window,
            "health_warnings": sum(self.health.counts().values()),
        }

    def upstream_status(self) -> dict[str, Any] | None:
        if self.uplink is None:
            return None
        return {**self.uplink.status(), "peer_id": self.uplink.hello.peer_id, "window": self.window}


def _entry(member: Member) -> dict[str, Any]:
    return {"num_envs": member.num_envs, "host": member.host, "pid": member.pid}
