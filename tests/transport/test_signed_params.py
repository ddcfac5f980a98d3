"""Forged parameter versions (issue 13): what an actor's link and the broker's cache do with them.

The attacks: a version far ahead of the real ones (latest + 10**6), after which real versions would be
stale; real weights re-stamped with a higher version (the hashes cover the weights only); a version
signed by a key that is not pinned, or by none. With pinned keys all are refused before any of their
bytes is used or forwarded, and the version held stays; the next real version is taken.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zddrl import keys
from zddrl import protocol as P
from zddrl.broker.publisher import Publisher
from zddrl.broker.report import BROKER_COUNTERS
from zddrl.logs import RateLimitedLog
from zddrl.transport import signatures as signing
from zddrl.transport.link import BrokerLink
from zddrl.transport.params import Assembler, FrameCache, split

KEY = Ed25519PrivateKey.generate()
SIGNER = ("learner-0", KEY)
PINS = {"learner-0": KEY.public_key()}
ROGUE = ("learner-0", Ed25519PrivateKey.generate())


def version(v: int, signer: signing.Signer | None = SIGNER, run_id: str = "run-a", seed: int = 0) -> list[P.Message]:
    """The messages of one version, as a receiver decodes them (three chunks)."""
    flat = np.random.default_rng(seed).standard_normal(48).astype(np.float32)
    messages = split(
        run_id=run_id,
        peer_id="learner-0",
        version=v,
        flat=flat,
        layout=[["w", "float32", [48], 0]],
        meta={"rollout_len": 8},
        chunk_bytes=64,
        signer=signer,
    )
    return [P.decode([bytes(P._buffer(f)) for f in P.encode(m)]) for m in messages]


def restamped(messages: list[P.Message], v: int) -> list[P.Message]:
    """Real, validly signed messages whose version number was raised (the signature kept)."""
    return [dataclasses.replace(m, policy_version=v) for m in messages]


FORGERIES = {
    "latest+10**6 by a rogue key": lambda: version(10**6, ROGUE),
    "latest+10**6 unsigned": lambda: version(10**6, None),
    "re-stamped higher version": lambda: restamped(version(1), 10**6),
    "another run's version": lambda: version(5, run_id="run-old"),
    "unpinned signer name": lambda: version(10**6, ("mallory", KEY)),
}


def feed(assembler: Assembler, messages: list[P.Message]) -> P.Parameters | None:
    out = None
    for m in messages:
        assert isinstance(m, (P.Parameters, P.ParamChunk))
        out = assembler.add(m) or out
    return out


@pytest.mark.parametrize("forge", list(FORGERIES.values()), ids=list(FORGERIES))
def test_the_assembler_refuses_forged_versions_and_takes_the_next_real_one(forge: Any) -> None:
    assembler = Assembler(verify=lambda head: signing.params_refusal(head, PINS))
    assert feed(assembler, version(1)) is not None
    forged = forge()
    if forged[0].run_id != "run-a":  # the receiver drops other runs first (link): same run here
        forged = [dataclasses.replace(m, run_id="run-a") for m in forged]
    assert feed(assembler, forged) is None
    assert assembler.rejected["signature"] == 1 and assembler.policy_version == 1
    assert assembler.refusal
    whole = feed(assembler, version(2, seed=2))
    assert whole is not None and whole.policy_version == 2  # the real next version is not "stale"


def test_without_pins_versions_need_no_signature() -> None:
    assert feed(Assembler(), version(0, None)) is not None
    cache = FrameCache()
    assert [cache.add(m, []) for m in version(0, None)][-1] == "complete"  # type: ignore[arg-type]


@pytest.mark.parametrize("forge", list(FORGERIES.values()), ids=list(FORGERIES))
def test_the_broker_cache_drops_forged_versions_before_any_goes_out(forge: Any) -> None:
    class Pub:
        sent: list[Any] = []

        def send_multipart(self, frames: Any, copy: bool = True) -> None:
            self.sent.append(frames)

    pub = Pub()
    counters: dict[str, int] = dict.fromkeys(BROKER_COUNTERS, 0)  # as the broker's are
    publisher = Publisher(pub.send_multipart, lambda *a: None, counters, RateLimitedLog(), 1.0, pins=PINS)  # type: ignore[arg-type]
    counters.update({k: 0 for k in ("params_incomplete", "params_bytes", "params_published", "params_orphan_chunk")})
    for m in version(1):
        publisher.add(m, P.encode(m), "run-a")  # type: ignore[arg-type]
    assert publisher.version == 1 and len(pub.sent) == 3
    forged = [dataclasses.replace(m, run_id="run-a") for m in forge()]
    for m in forged:
        assert publisher.add(m, P.encode(m), "run-a") is False
    assert counters["params_signature"] == 1 and counters["params_orphan_chunk"] == len(forged) - 1
    assert publisher.version == 1 and len(pub.sent) == 3, "nothing of a forged version went out"


def credentials(pins: dict) -> keys.Credentials:
    client = keys.ClientKeys("actor", "actor-0", b"p" * 40, b"s" * 40, b"b" * 40)  # never used: no socket opens
    return keys.Credentials(client, pins)


def test_an_actor_link_with_keys_keeps_its_version_and_counts_the_forgery() -> None:
    hello = P.Hello(role="actor", peer_id="actor-0")
    link = BrokerLink("tcp://127.0.0.1:9", hello, subscribe_params=True, credentials=credentials(PINS))
    assert link.credentials is not None
    link.welcome = P.Welcome(
        peer_id="actor-0",
        run_id="run-a",
        run={},
        ports={},
        heartbeat_interval_s=1.0,
        heartbeat_liveness=3,
        max_message_bytes=1 << 20,
    )
    for m in version(1):
        link.accept_params(m)  # type: ignore[arg-type]
    assert link.params is not None and link.params.policy_version == 1
    for forge in FORGERIES.values():
        for m in forge():
            link.accept_params(dataclasses.replace(m, run_id="run-a"))
    assert link.params.policy_version == 1
    assert link.assembler.rejected["signature"] == len(FORGERIES)
    for m in version(2, seed=2):
        link.accept_params(m)  # type: ignore[arg-type]
    assert link.params.policy_version == 2


def test_an_actor_link_without_keys_takes_unsigned_versions() -> None:
    link = BrokerLink("tcp://127.0.0.1:9", P.Hello(role="actor", peer_id="actor-0"), subscribe_params=True)
    assert link.credentials is None
    link.welcome = P.Welcome(
        peer_id="actor-0",
        run_id="run-a",
        run={},
        ports={},
        heartbeat_interval_s=1.0,
        heartbeat_liveness=3,
        max_message_bytes=1 << 20,
    )
    for m in version(1, None):
        link.accept_params(m)  # type: ignore[arg-type]
    assert link.params is not None and link.params.policy_version == 1
