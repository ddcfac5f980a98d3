"""A learner shard's data channel to the broker: credit out, trajectories in, parameters out."""
from __future__ import annotations

import zmq
from loguru import logger

from . import protocol as P
from .client import BrokerLink

CREDIT_WINDOW = 64
"""Default number of trajectories a shard lets the broker send ahead of what it has consumed (sync mode;
async modes size theirs from the batch). The window is the only queue between broker and shard, and a
shard with a short one runs dry whenever the broker waits for a core: on 2 cores the broker path ran at
0.70-0.84x a zmq.proxy forwarder at 64 KiB with 16, 0.87-0.88x with 64 (docs/bench/bus_window.json). In
sync mode an actor sends one rollout per version, so a round's data, not the window, bounds what is
really queued at the shard."""


class DataChannel:
    """The shard's DEALER on the broker's learner socket: credit out, trajectories in, parameters out."""

    def __init__(self, ctx: zmq.Context, link: BrokerLink, peer_id: str, max_message_bytes: int,
                 window: int = CREDIT_WINDOW) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, peer_id.encode())
        self.sock.setsockopt(zmq.RCVHWM, 0)  # bounded by the credit we grant
        self.endpoint = link.endpoint("learners")
        self.sock.connect(self.endpoint)
        self.peer_id = peer_id
        self.max_message_bytes = max_message_bytes
        self.generation = link.generation
        self.window = window
        self.consumed = 0
        self.grant(window)

    def grant(self, n: int) -> None:
        self.sock.send_multipart(P.encode(P.Credit(sender=self.peer_id, credit=n)))

    def regrant(self, generation: int) -> None:
        """After a new welcome on the same learners port: the broker's credit for us restarted at zero."""
        self.generation = generation
        self.consumed = 0
        self.grant(self.window)

    def ack(self) -> None:
        """One received message consumed: its credit goes back, in batches of half the window (one
        credit message per trajectory would double the broker's message rate for nothing)."""
        self.consumed += 1
        if self.consumed * 2 >= self.window:
            self.grant(self.consumed)
            self.consumed = 0

    def send(self, msg: P.Message) -> None:
        self.sock.send_multipart(P.encode(msg), copy=False)

    def recv(self, timeout_ms: int) -> P.Message | None:
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart(copy=False)
        try:
            return P.decode(frames, self.max_message_bytes)
        except P.ProtocolError as exc:
            logger.warning(f"dropped a malformed message on the learner channel: {exc}")
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
