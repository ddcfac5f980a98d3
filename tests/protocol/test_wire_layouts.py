"""Layout caches (zddrl.protocol.frames): a layout seen before skips its spec checks, never the checks of the frames."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from zddrl import protocol as P
from zddrl.protocol import frames as W

HEADER = {
    "kind": "trajectory",
    "run_id": "r",
    "peer_id": "s",
    "seq": 0,
    "policy_version": 0,
    "param_hash": "",
    "env_steps": 2,
    "info": {},
}
# A trajectory of T = 2 steps of N = 1 env with 3-dim observations: obs first, terminated sixth.
SPECS = [
    ["obs", "float32", [2, 1, 3]],
    ["actions", "int64", [2, 1]],
    ["logp", "float32", [2, 1]],
    ["values", "float32", [2, 1]],
    ["rewards", "float32", [2, 1]],
    ["terminated", "bool", [2, 1]],
    ["truncated", "bool", [2, 1]],
    ["next_obs", "float32", [1, 3]],
    ["next_value", "float32", [1]],
]
FRAMES = [
    np.zeros(6, np.float32).tobytes(),
    bytes(16),
    bytes(8),
    bytes(8),
    bytes(8),
    b"\x00\x01",
    bytes(2),
    bytes(12),
    bytes(4),
]
TOTAL = sum(map(len, FRAMES))  # 90 bytes


def message(specs=SPECS, frames=FRAMES, layout: bytes | None = None) -> list:
    layout = msgpack.packb(specs, use_bin_type=True) if layout is None else layout
    return [P.PREAMBLE, msgpack.packb({**HEADER, "arrays": layout}, use_bin_type=True), *frames]


@pytest.fixture(autouse=True)
def empty_caches():
    W.forget_layouts()
    yield
    W.forget_layouts()


@pytest.fixture
def spec_checks(monkeypatch) -> list:
    """Counts the full validations of a layout's specs."""
    calls: list = []
    check = W._check_specs
    monkeypatch.setattr(W, "_check_specs", lambda specs: calls.append(specs) or check(specs))
    return calls


def decode_both(frames: list, limit: int = P.DEFAULT_MAX_MESSAGE_BYTES) -> P.Trajectory:
    """decode, and validate_trajectory agreeing with it."""
    msg = P.decode(frames, limit)
    assert P.validate_trajectory(frames, limit)["arrays"] == SPECS
    return msg


def test_a_known_layout_is_checked_once(spec_checks: list) -> None:
    for _ in range(3):
        msg = decode_both(message())
        assert msg.arrays["obs"].shape == (2, 1, 3) and msg.arrays["terminated"].tolist() == [[False], [True]]
    assert len(spec_checks) == 1


@pytest.mark.parametrize(
    "frames,error",
    [
        ([FRAMES[0][:-4], *FRAMES[1:]], "array 'obs': shape [2, 1, 3] x float32 needs 24 bytes, frame has 20"),
        ([FRAMES[0] + b"\x00", *FRAMES[1:]], "array 'obs': shape [2, 1, 3] x float32 needs 24 bytes, frame has 25"),
        ([*FRAMES[:5], b"", *FRAMES[6:]], "array 'terminated': shape [2, 1] x bool needs 2 bytes, frame has 0"),
        (FRAMES[:-1], "header names 9 arrays but 8 array frames follow"),
        ([*FRAMES, b""], "header names 9 arrays but 10 array frames follow"),
    ],
)
def test_a_cached_layout_still_checks_every_frame(frames: list, error: str) -> None:
    decode_both(message())  # the layout is cached now
    for fn in (P.decode, lambda f: P.validate_trajectory(f, P.DEFAULT_MAX_MESSAGE_BYTES)):
        with pytest.raises(P.ProtocolError) as info:
            fn(message(frames=frames))
        assert str(info.value) == error


def test_a_cached_layout_still_meets_each_callers_limit() -> None:
    decode_both(message(), limit=TOTAL)
    with pytest.raises(P.ProtocolError, match=f"exceed the {TOTAL - 1}-byte limit"):
        P.decode(message(), TOTAL - 1)
    with pytest.raises(P.ProtocolError, match="array 'obs': shape \\[2, 1, 3\\] is too large for the 23-byte limit"):
        P.validate_trajectory(message(), 23)


@pytest.mark.parametrize(
    "specs,error",
    [
        ([["obs", "float32", [2, True, 3]], *SPECS[1:]], "shape [2, True, 3] must be a list"),
        ([["obs", "float32", [2, 1, 3.0]], *SPECS[1:]], "shape [2, 1, 3.0] must be a list"),
        ([["obs", "float64", [2, 1, 3]], *SPECS[1:]], "needs 48 bytes, frame has 24"),
        ([*SPECS[:5], ["obs", "bool", [2, 1]], *SPECS[6:]], "duplicate array name 'obs'"),
        ([["obs", "<f4", [2, 1, 3]], *SPECS[1:]], "dtype '<f4' is not allowed"),
        ([["obs", "float32", [1, 2, 3]], *SPECS[1:]], "'actions' must be int64 [1, 2]"),  # a trajectory rule
    ],
)
def test_a_changed_layout_is_validated_afresh(spec_checks: list, specs: list, error: str) -> None:
    """Values equal in Python (True == 1, 3.0 == 3) are other bytes on the wire: no cache hit for them."""
    decode_both(message())
    with pytest.raises(P.ProtocolError, match=error.replace("[", "\\[").replace("]", "\\]")):
        P.decode(message(specs))
    assert len(spec_checks) == 2


def test_a_trajectory_rule_runs_once_per_layout_and_a_refused_one_is_not_remembered(monkeypatch) -> None:
    calls: list = []
    rule = P.check_trajectory_layout
    monkeypatch.setitem(P._LAYOUT_RULES, P.Trajectory, lambda layout: (calls.append(1), rule(layout)))
    for _ in range(3):
        decode_both(message())
    assert len(calls) == 1
    refused = message([*SPECS[:-1], [SPECS[-1][0], "float64", SPECS[-1][2]]], [*FRAMES[:-1], FRAMES[-1] * 2])
    for _ in range(2):
        with pytest.raises(P.ProtocolError, match="must be"):
            P.decode(refused)
    assert len(calls) == 3


def test_a_refused_layout_is_not_remembered(spec_checks: list) -> None:
    bad = message([["obs", "float32", [2, -3]], *SPECS[1:]])
    for _ in range(2):
        with pytest.raises(P.ProtocolError, match="must be a list of at most 8 non-negative ints"):
            P.decode(bad)
    assert len(spec_checks) == 2 and not W._DECODED


def test_caches_are_bounded_in_entries_and_in_size(spec_checks: list) -> None:
    for n in range(W.LAYOUT_CACHE_SIZE + 10):
        with pytest.raises(P.ProtocolError, match="missing arrays"):  # a valid layout, not a trajectory's
            P.decode(message([["obs", "uint8", [n]]], [b"\x00" * n]))
        P.encode(
            P.Trajectory(
                run_id="r",
                peer_id="s",
                seq=0,
                policy_version=0,
                param_hash="",
                env_steps=0,
                arrays={"obs": np.zeros(n, np.uint8)},
            )
        )
    assert 0 < len(W._DECODED) <= W.LAYOUT_CACHE_SIZE and 0 < len(W._ENCODED) <= W.LAYOUT_CACHE_SIZE
    W._DECODED.clear()
    long_name = "x" * W.MAX_CACHED_LAYOUT_BYTES
    frames = message([[long_name, "uint8", [1]]], [b"\x00"])
    for _ in range(2):
        with pytest.raises(P.ProtocolError, match="missing arrays"):
            P.decode(frames)
    assert not W._DECODED and not any(W._RULED.values()) and len(spec_checks) == W.LAYOUT_CACHE_SIZE + 12


def test_encode_packs_a_layout_once_and_as_plain_msgpack() -> None:
    arrays = {"obs": np.zeros((2, 3), np.float32), "done": np.array([False, True])}
    msg = P.Trajectory(run_id="r", peer_id="s", seq=0, policy_version=0, param_hash="", env_steps=0, arrays=arrays)
    first, second = P.encode(msg), P.encode(msg)
    layout = msgpack.unpackb(first[1])["arrays"]
    specs = [["obs", "float32", [2, 3]], ["done", "bool", [2]]]
    assert layout == msgpack.unpackb(second[1])["arrays"] == msgpack.packb(specs, use_bin_type=True)
    assert len(W._ENCODED) == 1
    other = P.encode(P.Trajectory(**{**vars(msg), "arrays": {**arrays, "obs": np.zeros((3, 2), np.float32)}}))
    assert msgpack.unpackb(msgpack.unpackb(other[1])["arrays"])[0] == ["obs", "float32", [3, 2]]
    with pytest.raises(P.ProtocolError, match="array name '' must be a non-empty string"):
        P.encode(P.Trajectory(**{**vars(msg), "arrays": {"": np.zeros(1)}}))


def test_a_cached_encode_layout_never_lets_an_array_skip_its_conversion() -> None:
    """The encode cache is keyed by dtype objects: a big-endian or non-wire array with a cached
    layout's names and shapes misses it and is converted (or refused), never sent as it is."""

    def traj(arrays: dict) -> P.Parameters:  # a params message: its extra arrays may be anything
        return P.Parameters(run_id="r", peer_id="s", policy_version=0, param_hash="", layout=[], arrays=arrays)

    little = {"x": np.arange(4, dtype="<f4").reshape(2, 2)}
    P.encode(traj(little))
    big = {"x": np.arange(4, dtype=">f4").reshape(2, 2)}
    frames = P.encode(traj(big))
    assert frames[1] == P.encode(traj(little))[1] and frames[2].dtype == np.dtype("<f4")
    assert P.decode(frames).arrays["x"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    transposed = {"x": np.arange(4, dtype="<f4").reshape(2, 2).T}  # same layout, not C-contiguous
    assert P.decode(P.encode(traj(transposed))).arrays["x"].tolist() == [[0.0, 2.0], [1.0, 3.0]]
    with pytest.raises(P.ProtocolError, match="dtype complex64 cannot travel"):
        P.encode(traj({"x": np.zeros((2, 2), np.complex64)}))

    class Sub(np.ndarray):
        pass

    sub = np.arange(4, dtype="<f4").reshape(2, 2).view(Sub)
    assert type(P.encode(traj({"x": sub}))[2]) is np.ndarray  # subclasses travel as plain arrays
