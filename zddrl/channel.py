"""A learner shard's data channel to the broker: credit out, trajectories in, parameters out."""
from __future__ import annotations

import zmq
from loguru import logger

from . import protocol as P
from .client import BrokerLink

CREDIT_WINDOW = 16
"""Trajectories a shard lets the broker send ahead of what it has consumed."""


class DataChannel:
    """The shard's DEALER on the broker's learner socket: credit out, trajectories in, parameters out."""

    def __init__(self, ctx: zmq.Context, link: BrokerLink, peer_id: str, max_message_bytes: int) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, peer_id.encode())
        self.sock.setsockopt(zmq.RCVHWM, 0)  # bounded by the credit we grant
        self.sock.connect(link.endpoint("learners"))
        self.peer_id = peer_id
        self.max_message_bytes = max_message_bytes
        self.generation = link.generation
        self.grant(CREDIT_WINDOW)

    def grant(self, n: int) -> None:
        self.sock.send_multipart(P.encode(P.Credit(sender=self.peer_id, credit=n)))

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

    def close(self) -> None:
        self.sock.close(linger=0)
