"""What a client (and the broker's parameter cache) say happened, without processes: the words of a failed
handshake for each way it fails, and a learner's re-publish of the version a broker holds told apart from stale
data."""

from __future__ import annotations

import pytest
import zmq
from test_params import version

from zddrl.transport.handshakes import refusal
from zddrl.transport.params import FrameCache


def test_a_repeat_of_the_cached_version_is_not_stale() -> None:
    cache = FrameCache()
    v3 = version(3)
    assert [cache.add(m, [i]) for i, m in enumerate(v3)][-1] == "complete"
    # A learner re-welcomed by a broker that did not restart re-publishes what the broker has.
    assert [cache.add(m, ["again"]) for m in v3] == ["repeat"] * len(v3)
    other = version(3, n=999)  # the same version number with other contents is no repeat
    assert cache.add(other[0], ["x"]) == "stale"
    assert cache.add(version(2)[0], ["old"]) == "stale"
    assert cache.version == 3 and cache.messages == [[i] for i in range(len(v3))], "the cached version stays"


@pytest.mark.parametrize(
    ("event", "key", "says"),
    [
        (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, "", ["refused the handshake", "wants keys", "has none", "--keys"]),
        (zmq.EVENT_HANDSHAKE_FAILED_AUTH, "fleet", ["refused our key", "actor key 'fleet'", "key directory"]),
        (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, "fleet", ["does not speak CURVE", "open bus"]),
        (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, "fleet", ["broker key in our key directory"]),
    ],
    ids=["no keys", "key refused", "open bus", "wrong broker key"],
)
def test_a_failed_handshake_says_what_to_check(event: int, key: str, says: list[str]) -> None:
    line = refusal(event, "tcp://b:5555", "actor", key)
    assert "tcp://b:5555" in line and "docs/security.md" in line
    for words in says:
        assert words in line, line


def test_the_broker_counts_params_repeat_per_message() -> None:
    """docs/protocol.md section 9: a version re-published as N messages adds N to ``params_repeat``, and none of it
    goes out again."""
    from collections import defaultdict

    from zddrl.broker.publisher import Publisher
    from zddrl.logs import RateLimitedLog

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    try:
        counters: dict[str, int] = defaultdict(int)
        publisher = Publisher(pub.send_multipart, lambda identity, frames: None, counters, RateLimitedLog(), 1.0)
        v3 = version(3)
        assert len(v3) > 2
        assert [publisher.add(m, m.encode(), "r") for m in v3][-1]  # the last message completes the version
        sent = counters["params_bytes"]
        assert not any(publisher.add(m, m.encode(), "r") for m in v3)
        assert counters["params_repeat"] == len(v3) and counters["params_bytes"] == sent
    finally:
        pub.close(linger=0)
        ctx.term()
