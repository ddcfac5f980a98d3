"""In-process fakes of the transport's small interfaces, for tests of the learner's logic without sockets.

``FakeChannel`` stands for ``transport.channel.DataChannel`` (prepared messages in, sent messages recorded);
``FakeLink`` for ``transport.link.BrokerLink`` (a welcome, a generation, the newest fleet message).
"""

from __future__ import annotations

from types import SimpleNamespace

from zddrl import protocol as P


class FakeChannel:
    """Hands out prepared messages one per ``recv`` (None when empty); records what is sent and acked."""

    def __init__(self, messages: list[P.Message] | None = None, endpoint: str = "tcp://127.0.0.1:9") -> None:
        self.messages = list(messages or [])
        self.sent: list[P.Message] = []
        self.granted = 0
        self.generation = 0
        self.endpoint = endpoint
        self.closed = False

    def recv(self, timeout_ms: int) -> P.Message | None:
        return self.messages.pop(0) if self.messages else None

    def ack(self) -> None:
        self.granted += 1

    def send(self, msg: P.Message) -> None:
        self.sent.append(msg)

    def close(self) -> None:
        self.closed = True


class FakeLink:
    """A welcomed link; ``actors`` (peer id -> env count) is what its fleet message says, ``fleet_seq`` its seq."""

    def __init__(self, actors: dict[str, int] | None = None, max_message_bytes: int = 1 << 30) -> None:
        self.generation = 0
        self.welcome = SimpleNamespace(max_message_bytes=max_message_bytes)
        self.actors = dict(actors or {})
        self.fleet_seq = 0
        self.sent: list[P.Message] = []

    def set_actors(self, actors: dict[str, int]) -> None:
        self.actors = dict(actors)
        self.fleet_seq += 1

    def fleet(self) -> tuple[int, dict[str, dict]] | None:
        return self.fleet_seq, {peer: {"num_envs": n, "host": "testhost"} for peer, n in self.actors.items()}

    def wait_fleet(self, timeout_s: float) -> tuple[int, dict[str, dict]] | None:
        return self.fleet()

    def endpoint(self, name: str) -> str:
        return "tcp://127.0.0.1:9"

    def send(self, msg: P.Message) -> None:
        self.sent.append(msg)
