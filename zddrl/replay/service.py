"""`zddrl replay`: a replay service on the bus, for runs with ``replay.placement = "service"`` (apex, sac).

One process, one thread, three sockets:

* the **control link** to the broker (``BrokerLink``, role ``replay``): the broker welcomes it with the current run
  and again whenever a new run starts (a learner started or restarted); the run spec is judged as an actor judges
  it (``transport.trust.joinable``: signed by a pinned learner key on a closed bus, an env id it may build);
* a **data channel** on the broker's learners socket (``DataChannel``): credit out, the run's trajectories in. The
  learner of a service run grants no credit, so the broker routes all of the run's data to the replays, by credit
  like shards. The replay reads it only while the env steps it inserted stay below the ``allow_steps`` of the last
  request, and not before a learner of the run has asked (its request also tells the newest policy version, which
  bounds the versions a trajectory may carry): the replay ratio is enforced where the data enters, and the actors
  wait on credit meanwhile;
* its **own ROUTER** (``--bind``), where learner shards send ``replay_sample`` and get ``replay_batch`` back
  (docs/protocol.md section 5.9). On a closed bus it is a CURVE server with the replay's key pair and admits
  learner keys only (ZAP against ``KEYS/learners/``).

The buffer and its books are ``store.ReplayStore``. With ``--state-dir`` the buffer is saved every
``--save-every-s`` seconds and at a clean stop, and loaded at start: a replay killed and started again with the
same directory serves what it held at its last save. No remote party chooses code here: messages are decoded by
``zddrl.protocol`` (never unpickled) and a malformed one is counted and dropped.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.auth.thread
from loguru import logger

from zddrl import keys
from zddrl import protocol as P
from zddrl.algos.spec import algorithm_of
from zddrl.config import Config
from zddrl.envs import EnvError, probe_spec
from zddrl.intake.window import stream_window
from zddrl.logs import RateLimitedLog
from zddrl.proc import rss_mb
from zddrl.replay.store import ReplayStore
from zddrl.transport.channel import DataChannel
from zddrl.transport.io import NOBLOCK, recv_frames
from zddrl.transport.link import BrokerLink, hello_fields
from zddrl.transport.trust import joinable

POLL_MS = 20
STATS_EVERY_S = 1.0
ZAP_DOMAIN = "replay"
"""The ZAP domain of a replay's own socket (pyzmq's authenticator matches it exactly: "*" is not a wildcard)."""
INTAKE_BURST = 64
"""Trajectories taken in per wake-up at most, so that learners' requests are answered between them."""


class ReplayService:
    """``ReplayService(connect, bind, peer_id).run(stop)``; ``port`` is the bound port once ``run`` has bound it."""

    def __init__(
        self,
        connect: str,
        bind: str,
        peer_id: str = "replay-0",
        *,
        context: zmq.Context | None = None,
        credentials: keys.Credentials | None = None,
        learner_keys: Path | None = None,
        allowed_code: frozenset[str] = frozenset(),
        state_dir: Path | None = None,
        save_every_s: float = 60.0,
    ) -> None:
        self.connect, self.bind, self.peer_id = connect, bind, peer_id
        self.ctx = context or zmq.Context.instance()
        self.credentials, self.learner_keys, self.allowed_code = credentials, learner_keys, allowed_code
        self.save_every_s = save_every_s
        self.log = logger.bind(role="replay", peer=peer_id)
        self.store = ReplayStore(peer_id, state_dir, self.log)
        self.run_id = ""
        self.config: Config | None = None
        self.generation = 0
        self.channel: DataChannel | None = None
        self.allow = 0
        """Take in trajectories while ``store.inserted`` is below this (the last request's ``allow_steps``)."""
        self.port = 0
        self.bound = threading.Event()
        self.counters = {"malformed": 0, "other_run": 0, "requests": 0}
        self._ratelog = RateLimitedLog()
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None

    # ---------------------------------------------------------------- main loop
    def run(self, stop: threading.Event) -> dict[str, Any]:
        link = BrokerLink(
            self.connect,
            P.Hello(role="replay", peer_id=self.peer_id, **hello_fields()),
            context=self.ctx,
            credentials=self.credentials,
        ).start()
        server = self._open_server()
        next_stats = next_save = time.monotonic()
        next_save += self.save_every_s
        try:
            while not stop.is_set():
                if link.refused:
                    raise RuntimeError(f"the broker refused this replay: {link.refused}")
                self._follow(link)
                self._wait(server)
                self._answer(server, link)
                self._take_in(link)
                now = time.monotonic()
                if now >= next_stats:
                    stats = {**self.store.stats(), **self.counters, "rss_mb": rss_mb(), "allow_steps": self.allow}
                    link.send(P.Stats(peer_id=self.peer_id, role="replay", stats=stats))
                    self._reload_learner_keys()
                    next_stats = now + STATS_EVERY_S
                if now >= next_save:
                    self._save()
                    next_save = now + self.save_every_s
        finally:
            self._save()
            server.close(linger=0)
            if self.channel is not None:
                self.channel.close()
            if self._auth is not None:
                self._auth.stop()
            link.close(reason="replay stopped")
        return self.store.stats()

    def _open_server(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.credentials is not None:  # CURVE server with this replay's pair; ZAP admits learner keys only
            if self.learner_keys is None:
                raise ValueError("a replay on a closed bus needs the learners' key folder (learner_keys)")
            self._auth = zmq.auth.thread.ThreadAuthenticator(self.ctx)
            self._auth.start()
            self._reload_learner_keys()
            sock.zap_domain = ZAP_DOMAIN.encode()
            sock.curve_server = True
            sock.curve_secretkey = self.credentials.client.secret
            sock.curve_publickey = self.credentials.client.public
        if self.bind.startswith("ipc://"):  # a local run's: a file in its owner-only bus directory, no port
            sock.bind(self.bind)
            self.port = 0
        elif self.bind.rsplit(":", 1)[-1] in ("0", "*"):
            self.port = sock.bind_to_random_port(self.bind.rsplit(":", 1)[0])
        else:
            sock.bind(self.bind)
            self.port = int(self.bind.rsplit(":", 1)[-1])
        self.bound.set()
        where = f"port {self.port}" if self.port else self.bind
        self.log.info(f"replay {self.peer_id} serving learners on {where}, broker {self.connect}")
        return sock

    def _reload_learner_keys(self) -> None:
        """Admit the learner keys now in ``KEYS/learners/`` (a key removed there is refused from the next
        handshake on; connections made stay, as at the broker)."""
        if self._auth is not None and self.learner_keys is not None:
            self._auth.configure_curve(domain=ZAP_DOMAIN, location=str(self.learner_keys))

    # ---------------------------------------------------------------- runs
    def _follow(self, link: BrokerLink) -> None:
        """After every welcome: adopt a new run (or stop serving one this replay cannot), then credit again."""
        if link.generation == self.generation or link.welcome is None:
            return
        self.generation = link.generation
        welcome = link.welcome
        if welcome.run_id != self.run_id:
            self.run_id = welcome.run_id
            self._adopt(welcome)
        if self.config is None:
            return
        window = stream_window(self.config)  # about a batch: data queued here is older when it is taken in
        if self.channel is None:
            self.channel = DataChannel(link, self.peer_id, welcome.max_message_bytes, window)
        elif link.endpoint("learners") == self.channel.endpoint and link.data_identity == self.channel.identity:
            self.channel.regrant(link.generation, window)
        else:
            self.channel.close()
            self.channel = DataChannel(link, self.peer_id, welcome.max_message_bytes, window)

    def _adopt(self, welcome: P.Welcome) -> None:
        config, why = joinable(welcome, self.credentials, self.allowed_code) if welcome.run else (None, "no run yet")
        if config is not None and (not algorithm_of(config).replay or config.replay.placement != "service"):
            why = f"algorithm {config.algo.name!r} with replay.placement {config.replay.placement!r}"
            config = None
        spec = None
        if config is not None:
            try:
                spec = probe_spec(config.env)
            except EnvError as exc:
                config, why = None, str(exc)
        if config is None or spec is None:
            self.config = None
            if self.channel is not None:  # no credit for a run this replay does not serve
                self.channel.close()
                self.channel = None
            self.log.info(f"not serving run {welcome.run_id or '(none)'}: {why}; waiting for a replay run")
            return
        self.config = config
        self.log.info(f"run {welcome.run_id}: {self.store.adopt(config, spec)}")
        self.allow = self.store.inserted  # closed until a learner of the run asks (and says its policy version)

    # ---------------------------------------------------------------- sockets
    def _intake_open(self) -> bool:
        return self.channel is not None and self.config is not None and self.store.inserted < self.allow

    def _wait(self, server: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(server, zmq.POLLIN)
        if self._intake_open():
            assert self.channel is not None
            poller.register(self.channel.sock, zmq.POLLIN)
        poller.poll(POLL_MS)

    def _answer(self, server: zmq.Socket, link: BrokerLink) -> None:
        """Every request waiting on the ROUTER, in order."""
        while True:
            try:
                frames = recv_frames(server, NOBLOCK)
            except zmq.Again:
                return
            try:
                identity, body = P.split_routed(frames)
                msg = P.decode(body)
                if not isinstance(msg, P.ReplaySample):
                    raise P.ProtocolError(f"a replay answers replay_sample only, not {msg.KIND}")
            except P.ProtocolError as exc:
                self.counters["malformed"] += 1
                self._ratelog.warning("malformed", f"dropped a malformed request: {exc} ({self.counters['malformed']})")
                continue
            if msg.run_id != self.run_id:
                self._follow(link)  # a learner's first request may come before the welcome of its run is read
            if self.config is None or msg.run_id != self.run_id:
                self.counters["other_run"] += 1
                self._ratelog.warning("other_run", f"ignored a request of run {msg.run_id!r} (serving {self.run_id!r})")
                continue
            self.counters["requests"] += 1
            if msg.report:  # the main learner shard's request says how much more to take in
                self.allow = msg.allow_steps
            reply = self.store.serve(msg, self.run_id)
            server.send_multipart([identity, *P.encode(reply)], copy=False)

    def _take_in(self, link: BrokerLink) -> None:
        for _ in range(INTAKE_BURST):
            if not self._intake_open():
                return
            assert self.channel is not None
            msg = self.channel.recv(0)
            if msg is None:
                return
            if not isinstance(msg, P.Trajectory):
                continue
            self.channel.ack()
            if msg.run_id != self.run_id:
                self.counters["other_run"] += 1
                continue
            self.store.take_in(msg, link.fleet())

    def _save(self) -> None:
        try:
            path = self.store.save()
        except OSError as exc:
            self.log.error(f"could not save the replay state: {exc}")
            return
        if path is not None:
            self.log.debug(f"replay state saved to {path}")
