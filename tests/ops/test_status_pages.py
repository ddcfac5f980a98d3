"""`zddrl status` on a paged, summarised body (issue 16.2) and on a broker that refuses (rate limit), without a
broker process: bodies built in-process, a ROUTER that answers with a reject."""

from __future__ import annotations

import threading
import time

import zmq

from broker_clients import in_process_broker
from zddrl import protocol as P
from zddrl.broker.membership import Member
from zddrl.ops.status import format_status
from zddrl.transport.status import request_status


def test_the_table_shows_the_counts_the_page_and_each_rows_warnings() -> None:
    with in_process_broker() as broker:
        for i in range(1_200):
            m = Member(peer_id=f"actor-{i:04d}", role="actor", identity=b"", host=f"node{i % 3}")
            broker.members[m.peer_id] = m
        broker.health.observe("actor-0500", "actor", {"first_obs_hash": "ab"}, 0.0)
        broker.health.observe("actor-0501", "actor", {"first_obs_hash": "ab"}, 0.0)
        text = format_status(broker.status(2))
        assert "members 1200 (1200 actor) on 3 hosts  page 2 of 3 (--page N)" in text
        rows = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.startswith("actor-")}
        assert len(rows) == 500 and rows["actor-0500"][-2] == "1" and rows["actor-0502"][-2] == "-"
    with in_process_broker() as empty:
        assert "page" not in format_status(empty.status()).split("members 0")[1]


def test_a_refused_request_returns_none_at_once() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    asked: list[P.Message] = []

    def answer() -> None:
        if router.poll(5000):
            identity, *frames = router.recv_multipart()
            asked.append(P.decode(frames))
            router.send_multipart([identity, *P.encode(P.Reject(reason="status: rate limited, ask less often"))])

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        t0 = time.monotonic()
        assert request_status(f"tcp://127.0.0.1:{port}", 5.0, ctx, page=3) is None
        assert time.monotonic() - t0 < 2.5, "a reject is an answer: no waiting out the timeout"
        thread.join(5)
        assert asked == [P.StatusRequest(peer_id="status", page=3)]
    finally:
        router.close(linger=0)
        ctx.destroy(linger=0)
