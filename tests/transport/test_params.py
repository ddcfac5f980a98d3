"""Chunked parameter transport: split, reassembly, hash checks, never a mix of versions; through a real broker."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from broker_clients import WAIT_S, counters, recv_control, start_run
from conftest import BrokerHandle, Bus, wait_for
from zddrl import protocol as P
from zddrl.transport.params import Assembler, FrameCache, from_transport, split, to_transport

LAYOUT = [["w", "float32", [1000], 0]]


def version(v: int, n: int = 1000, chunk_bytes: int = 1024, dtype: str = "float32", run: str = "r") -> list:
    flat = np.random.default_rng(v).normal(size=n).astype(np.float32)
    return split(
        run_id=run,
        peer_id="learner-0",
        version=v,
        flat=flat,
        layout=[["w", "float32", [n], 0]],
        extras={"obs_mean": np.full(3, v, np.float32)},
        meta={"rollout_len": v},
        chunk_bytes=chunk_bytes,
        dtype=dtype,
    )


def through_the_wire(msgs: list) -> list:
    return [P.decode([bytes(P.flat_buffer(f)) for f in m.encode()]) for m in msgs]


@pytest.mark.parametrize("dtype,tol", [("float32", 0.0), ("float16", 1e-3), ("bfloat16", 8e-3)])
def test_split_and_reassemble(dtype: str, tol: float) -> None:
    msgs = through_the_wire(version(3, dtype=dtype))
    item = np.dtype(P.DTYPES[P.PARAM_DTYPES[dtype]]).itemsize
    assert len(msgs) == -(-1000 * item // 1024) and msgs[0].num_chunks == len(msgs)
    assert all(P.message_nbytes(m.encode()) < 1024 + 600 for m in msgs[1:])  # bounded: one chunk + a header
    out = [Assembler().add(m) for m in msgs]
    whole = Assembler()
    for m in msgs[:-1]:
        assert whole.add(m) is None  # nothing until the last chunk is in
    got = whole.add(msgs[-1])
    want = np.random.default_rng(3).normal(size=1000).astype(np.float32)
    assert got.policy_version == 3 and got.arrays["flat"].dtype == np.float32 and got.meta == {"rollout_len": 3}
    np.testing.assert_allclose(got.arrays["flat"], want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(got.arrays["obs_mean"], [3, 3, 3])
    assert got.param_hash == msgs[0].param_hash == P.param_hash(to_transport(want, dtype))
    assert out[1:] == [None] * (len(out) - 1)


def test_bfloat16_rounds_as_torch_does() -> None:
    x = np.concatenate(
        [
            np.random.default_rng(0).normal(size=10_000) * 10.0 ** np.arange(-5, 5).repeat(1000),
            [0.0, -0.0, np.inf, -np.inf, 1e-40],
        ]
    ).astype(np.float32)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(to_transport(x, "bfloat16"), want)
    assert np.isnan(from_transport(to_transport(np.array([np.nan], np.float32), "bfloat16"), "bfloat16")).all()


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False), st.floats(0.0, 0.3))
def test_interleaved_versions_never_mix(rnd: random.Random, loss: float) -> None:
    """Chunks of versions 1 and 2 (and repeats of version 1) arrive interleaved in any order, some
    lost: whatever comes out is one whole version, exactly as published, and versions only rise."""
    wanted = {v: np.random.default_rng(v).normal(size=1000).astype(np.float32) for v in (1, 2)}
    stream = version(1) + version(2) + version(1)
    rnd.shuffle(stream)
    stream = [m for m in stream if rnd.random() >= loss]
    assembler = Assembler()
    got = [p for p in map(assembler.add, through_the_wire(stream)) if p is not None]
    assert [p.policy_version for p in got] == sorted({p.policy_version for p in got})
    for p in got:
        np.testing.assert_array_equal(p.arrays["flat"], wanted[p.policy_version])
        np.testing.assert_array_equal(p.arrays["obs_mean"], np.full(3, p.policy_version))
    assert sum(assembler.rejected[r] for r in ("chunk_hash", "whole_hash", "bad_chunk")) == 0


def test_a_damaged_chunk_is_refused_and_a_resend_completes_the_version() -> None:
    msgs = through_the_wire(version(5))
    bad = msgs[2].arrays["data"].copy()
    bad[7] += 1.0
    assembler = Assembler()
    for m in msgs[:2]:
        assembler.add(m)
    assert assembler.add(P.ParamChunk(**{**msgs[2].__dict__, "arrays": {"data": bad}})) is None
    assert assembler.rejected["chunk_hash"] == 1
    for m in msgs[3:]:
        assert assembler.add(m) is None  # chunk 2 is still missing
    got = assembler.add(msgs[2])  # the broker's resend of the version
    np.testing.assert_array_equal(got.arrays["flat"], np.random.default_rng(5).normal(size=1000).astype(np.float32))


def test_forged_whole_hash_orphans_old_and_foreign_runs() -> None:
    msgs = version(2)
    forged = [P.Parameters(**{**msgs[0].__dict__, "param_hash": "0" * 16})] + [
        P.ParamChunk(**{**m.__dict__, "param_hash": "0" * 16}) for m in msgs[1:]
    ]
    assembler = Assembler()
    assert [assembler.add(m) for m in forged] == [None] * len(forged)
    assert assembler.rejected["whole_hash"] == 1
    assert assembler.add(msgs[3]) is None and assembler.rejected["orphan_chunk"] == 1
    for m in msgs:
        got = assembler.add(m)
    assert got.policy_version == 2
    assert assembler.add(version(1)[0]) is None and assembler.rejected["old"] == 1
    assert assembler.add(version(1, run="other")[0]) is None  # a new run: version 1 starts building again
    assert (1, version(1, run="other")[0].param_hash) in assembler.building


def test_frame_cache_keeps_the_newest_whole_version() -> None:
    cache = FrameCache()
    v1, v2 = version(1), version(2)
    assert cache.add(v1[0], ["v1-0"]) == "building" and cache.add(v2[1], ["x"]) == "orphan_chunk"
    assert cache.add(v1[1], ["v1-1"]) == "building" and cache.add(v1[1], ["v1-1"]) == "duplicate"
    assert cache.add(v2[0], ["v2-0"]) == "building"  # a newer version replaces the one in progress
    outcomes = [cache.add(m, [f"v2-{i}"]) for i, m in enumerate(v2[1:], 1)]
    assert outcomes[-1] == "complete" and set(outcomes[:-1]) == {"building"}
    assert cache.version == 2 and cache.messages == [[f"v2-{i}"] for i in range(len(v2))]
    assert cache.add(v1[0], ["late"]) == "stale"


@pytest.mark.slow
def test_broker_streams_chunks_and_gives_late_joiners_the_whole_version(broker: BrokerHandle, bus: Bus) -> None:
    learner = start_run(bus, broker)
    msgs = version(4, n=50_000, chunk_bytes=64 << 10, dtype="bfloat16", run="run-a")
    assert len(msgs) == 2
    for m in version(3, n=50_000, chunk_bytes=64 << 10, run="run-a")[:-1] + msgs:  # v3 never completes
        learner.sock.send_multipart(P.encode(m))
    wait_for(lambda: counters(broker, bus)["policy_version"] == 4, WAIT_S, "version 4 to be whole at the broker")
    link = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-0"), subscribe_params=True)
    got = link.wait_params(newer_than=-1, timeout_s=WAIT_S)
    assert got.policy_version == 4 and got.param_hash == msgs[0].param_hash
    want = np.random.default_rng(4).normal(size=50_000).astype(np.float32)
    np.testing.assert_allclose(got.arrays["flat"], want, rtol=8e-3, atol=1e-6)
    control = bus.socket(zmq.DEALER)  # a raw client sees the snapshot: the version's messages in order
    control.connect(broker.connect)
    control.send_multipart(P.encode(P.Hello(role="actor", peer_id="raw")))
    assert isinstance(recv_control(control), P.Welcome)
    kinds = [recv_control(control, 2000) for _ in msgs]
    assert [(type(k), k.policy_version) for k in kinds] == [(P.Parameters, 4), (P.ParamChunk, 4)]


@pytest.mark.slow
def test_train_learns_with_bfloat16_parameters_in_chunks(tmp_path) -> None:
    """The whole system with the CartPole model (~9k parameters) sent as 5 bfloat16 chunks of 4 KiB."""
    from test_train import train

    summary = train(
        tmp_path / "run",
        "--until-return",
        "200",
        "--set",
        'learner.param_dtype="bfloat16"',
        "--set",
        "learner.param_chunk_bytes=4096",
    )
    assert summary["reached"] is True and summary["return_at_target"] >= 200
