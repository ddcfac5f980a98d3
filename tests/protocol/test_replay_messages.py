"""The rules of replay_sample and replay_batch (docs/protocol.md section 3 and 5.9): what a decoder refuses."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from zddrl import protocol as P


def sample(**kw: object) -> P.ReplaySample:
    fields: dict = dict(run_id="r", peer_id="l", request=1, batch=4, allow_steps=10, policy_version=0, rollout_len=8)
    return P.ReplaySample(**{**fields, **kw})


def batch_arrays(B: int = 2) -> dict[str, np.ndarray]:
    return {
        "ids": np.arange(B, dtype=np.int64),
        "priorities": np.ones(B),
        "obs": np.zeros((B, 4), np.float32),
        "next_obs": np.zeros((B, 4), np.float32),
        "actions": np.zeros(B, np.int64),
        "returns": np.ones(B, np.float32),
        "discounts": np.ones(B, np.float32),
        "versions": np.zeros(B, np.int32),
    }


def answer(**kw: object) -> P.ReplayBatch:
    fields: dict = dict(run_id="r", peer_id="x", request=1, held=3, total=2.0, min_priority=0.5, max_priority=1.0)
    fields.update(inserted=5, newest_version=0, capacity=10, nbytes=100, arrays=batch_arrays())
    return P.ReplayBatch(**{**fields, **kw})


def test_valid_messages_round_trip() -> None:
    for msg in (sample(), sample(arrays={"ids": np.arange(3), "td_errors": np.ones(3, np.float32)}), answer()):
        got = P.decode(P.encode(msg))
        assert type(got) is type(msg) and got.request == msg.request


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"batch": P.MAX_REPLAY_BATCH + 1}, "batch"),
        ({"request": -1}, "request"),
        ({"allow_steps": -5}, "allow_steps"),
        ({"rollout_len": 0}, "rollout_len"),
        ({"drop_before": -2}, "drop_before"),
        ({"arrays": {"ids": np.arange(3)}}, "priority updates"),
        ({"arrays": {"ids": np.arange(3), "td_errors": np.ones(2, np.float32)}}, "one length"),
        ({"arrays": {"ids": np.arange(2), "td_errors": np.array([1, np.nan], np.float32)}}, "finite"),
        ({"arrays": {"ids": np.arange(2.0), "td_errors": np.ones(2, np.float32)}}, "int64"),
    ],
)
def test_bad_samples_are_refused(fields: dict, why: str) -> None:
    with pytest.raises(P.ProtocolError, match=why):
        P.decode(P.encode(sample(**fields)))


def _without(name: str) -> dict:
    arrays = batch_arrays()
    del arrays[name]
    return arrays


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"total": -1.0}, "total"),
        ({"held": -1}, ">= 0"),
        ({"newest_version": -2}, "newest_version"),
        ({"ep_returns": [0.0] * (P.MAX_REPLAY_RETURNS + 1)}, "episode returns"),
        ({"arrays": _without("versions")}, "all of"),
        ({"arrays": {**batch_arrays(), "ids": np.arange(3)}}, "first dimension"),
        ({"arrays": {**batch_arrays(), "priorities": np.zeros(2)}}, "priorities"),
        ({"arrays": {**batch_arrays(), "next_obs": np.zeros((2, 4), np.uint8)}}, "share one dtype"),
        ({"arrays": {**batch_arrays(), "actions": np.zeros(2, np.int32)}}, "actions"),
    ],
)
def test_bad_answers_are_refused(fields: dict, why: str) -> None:
    with pytest.raises(P.ProtocolError, match=why):
        P.decode(P.encode(answer(**fields)))


def test_every_field_has_its_rule() -> None:
    """Each new int field of replay_batch is in the checked counts (a field added without a rule fails here)."""
    ints = {f.name for f in dataclasses.fields(P.ReplayBatch) if f.type == "int"} - {"newest_version"}
    from zddrl.protocol.rules import REPLAY_BATCH_COUNTS

    assert ints == set(REPLAY_BATCH_COUNTS)
