"""Attacks on a live broker's public control port, each of which worked once (issues 13.7, 16.2).

A real `zddrl broker` process, driven over raw DEALER sockets (identity = socket, so each member here has its
own): status requests never read, members with huge stats, a few hundred members paged through, hellos past
the caps and the hello rate.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from broker_clients import WAIT_S, ProfiledBroker, cli, counters, status
from conftest import BrokerHandle, Bus, Procs, wait_for
from contract_clients import Control
from zddrl import protocol as P
from zddrl.broker.limits import HELLO_BURST, MAX_MEMBERS_PER_ROLE, STATUS_BURST
from zddrl.broker.membership import MAX_STATS_BYTES
from zddrl.broker.report import MAX_STATUS_BYTES
from zddrl.transport.status import request_status

pytestmark = pytest.mark.slow  # every test here starts a real broker


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def stats_of(nbytes: int) -> dict:
    """A valid flat stats map of about ``nbytes`` packed (256-character strings)."""
    return {f"figure/{i:06d}": "v" * 256 for i in range(nbytes // 272)}


def member(bus: Bus, broker: BrokerHandle, peer_id: str, stats: dict | None = None, role: str = "monitor") -> Control:
    c = Control(bus, broker, P.Hello(role=role, peer_id=peer_id, host="node1"))
    if stats is not None:
        c.send(P.Stats(peer_id=peer_id, role=role, stats=stats))
    return c


def test_status_requests_never_read_queue_a_bounded_amount(broker: BrokerHandle, bus: Bus) -> None:
    """Attack: 26 KiB of status requests, never read, queued 512 MB of replies in the broker."""
    member(bus, broker, "fat-0", stats_of(600 << 10))
    wait_for(lambda: status(broker, bus)["members"]["fat-0"]["stats"], WAIT_S, "the stats")
    before = rss_mib(broker.proc.pid)
    sock = bus.socket(zmq.DEALER, rcvhwm=1, rcvbuf=4096)  # reads nothing: replies stay in the broker's pipe
    sock.connect(broker.connect)
    request = P.encode(P.StatusRequest(peer_id="flood"))
    t0 = time.monotonic()
    for _ in range(300):
        sock.send_multipart(request)
    refused = wait_for(
        lambda: (n := counters(broker, bus).get("status_refused", 0)) >= 300 - STATUS_BURST - 10 and n,
        WAIT_S,
        "the flood to be refused",
    )
    answered = 300 - int(refused)  # type: ignore[call-overload]
    assert answered <= STATUS_BURST + 2 * (time.monotonic() - t0) + 1
    grown = rss_mib(broker.proc.pid) - before
    # At most `answered` bodies of at most MAX_STATUS_BYTES are queued, plus 300 rejects of a few dozen bytes.
    assert grown < answered * MAX_STATUS_BYTES / 2**20 + 32, f"the broker grew by {grown:.0f} MiB"


@pytest.mark.serial  # members beat on time until status answers (tests/phases.py)
def test_two_members_with_0_6_mib_stats_leave_status_working(broker: BrokerHandle, bus: Bus) -> None:
    """Attack: two members with 0.6 MiB stats each pushed the status body over 1 MiB: `zddrl status` failed."""
    for i in range(2):
        member(bus, broker, f"fat-{i}", stats_of(600 << 10))
    wait_for(lambda: counters(broker, bus)["stats_truncated"] == 2, WAIT_S, "both stats maps truncated")
    out = cli("status", "--connect", broker.connect, "--json")
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert len(msgpack.packb(body)) <= MAX_STATUS_BYTES
    for i in range(2):
        kept = body["members"][f"fat-{i}"]["stats"]
        assert 0 < len(msgpack.packb(kept)) <= MAX_STATS_BYTES
    table = cli("status", "--connect", broker.connect)
    assert table.returncode == 0 and "members 2 (2 monitor) on 1 hosts" in table.stdout, table.stdout


def test_a_few_hundred_members_page_through_bounded_bodies(procs: Procs, tmp_path: Path, bus: Bus) -> None:
    """300 joined actors with 4 KiB of stats each: over 1 MiB as one body (today's broker could not answer at all),
    now a summary with every count and pages that list each member exactly once."""
    broker = ProfiledBroker(procs, tmp_path, heartbeat_interval_s=5.0).start()  # nobody expires while we join
    for i in range(300):
        member(bus, broker, f"actor-{i:03d}", stats_of(4 << 10), role="actor")
    first = wait_for(lambda: (b := status(broker, bus))["broker"]["members_total"] == 300 and b, WAIT_S, "300 members")
    pages = first["broker"]["pages"]
    assert pages > 1 and first["broker"]["members_by_role"]["actor"] == 300
    seen: list[str] = []
    for page in range(1, pages + 1):
        body = request_status(broker.connect, WAIT_S, bus.ctx, page=page)
        assert body is not None and body["broker"]["page"] == page
        assert len(msgpack.packb(body)) <= MAX_STATUS_BYTES
        seen += body["members"]
    assert sorted(seen) == [f"actor-{i:03d}" for i in range(300)]
    out = cli("status", "--connect", broker.connect, "--page", str(pages))
    assert out.returncode == 0 and f"page {pages} of {pages}" in out.stdout, out.stderr
    assert any(line.startswith("actor-299 ") for line in out.stdout.splitlines())


def test_hellos_past_a_cap_or_the_hello_rate_are_refused(broker: BrokerHandle, bus: Bus) -> None:
    """Attack: one client joined without bound (members per role, hellos per connection)."""
    cap = MAX_MEMBERS_PER_ROLE["monitor"]
    for i in range(cap):
        member(bus, broker, f"monitor-{i}")
    over = bus.socket(zmq.DEALER)
    over.connect(broker.connect)
    over.send_multipart(P.encode(P.Hello(role="monitor", peer_id="monitor-extra")))
    assert over.poll(int(WAIT_S * 1000))
    reject = P.decode(over.recv_multipart())
    assert isinstance(reject, P.Reject) and reject.reason.startswith(P.REFUSED_PREFIX), reject
    assert f"at most {cap} members of role 'monitor'" in reject.reason
    assert member(bus, broker, "monitor-0").welcome, "a member coming back is not a new one"

    sock = bus.socket(zmq.DEALER)  # one connection, many peer ids
    sock.connect(broker.connect)
    for i in range(HELLO_BURST + 3):
        sock.send_multipart(P.encode(P.Hello(role="actor", peer_id=f"actor-{i}")))
    b = wait_for(lambda: (c := counters(broker, bus))["hello_limited"] >= 3 and c, WAIT_S, "the hello rate")
    assert b["hello_over_cap"] == 1 and b["members_by_role"]["actor"] <= HELLO_BURST + 1
