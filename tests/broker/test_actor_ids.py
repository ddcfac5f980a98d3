"""Assigned actor ids against a bound in-process broker: a hello that names no id never takes a live member's id
whose connection closed (a blip, a memory reset), only a departed holder's; a rate-limited ``auto_id`` hello never
reaches the assignment; a dead ZAP handler shows in the status body and the log."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from loguru import logger

from broker_clients import WAIT_S
from conftest import wait_for
from zddrl import protocol as P
from zddrl.broker import zap
from zddrl.broker.broker import Broker
from zddrl.broker.limits import HELLO_BURST
from zddrl.broker.membership import Member
from zddrl.config import BrokerConfig
from zddrl.keys import new_key

KEY = "actor:a"


@pytest.fixture
def broker() -> Iterator[Broker]:
    b = Broker(BrokerConfig(bind="tcp://127.0.0.1:*"))
    b.bind()
    yield b
    b.close()


def hello(peer_id: str = "", host: str = "h2", pid: int = 2) -> P.Hello:
    return P.Hello(role="actor", peer_id=peer_id, auto_id=True, host=host, pid=pid)


def join(b: Broker, peer_id: str, fd: int, host: str = "h1", pid: int = 1) -> Member:
    member = Member(peer_id=peer_id, role="actor", identity=peer_id.encode(), host=host, pid=pid)
    member.user, member.conn_fd = KEY, fd
    b.membership.admit(member)
    return member


def test_a_fresh_hello_never_takes_a_live_members_id_whose_connection_closed(broker: Broker) -> None:
    a = join(broker, "actor-0", fd=7)
    broker.claims.connection_closed(7)  # a blip (or a memory reset): A's process lives, its PUSH names actor-0
    assert a.conn_closed
    ids = broker.joining.actor_ids
    assert ids.assign(hello(), KEY) == "actor-1", "a new process of the same key"
    assert ids.assign(hello("actor-0", host="h1", pid=1), KEY) == "actor-0", "A itself, reconnecting"
    assert ids.assign(hello("actor-0"), KEY) == "actor-0", "a process of A's key that says it held it"
    assert ids.assign(hello("actor-0"), "actor:b") == "actor-1", "not another key"
    broker.membership.remove(a, "expired")
    assert ids.assign(hello(), KEY) == "actor-0", "its holder departed: the key's restarted process takes it back"


def test_a_rate_limited_auto_id_hello_never_reaches_assign(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    ids, joining = broker.joining.actor_ids, broker.joining
    calls: list[str] = []
    assign = ids.assign
    monkeypatch.setattr(ids, "assign", lambda msg, user: calls.append(msg.peer_id) or assign(msg, user))
    for _ in range(HELLO_BURST):
        msg = joining.assigned(b"conn", hello(), "")
        assert msg is not None and msg.peer_id == "actor-0"
        assert not joining.refused(b"conn", msg, ""), "judged once: refused() takes no second token"
    assert joining.assigned(b"conn", hello(), "") is None, "over the connection's hello rate"
    assert len(calls) == HELLO_BURST and broker.counters["hello_limited"] == 1


def test_a_dead_zap_handler_shows_in_the_status_and_the_log(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    new_key(keys, "broker", "b")
    b = Broker(BrokerConfig(bind="tcp://127.0.0.1:*", keys=str(keys)))
    b.bind()
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="ERROR")
    assert b.auth is not None
    handler = b.auth._zap
    flush = handler.refused.flush
    try:
        assert b.status()["broker"]["zap_alive"] is True
        b._tick(time.monotonic())
        assert not any("ZAP handler is dead" in line for line in lines)

        def crash() -> float:
            raise RuntimeError("a bug in the loop")

        handler.refused.flush = crash  # type: ignore[method-assign]
        asker = b.ctx.socket(zmq.REQ)
        asker.connect(zap.ZAP_ENDPOINT)
        asker.send_multipart([b"1.0", b"7", b"control", b"10.1.2.3", b"", b"CURVE", b"k" * 32])  # wakes the loop
        asker.poll(int(WAIT_S * 1000))
        asker.close(linger=0)
        wait_for(lambda: not b.auth.alive(), WAIT_S, "the handler's thread to die")  # type: ignore[union-attr]
        assert b.status()["broker"]["zap_alive"] is False
        b._tick(time.monotonic())
        b._tick(time.monotonic())
        assert sum("ZAP handler is dead" in line for line in lines) == 1, "once per log interval"
    finally:
        handler.refused.flush = flush  # type: ignore[method-assign]
        logger.remove(sink)
        b.close()
