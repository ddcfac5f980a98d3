"""A learner shard's data channel to the broker: credit out, trajectories in, parameters out."""

from __future__ import annotations

import zmq
from loguru import logger

from zddrl import protocol as P
from zddrl.transport.io import NOBLOCK, recv_frames
from zddrl.transport.link import BrokerLink

CREDIT_WINDOW = 64
"""Most trajectories a shard lets the broker send ahead of what it has consumed (a sync run; async runs
size theirs from the batch). The window is the only queue between broker and shard, and a shard with a
short one runs dry whenever the broker waits for a core: on 2 cores the broker path ran at 0.70-0.84x a
zmq.proxy forwarder at 64 KiB with 16, 0.87-0.88x with 64 (docs/bench/bus_window.json). In sync mode an
actor sends one rollout per version, so a round's data, not the window, bounds what is really queued."""
WINDOW_BYTES = 16 << 20
"""...and at most about this many bytes of them: with 1 MiB rollouts, a 64-message window kept 64 MiB in
flight (twice the last-level cache), and every copy on the way (kernel, broker) missed the cache: the
broker path ran at 0.75x a zmq.proxy forwarder, and at 1.0x with 16 messages (docs/benchmarks.md)."""
MIN_WINDOW = 4
"""The window never shrinks below this many trajectories, whatever their size."""


class DataChannel:
    """The shard's DEALER on the broker's learner socket: credit out, trajectories in, parameters out.

    Credit is granted by the message and bounded twice: ``window`` trajectories, and as many as fit in
    WINDOW_BYTES at the size of the last one received (that bound never below MIN_WINDOW; a smaller
    ``window`` stays as it is).
    """

    def __init__(self, link: BrokerLink, peer_id: str, max_message_bytes: int, window: int = CREDIT_WINDOW) -> None:
        self.sock = link.socket(zmq.DEALER)
        self.identity = link.data_identity
        """The broker routes this shard's trajectories to it (its peer id, or the secret of a closed bus's welcome)."""
        self.sock.setsockopt(zmq.IDENTITY, self.identity)
        self.sock.setsockopt(zmq.RCVHWM, 0)  # bounded by the credit we grant
        self.endpoint = link.endpoint("learners")
        self.sock.connect(self.endpoint)
        self.peer_id = peer_id
        self.max_message_bytes = max_message_bytes
        self.generation = link.generation
        self.max_window = window
        self.window = window
        """The window now: max_window, or less when trajectories are big."""
        self.outstanding = 0
        """Credit the broker holds for us: granted, not yet used by a trajectory we consumed."""
        self.last_bytes = 0
        if window:  # 0: a channel that only publishes (a service-placement learner: the replays take the data)
            self.grant(window)

    def grant(self, n: int) -> None:
        self.outstanding += n
        self.sock.send_multipart(P.encode(P.Credit(peer_id=self.peer_id, credit=n)))

    def regrant(self, generation: int, window: int | None = None) -> None:
        """After a new welcome on the same learners port: the broker's credit for us restarted at zero. ``window``:
        a new largest window (a new run may size it otherwise)."""
        self.generation = generation
        self.outstanding = 0
        if window is not None:
            self.max_window = self.window = window
        if self.window:
            self.grant(self.window)

    def ack(self) -> None:
        """One received trajectory consumed: credit goes back once half the window is used (one
        credit message per trajectory would double the broker's message rate for nothing), up to a
        window sized by the last trajectory's bytes."""
        # Floored: a trajectory the broker sent before a re-welcome reset its count used no credit granted since.
        self.outstanding = max(0, self.outstanding - 1)
        if self.last_bytes:
            self.window = min(self.max_window, max(MIN_WINDOW, WINDOW_BYTES // self.last_bytes))
        missing = self.window - self.outstanding
        if missing * 2 >= self.window:
            self.grant(missing)

    def send(self, msg: P.Message) -> None:
        self.sock.send_multipart(P.encode(msg), copy=False)

    def recv(self, timeout_ms: int) -> P.Message | None:
        try:  # what is queued already comes without a poll (one system call and a wake-up less per message)
            frames = recv_frames(self.sock, NOBLOCK)
        except zmq.Again:
            if not self.sock.poll(timeout_ms):
                return None
            frames = recv_frames(self.sock)
        if len(frames) > 2:  # carries arrays: a trajectory, whose size sets the window
            self.last_bytes = sum(map(len, frames))
        try:
            return P.decode(frames, self.max_message_bytes)
        except P.ProtocolError as exc:
            logger.warning(f"dropped a malformed message on the learner channel: {exc}")
            if len(frames) > 2:  # array frames: a trajectory (nothing else here has any), whose credit is spent
                self.ack()
            return None

    def drain(self) -> list[P.Message]:
        """Everything already received, without waiting (before this socket is replaced)."""
        out = []
        while (msg := self.recv(0)) is not None or self.sock.poll(0):
            if msg is not None:
                out.append(msg)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
