"""Signed runs and parameter versions (docs/protocol.md section 5.7): the canonical payloads, and that any
change to what a signature covers breaks it."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zddrl import protocol as P
from zddrl.protocol import signing as payloads
from zddrl.transport import signatures as signing
from zddrl.transport.params import split

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
SIGNER = ("learner-0", KEY)
PINS = {"learner-0": KEY.public_key()}
ROGUE = ("learner-0", Ed25519PrivateKey.generate())
"""A key that claims a pinned name."""
RUN = {"name": "demo", "env": {"id": "CartPole-v1", "num_envs": 2}, "algo": {"schedule": "sync", "lr": 3e-4}}


def head(signer: signing.Signer | None = SIGNER, **kw: Any) -> P.Parameters:
    args: dict[str, Any] = dict(
        run_id="run-a",
        peer_id="learner-0",
        version=3,
        flat=np.arange(40, dtype=np.float32),
        layout=[["w", "float32", [40], 0]],
        extras={"obs_mean": np.zeros(4, np.float32), "obs_var": np.ones(4, np.float32)},
        meta={"rollout_len": 8},
        chunk_bytes=64,
        signer=signer,
    )
    args.update(kw)
    first = split(**args)[0]
    assert isinstance(first, P.Parameters)
    return first


def wire(msg: P.Message) -> P.Message:
    """``msg`` as a receiver decodes it."""
    return P.decode([bytes(P._buffer(f)) for f in P.encode(msg)])


def test_a_signed_version_verifies_after_the_wire() -> None:
    msg = head()
    assert msg.signer == "learner-0" and len(msg.signature) == P.SIGNATURE_BYTES
    assert signing.params_refusal(msg, PINS) == ""
    assert signing.params_refusal(wire(msg), PINS) == ""  # the payload is what both sides compute


CHANGES = {
    "run_id": {"run_id": "run-b"},
    "policy_version (re-stamped)": {"policy_version": 4},
    "policy_version (latest + 10**6)": {"policy_version": 3 + 10**6},
    "param_hash": {"param_hash": "0" * 16},
    "a chunk hash": {"chunk_hashes": ["0" * 16]},
    "param_dtype": {"param_dtype": "float16"},
    "numel": {"numel": 39},
    "chunk_numel": {"chunk_numel": 8},
    "layout": {"layout": [["w", "float32", [4, 10], 0]]},
    "meta": {"meta": {"rollout_len": 4096}},
    "signer": {"signer": "learner-1"},
}


@pytest.mark.parametrize("change", list(CHANGES.values()), ids=list(CHANGES))
def test_any_changed_field_breaks_the_signature(change: dict) -> None:
    msg = head()
    if "chunk_hashes" in change:
        change = {"chunk_hashes": [msg.chunk_hashes[0], *change["chunk_hashes"], *msg.chunk_hashes[2:]]}
    forged = dataclasses.replace(msg, **change)
    pins = {**PINS, "learner-1": KEY.public_key()} if "signer" in change else PINS
    assert "does not verify" in signing.params_refusal(forged, pins)


def test_arrays_beside_chunk_0_are_covered() -> None:
    msg = head()
    arrays = {**msg.arrays, "obs_mean": np.full(4, 100.0, np.float32)}
    assert "does not verify" in signing.params_refusal(dataclasses.replace(msg, arrays=arrays), PINS)
    arrays = {k: v for k, v in msg.arrays.items() if k != "obs_var"}
    assert "does not verify" in signing.params_refusal(dataclasses.replace(msg, arrays=arrays), PINS)


def test_map_order_does_not_matter_but_values_do() -> None:
    a = payloads.run_payload("r", {"a": 1, "b": {"x": 1.5, "y": [1, 2]}}, "k")
    b = payloads.run_payload("r", {"b": {"y": [1, 2], "x": 1.5}, "a": 1}, "k")
    assert a == b
    assert a != payloads.run_payload("r", {"a": 1, "b": {"x": 1.5, "y": [2, 1]}}, "k")
    assert payloads.params_payload(head(None), "k") != payloads.run_payload("run-a", {}, "k")  # tagged apart


def test_unsigned_unknown_and_rogue_signers_are_refused() -> None:
    assert signing.params_refusal(head(None), PINS) == "not signed"
    assert "not a pinned learner key" in signing.params_refusal(head(("stranger", KEY)), PINS)
    assert "does not verify" in signing.params_refusal(head(ROGUE), PINS)
    assert signing.params_refusal(head(), {}) != ""  # nothing pinned: nothing is trusted


def test_a_signed_run_verifies_and_any_change_breaks_it() -> None:
    hello = wire(signing.signed_hello(P.Hello(role="learner", peer_id="learner-0", run_id="run-a", run=RUN), SIGNER))
    assert isinstance(hello, P.Hello)
    ok = (hello.run_id, hello.run, hello.run_signer, hello.run_signature)
    assert signing.run_refusal(*ok, PINS) == ""
    evil = {**RUN, "env": {**RUN["env"], "id": "os:abort"}}
    assert "does not verify" in signing.run_refusal("run-a", evil, hello.run_signer, hello.run_signature, PINS)
    assert "does not verify" in signing.run_refusal("run-b", RUN, hello.run_signer, hello.run_signature, PINS)
    assert signing.run_refusal("run-a", RUN, "", b"", PINS) == "not signed"
    # A version's signature is no run signature, even over the same run id.
    version = head()
    assert "does not verify" in signing.run_refusal("run-a", RUN, "learner-0", version.signature, PINS)


@pytest.mark.parametrize(
    "signer, signature",
    [("learner-0", b""), ("", b"x" * 64), ("learner-0", b"x" * 63), ("n" * 65, b"x" * 64)],
    ids=["no-signature", "no-signer", "short-signature", "long-signer"],
)
def test_decode_refuses_a_half_or_misshapen_seal(signer: str, signature: bytes) -> None:
    for msg in (
        dataclasses.replace(head(None), signer=signer, signature=signature),
        P.Hello(role="learner", peer_id="l", run_id="r", run={}, run_signer=signer, run_signature=signature),
    ):
        with pytest.raises(P.ProtocolError, match="go together"):
            wire(msg)
