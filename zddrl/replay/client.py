"""A learner shard's side of the replay services (``replay.placement = "service"``; the services:
``service.py``).

``RemoteReplay`` is the ``ReplaySource`` the replay algorithms' gradient steps sample from (``algos.replay_learner``).
It holds one DEALER per replay endpoint (``zddrl learner --replay tcp://H:P,...``) and speaks ``replay_sample`` /
``replay_batch`` with each (docs/protocol.md section 5.9):

* **One batch from several replays, weighted exactly.** A batch of ``B`` is split over the replays in proportion
  to their priority mass (largest remainders), each draws its part from its own sum-tree, and the importance
  weights are computed here over all of them: ``w_i = (p_i / p_min)^-beta`` with ``p_min`` the smallest priority
  any replay holds, ``beta`` annealed by this learner's own sample count (Schaul et al. 2016). The split uses
  each replay's mass as of its last answer, so it is exact up to one step's drift.
* **Priority updates** of a batch go back with the next request to the replay that served each row.
* **Intake and the replay ratio.** Every answer carries the replay's ``inserted`` counter; ``intake()`` is the sum
  of their increases since the last call. Every request carries ``allow_steps``: the replay may take in
  ``room / K`` more env steps (``room``: what the batch being collected still lacks; 0 while the learner takes
  its gradient steps), so intake stops while the learner trains, as it does with the local buffer.
* **A replay that does not answer** within ``REPLY_TIMEOUT_S`` is left out of batches (its pending priority
  updates dropped and counted) and asked again at every ``refresh``; a batch is drawn from the replays that
  answer, and when none does the gradient step is skipped and counted (``missed_batches``): a replay restart costs
  the learner a few seconds, not its run. Answers to an earlier request are ignored.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import numpy as np
import zmq

from zddrl import keys
from zddrl import protocol as P
from zddrl.algos.replay_buffer.prioritized import TransitionBatch
from zddrl.config import Config
from zddrl.envs import EnvSpec
from zddrl.logs import RateLimitedLog

REPLY_TIMEOUT_S = 5.0
"""How long a sample waits for a replay's answer before it draws its batch without that replay."""
REFRESH_TIMEOUT_S = 0.5
"""How long a figures-only request waits (a replay that is not there must not hold up collecting for long)."""


class Report(NamedTuple):
    """What the replays took in since the last report (the main shard's ledger counts it)."""

    env_steps: int
    trajectories: int
    invalid: int
    returns: list[float]


class _Peer:
    """One replay: its socket, its last answer, the priority updates it is owed."""

    def __init__(self, sock: zmq.Socket, endpoint: str) -> None:
        self.sock, self.endpoint = sock, endpoint
        self.last: P.ReplayBatch | None = None
        self.seen_inserted: int | None = None
        self.ids: list[np.ndarray] = []
        self.td: list[np.ndarray] = []
        self.alive = True

    def updates(self) -> dict[str, np.ndarray]:
        if not self.ids:
            return {}
        arrays = {"ids": np.concatenate(self.ids), "td_errors": np.concatenate(self.td).astype(np.float32)}
        self.ids, self.td = [], []
        return arrays


class RemoteReplay:
    """``refresh()`` asks every replay for its figures; ``sample(B)`` draws a batch; the rest is ``ReplaySource``."""

    def __init__(
        self,
        endpoints: list[str],
        config: Config,
        spec: EnvSpec,
        run_id: str,
        peer_id: str,
        *,
        context: zmq.Context | None = None,
        credentials: keys.Credentials | None = None,
        replay_public: bytes = b"",
        report: bool = True,
        prefetch: bool = True,
    ) -> None:
        if not endpoints:
            raise ValueError("replay.placement = 'service' needs at least one replay endpoint (--replay)")
        self.config, self.spec, self.run_id, self.peer_id, self.report = config, spec, run_id, peer_id, report
        self._ratelog = RateLimitedLog()
        ctx = context or zmq.Context.instance()
        self.peers = [_Peer(self._socket(ctx, e, credentials, replay_public), e) for e in endpoints]
        self.request = 0
        self.policy_version = 0
        self.rollout_len = config.env.rollout_len
        self.room = config.replay.learning_starts + config.algo.batch_size
        """Env steps the learner wants the replays to take in now (split over them in ``allow_steps``)."""
        self.drop_before = -1
        self.samples = 0
        self.newest_version = -1
        self._reports: list[Report] = []
        self._intake = 0
        self.taken = 0
        """Env steps the replays took in since this learner started (what a service batch is collected by)."""
        self._pending_rows: list[tuple[_Peer, int]] = []
        """The last batch's rows per replay, in order: where its priority updates go."""
        self.counters = {"timeouts": 0, "unreachable": 0, "updates_dropped": 0, "bad_answers": 0, "missed_batches": 0}
        self.prefetch = prefetch
        self._ahead: tuple[int, list[_Peer], int] | None = None
        """The batch asked for ahead: its request id, the replays it reached and its size."""
        self._early: dict[_Peer, P.ReplayBatch] = {}
        """Answers to the batch asked ahead that came while another answer was awaited."""

    @staticmethod
    def _socket(ctx: zmq.Context, endpoint: str, credentials: keys.Credentials | None, server: bytes) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)  # a replay that is gone holds at most 4 requests; then a send fails at once
        if credentials is not None:
            sock.curve_secretkey = credentials.client.secret
            sock.curve_publickey = credentials.client.public
            sock.curve_serverkey = server
        sock.connect(endpoint)
        return sock

    def close(self) -> None:
        for peer in self.peers:
            peer.sock.close(linger=0)

    # ---------------------------------------------------------------- the conversation
    def _send(self, batches: dict[_Peer, int]) -> tuple[int, list[_Peer]]:
        """One request to each replay of ``batches`` (with the priority updates it is owed): its id and whom it
        reached."""
        self.request += 1
        live = [p for p in self.peers if p.alive] or self.peers
        share = math.ceil(max(0, self.room) / max(1, len(live)))
        sent: list[_Peer] = []
        for peer, batch in batches.items():
            inserted = peer.last.inserted if peer.last is not None else 0
            msg = P.ReplaySample(
                run_id=self.run_id,
                peer_id=self.peer_id,
                request=self.request,
                batch=batch,
                allow_steps=inserted + share,
                policy_version=self.policy_version,
                rollout_len=self.rollout_len,
                drop_before=self.drop_before,
                report=self.report,
                arrays=peer.updates(),
            )
            try:
                peer.sock.send_multipart(P.encode(msg), zmq.NOBLOCK, copy=False)
                sent.append(peer)
            except zmq.Again:  # its queue is full (gone, or never connected): the updates it was owed are lost
                self._lost(peer, len(msg.arrays.get("ids", ())))
                self.counters["unreachable"] += 1
                self._ratelog.warning(
                    f"unreachable {peer.endpoint}",
                    f"replay {peer.endpoint} takes no requests: not connected (down, or on a closed bus its CURVE "
                    f"handshake failed: check --replay-key and that KEYS/learners/ there holds this learner's key)"
                    f" ({self.counters['unreachable']} requests)",
                )
        return self.request, sent

    def _answers(self, request: int, sent: list[_Peer], timeout_s: float) -> dict[_Peer, P.ReplayBatch]:
        """The answers to ``request`` (up to ``timeout_s``); an answer to the batch asked ahead is kept for it."""
        got = {peer: msg for peer, msg in self._early.items() if msg.request == request}
        self._early = {peer: msg for peer, msg in self._early.items() if msg.request != request}
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        for peer in sent:
            poller.register(peer.sock, zmq.POLLIN)
        while len(got) < len(sent):
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0:
                break
            for sock, _ in poller.poll(int(left_ms) + 1):
                peer = next(p for p in sent if p.sock is sock)
                answer = self._read(peer)
                if answer is not None and answer.request == request:
                    got[peer] = answer
                elif answer is not None and self._ahead is not None and answer.request == self._ahead[0]:
                    self._early[peer] = answer
        for peer in sent:
            peer.alive = peer in got
            if peer not in got:
                self.counters["timeouts"] += 1
                self._ratelog.warning(
                    f"timeout {peer.endpoint}",
                    f"replay {peer.endpoint} did not answer within {timeout_s:g} s: left out of batches until it does"
                    f" ({self.counters['timeouts']} timeouts)",
                )
        return got

    def _read(self, peer: _Peer) -> P.ReplayBatch | None:
        """The answer waiting on ``peer``'s socket, its intake taken into account; None if it is unusable."""
        try:
            msg = P.decode(peer.sock.recv_multipart(zmq.NOBLOCK, copy=False))
            if not isinstance(msg, P.ReplayBatch):
                raise P.ProtocolError(f"a replay answers with replay_batch, not {msg.KIND}")
            if msg.arrays and msg.arrays["obs"].shape[1:] != self.spec.obs_shape:
                raise P.ProtocolError(f"observations of shape {list(msg.arrays['obs'].shape[1:])}")
        except (zmq.Again, P.ProtocolError) as exc:
            self.counters["bad_answers"] += int(not isinstance(exc, zmq.Again))
            return None
        # Counted whatever request it answers: its report and counters are the replay's since its last answer.
        if peer.seen_inserted is None or msg.inserted < peer.seen_inserted:
            peer.seen_inserted = msg.inserted  # first answer, or a replay restarted: nothing new counted
        self._intake += msg.inserted - peer.seen_inserted
        self.taken += msg.inserted - peer.seen_inserted
        peer.seen_inserted = msg.inserted
        self.newest_version = max(self.newest_version, msg.newest_version)
        if self.report:
            self._reports.append(Report(msg.env_steps, msg.trajectories, msg.invalid, list(msg.ep_returns)))
        peer.last = msg
        return msg

    def _lost(self, peer: _Peer, n: int) -> None:
        peer.alive = False
        self.counters["updates_dropped"] += n
        peer.ids, peer.td = [], []

    def refresh(self, timeout_s: float = REFRESH_TIMEOUT_S) -> None:
        """Ask every replay for its figures (and the intake report), no batch."""
        self._answers(*self._send({peer: 0 for peer in self.peers}), timeout_s)

    def take_reports(self) -> Report:
        reports, self._reports = self._reports, []
        return Report(
            sum(r.env_steps for r in reports),
            sum(r.trajectories for r in reports),
            sum(r.invalid for r in reports),
            [x for r in reports for x in r.returns],
        )

    # ---------------------------------------------------------------- ReplaySource
    def intake(self) -> tuple[int, int]:
        steps, self._intake = self._intake, 0
        return steps, self.newest_version

    def sample(self, batch: int) -> TransitionBatch | None:
        """``batch`` transitions over the replays that answer (fewer if one does not), weighted over all of them;
        None when none answers with transitions (counted: that gradient step is skipped, not the run ended).

        The next batch is asked for before this one is returned (``prefetch``), so that the replays draw it while
        the learner takes its gradient step; its priority updates then go one request later."""
        if self._ahead is not None and self._ahead[2] == batch:
            request, sent, _ = self._ahead
        else:
            parts = self._split(batch)
            request, sent = self._send(parts) if parts else (0, [])
        got = self._answers(request, sent, REPLY_TIMEOUT_S) if sent else {}
        self._ahead = None
        self._early.clear()
        if self.prefetch and (ahead := self._split(batch)):
            self._ahead = (*self._send(ahead), batch)
        rows = [(peer, got[peer]) for peer in sent if peer in got and got[peer].arrays]
        if not rows:
            self.counters["missed_batches"] += 1
            missed = self.counters["missed_batches"]
            self._ratelog.warning("missed", f"no replay answered with transitions: gradient step skipped ({missed})")
            return None
        self.samples += 1
        self._pending_rows = [(peer, len(ans.arrays["ids"])) for peer, ans in rows]
        cat = {k: np.concatenate([ans.arrays[k] for _, ans in rows]) for k in P.REPLAY_BATCH_ARRAYS}
        p_min = min(ans.min_priority for _, ans in rows if ans.min_priority > 0)
        weights = (cat["priorities"] / p_min) ** -self.beta
        return TransitionBatch(
            ids=cat["ids"],
            weights=weights.astype(np.float32),
            obs=cat["obs"],
            actions=cat["actions"],
            returns=cat["returns"],
            discounts=cat["discounts"],
            next_obs=cat["next_obs"],
            versions=cat["versions"],
        )

    def _split(self, batch: int) -> dict[_Peer, int]:
        """``batch`` over the live replays that hold data, in proportion to their priority mass."""
        peers = [p for p in self.peers if p.alive and p.last is not None and p.last.held > 0 and p.last.total > 0]
        if not peers:  # none known to hold data: ask the first one that may (refresh() finds the others again)
            return {p: batch for p in [p for p in self.peers if p.alive][:1]}
        mass = np.array([p.last.total for p in peers if p.last is not None])
        exact = batch * mass / mass.sum()
        parts = np.floor(exact).astype(int)
        for i in np.argsort(-(exact - parts))[: batch - int(parts.sum())]:
            parts[i] += 1
        return {p: int(n) for p, n in zip(peers, parts) if n > 0}

    def update_priorities(self, ids: np.ndarray, td_errors: np.ndarray) -> int:
        """Queue the last batch's new priorities for the replays that served its rows (sent with the next request)."""
        start = 0
        for peer, n in self._pending_rows:
            peer.ids.append(np.asarray(ids[start : start + n], dtype=np.int64))
            peer.td.append(np.asarray(td_errors[start : start + n], dtype=np.float32))
            start += n
        self._pending_rows = []
        return start

    def drop_older_than(self, version: int) -> int:
        self.drop_before = max(self.drop_before, int(version))
        return 0

    def td_cap(self) -> float:
        rc = self.config.replay
        top = max((p.last.max_priority for p in self.peers if p.last is not None), default=1.0)
        return max(top ** (1.0 / rc.alpha) - 1e-6, 0.0) if rc.alpha else math.inf

    def __len__(self) -> int:
        return sum(p.last.held for p in self.peers if p.alive and p.last is not None)

    @property
    def beta(self) -> float:
        rc = self.config.replay
        return rc.beta + (1.0 - rc.beta) * min(1.0, self.samples / rc.beta_steps)

    @property
    def fill(self) -> float:
        lasts = [p.last for p in self.peers if p.last is not None]
        return sum(min(a.held, a.capacity) for a in lasts) / max(1, sum(a.capacity for a in lasts))

    @property
    def nbytes(self) -> int:
        return sum(p.last.nbytes for p in self.peers if p.last is not None)

    @property
    def stale_updates(self) -> int:
        return sum(p.last.stale_updates for p in self.peers if p.last is not None)

    @property
    def dropped_by_version(self) -> int:
        return sum(p.last.dropped_by_version for p in self.peers if p.last is not None)

    @property
    def max_priority(self) -> float:
        return max((p.last.max_priority for p in self.peers if p.last is not None), default=1.0)
