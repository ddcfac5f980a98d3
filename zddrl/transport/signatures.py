"""Signing and checking runs and parameter versions (docs/protocol.md section 5.7), over the payloads that
zddrl.protocol.signing defines, with Ed25519 from the ``cryptography`` package through zddrl.keys."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from zddrl import keys
from zddrl import protocol as P
from zddrl.protocol.signing import params_payload, run_payload

if TYPE_CHECKING:  # cryptography itself is imported only where a key is used (zddrl.keys)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

Signer = tuple[str, "Ed25519PrivateKey"]
"""(key name, Ed25519PrivateKey): ``keys.Credentials.signer``."""


def signed_params(head: P.Parameters, signer: Signer) -> P.Parameters:
    """``head`` with ``signer``'s name and signature."""
    name, key = signer
    return dataclasses.replace(head, signer=name, signature=keys.sign(key, params_payload(head, name)))


def signed_hello(hello: P.Hello, signer: Signer) -> P.Hello:
    """A learner's ``hello`` with its run spec signed by ``signer``."""
    name, key = signer
    return dataclasses.replace(
        hello, run_signer=name, run_signature=keys.sign(key, run_payload(hello.run_id, hello.run, name))
    )


def _refusal(pins: dict[str, Ed25519PublicKey], signer: str, signature: bytes, payload: Callable[[], bytes]) -> str:
    if not signer or not signature:
        return "not signed"
    if signer not in pins:
        return f"signed by {signer!r}, not a pinned learner key"
    try:
        signed = payload()
    except (TypeError, ValueError) as exc:  # a spec no learner could have signed (decode allows only str map keys)
        return f"not a signable message ({exc})"
    if not keys.verified(pins, signer, signed, signature):
        return f"signed by {signer!r}, but the signature does not verify"
    return ""


def params_refusal(head: P.Parameters, pins: dict[str, Ed25519PublicKey]) -> str:
    """Why the version ``head`` announces must not be used under ``pins`` (learner name -> public key), or ""."""
    return _refusal(pins, head.signer, head.signature, lambda: params_payload(head, head.signer))


def run_refusal(run_id: str, run: dict | None, signer: str, signature: bytes, pins: dict[str, Ed25519PublicKey]) -> str:
    """Why run ``run_id`` with spec ``run`` must not be joined or adopted under ``pins``, or ""."""
    return _refusal(pins, signer, signature, lambda: run_payload(run_id, run, signer))
