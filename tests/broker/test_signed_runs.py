"""A broker with keys adopts only runs signed by a pinned learner key (issue 13: anyone who reached the broker
could announce a run whose env every actor then imported and called), and passes the signature on in every
welcome so that actors check the run themselves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from broker_clients import learner_hello, run_spec
from zddrl import keys
from zddrl import protocol as P
from zddrl.broker.broker import Broker
from zddrl.config import BrokerConfig
from zddrl.transport import signatures as signing


@pytest.fixture
def key_dir(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    keys.new_key(root, "broker", "broker")
    keys.new_key(root, "learner", "learner-0")
    keys.new_key(root, "actor", "actor-0")
    return root


def recorded(b: Broker) -> list[tuple[bytes, P.Message]]:
    """The broker's control replies from now on, recorded instead of sent (the identities are made up)."""
    sent: list[tuple[bytes, P.Message]] = []
    b.replies.send_frames = lambda identity, frames: sent.append((identity, P.decode(frames)))  # type: ignore
    return sent


@pytest.fixture
def broker(key_dir: Path) -> Iterator[tuple[Broker, list[tuple[bytes, P.Message]]]]:
    """An in-process broker with keys, bound on free loopback ports; its control replies are recorded."""
    b = Broker(BrokerConfig(bind="tcp://127.0.0.1:*", keys=str(key_dir)))
    b.bind()
    try:
        yield b, recorded(b)
    finally:
        b.close()


def hello_of(run_id: str, signer: Any = None, run: dict | None = None) -> P.Hello:
    hello = learner_hello("learner-0", run_id, run or run_spec())
    return hello if signer is None else signing.signed_hello(hello, signer)


def test_a_signed_run_is_adopted_and_its_signature_goes_out_in_welcomes(broker: Any, key_dir: Path) -> None:
    b, sent = broker
    signer = keys.credentials(key_dir, "learner", "learner-0").signer
    hello = hello_of("run-a", signer)
    b.handle_control(b"L", P.encode(hello), "learner:learner-0")
    assert b.current.run_id == "run-a"
    b.handle_control(b"A", P.encode(P.Hello(role="actor", peer_id="actor-0")), "actor:actor-0")
    welcome = next(m for identity, m in sent if identity == b"A" and isinstance(m, P.Welcome))
    assert (welcome.run_signer, welcome.run_signature) == ("learner-0", hello.run_signature)
    pins = keys.pinned_learners(key_dir)
    assert signing.run_refusal(welcome.run_id, welcome.run, welcome.run_signer, welcome.run_signature, pins) == ""


ATTACKS = {
    "unsigned": lambda signer: hello_of("run-evil"),
    "rogue key under a pinned name": lambda signer: hello_of("run-evil", ("learner-0", Ed25519PrivateKey.generate())),
    "signed spec, env swapped": lambda signer: _swapped(hello_of("run-evil", signer)),
}


def _swapped(hello: P.Hello) -> P.Hello:
    run = dict(hello.run or {})
    run["env"] = {**run["env"], "id": "os:abort"}
    return P.Hello(**{**hello.__dict__, "run": run})


@pytest.mark.parametrize("attack", list(ATTACKS.values()), ids=list(ATTACKS))
def test_an_unsigned_or_forged_run_is_refused_and_the_current_run_stays(
    broker: Any, key_dir: Path, attack: Any
) -> None:
    b, sent = broker
    signer = keys.credentials(key_dir, "learner", "learner-0").signer
    b.handle_control(b"L", P.encode(hello_of("run-a", signer)), "learner:learner-0")
    b.handle_control(b"A", P.encode(P.Hello(role="actor", peer_id="actor-0")), "actor:actor-0")
    welcomes = sum(isinstance(m, P.Welcome) for _, m in sent)
    b.handle_control(b"X", P.encode(attack(signer)), "learner:learner-0")
    assert b.current.run_id == "run-a" and b.counters["runs_refused"] == 1
    reject = sent[-1][1]
    assert sent[-1][0] == b"X" and isinstance(reject, P.Reject)
    assert reject.reason.startswith(P.REFUSED_PREFIX + "run spec") and not reject.rehello
    assert sum(isinstance(m, P.Welcome) for _, m in sent) == welcomes, "no actor was re-welcomed"
    assert "learner-0" in b.members and b.members["learner-0"].identity == b"L"


def test_without_keys_an_unsigned_run_is_adopted(tmp_path: Path) -> None:
    b = Broker(BrokerConfig(bind="tcp://127.0.0.1:*"))
    try:
        b.bind()
        recorded(b)
        b.handle_control(b"L", P.encode(hello_of("run-a")), "learner:learner-0")
        assert b.current.run_id == "run-a" and b.counters["runs_refused"] == 0
    finally:
        b.close()
