"""Keeps docs/protocol.md true: its worked examples decode and re-encode to the same bytes.

Every ```frames NAME``` block of the document lists one message's frames as hex, one frame per
label (``preamble``, ``header``, ``array:<name>``; indented lines continue a frame, ``(empty)`` is a
zero-length frame). Every ```json NAME``` block is the same example's header, for readers.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest

from zddrl import protocol as P
from zddrl.broker.routing import DROP_REASONS
from zddrl.transport.params import Assembler

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
DOC = DOC_PATH.read_text(encoding="utf-8")
BLOCK = re.compile(r"^```(frames|json) ([\w-]+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
REQUIRED = {"hello", "welcome", "heartbeat", "credit", "trajectory", "params"}


def parse_frames(text: str) -> list[tuple[str, bytes]]:
    """``[(label, frame bytes)]`` of one frames block."""
    frames: list[tuple[str, str]] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line[0].isspace():
            assert frames, f"continuation line before any frame: {line!r}"
            frames[-1] = (frames[-1][0], frames[-1][1] + line.strip())
        else:
            label, _, rest = line.partition(" ")
            frames.append((label, rest.strip()))
    out = []
    for label, hexdigits in frames:
        hexdigits = "" if hexdigits == "(empty)" else hexdigits.replace(" ", "")
        assert re.fullmatch(r"([0-9a-f]{2})*", hexdigits), f"frame {label}: not lowercase hex bytes"
        out.append((label, bytes.fromhex(hexdigits)))
    return out


def blocks(kind: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for k, name, body in BLOCK.findall(DOC):
        if k == kind:
            assert name not in found, f"two {kind} blocks named {name}"
            found[name] = body
    return found


FRAMES = blocks("frames")
JSONS = blocks("json")


def wire(frames: list) -> list[bytes]:
    return [bytes(P._buffer(f)) for f in frames]


def test_required_examples_present() -> None:
    assert REQUIRED <= set(FRAMES), f"missing examples: {REQUIRED - set(FRAMES)}"
    kinds = {name.split("-")[0] for name in FRAMES}
    assert kinds == set(P.MESSAGE_TYPES), f"kinds without an example: {set(P.MESSAGE_TYPES) - kinds}"
    assert set(JSONS) == set(FRAMES), "every frames block needs its json block and vice versa"


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_example_round_trips_byte_identical(name: str) -> None:
    labelled = parse_frames(FRAMES[name])
    labels = [label for label, _ in labelled]
    frames = [data for _, data in labelled]
    msg = P.decode(frames)
    assert msg.KIND == name.split("-")[0]
    assert labels[:2] == ["preamble", "header"]
    header = msgpack.unpackb(frames[1], raw=False)
    if "arrays" in header:  # the layout travels as bin; the json block shows it unpacked
        assert isinstance(header["arrays"], bytes)
        header["arrays"] = msgpack.unpackb(header["arrays"], raw=False)
    assert labels[2:] == [f"array:{spec[0]}" for spec in header.get("arrays", [])]
    assert wire(P.encode(msg)) == frames, "re-encoding the decoded example changed its bytes"
    assert shown(header) == json.loads(JSONS[name]), "the json block does not match the header frame"


def shown(value: object) -> object:
    """A header value as the JSON blocks show it (section 11): a bin as "bin:" and its hex."""
    if isinstance(value, bytes):
        return "bin:" + value.hex()
    if isinstance(value, dict):
        return {k: shown(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shown(v) for v in value]
    return value


def example(name: str) -> P.Message:
    return P.decode([data for _, data in parse_frames(FRAMES[name])])


def test_params_examples_hashes_layout_and_chunks() -> None:
    """The documented hashes are what section 6 says, and the bfloat16 chunks rebuild the float32 weights."""
    msg = example("params")
    flat = msg.arrays["flat"]
    assert flat.dtype == np.float32 and msg.param_hash == P.param_hash(flat) and msg.chunk_hashes == [msg.param_hash]
    for row_name, dtype, shape, offset in msg.layout:
        assert dtype == "float32" and offset + int(np.prod(shape)) <= flat.size, row_name
    assert isinstance(msg.meta["rollout_len"], int)
    head, chunk = example("params-bf16"), example("params_chunk")
    wire_buffer = np.concatenate([head.arrays["flat"], chunk.arrays["data"]])
    assert wire_buffer.dtype == np.uint16 and head.numel == wire_buffer.size == flat.size
    assert head.param_hash == P.param_hash(wire_buffer)
    assert head.chunk_hashes == [P.param_hash(head.arrays["flat"]), chunk.chunk_hash]
    assert chunk.chunk_hash == P.param_hash(chunk.arrays["data"]) and chunk.index == 1
    rebuilt = (wire_buffer.astype(np.uint32) << 16).view(np.float32)  # section 6, by hand
    np.testing.assert_allclose(rebuilt, flat, rtol=1 / 128)
    assembler = Assembler()
    assert assembler.add(head) is None
    np.testing.assert_array_equal(assembler.add(chunk).arrays["flat"], rebuilt)


TRAJECTORY_SPECS = {  # name -> (dtype, shape written with T, N, K, O for obs dims)
    "obs": ("float32", "T N O"),
    "actions": ("int64", "T N"),
    "logp": ("float32", "T N"),
    "values": ("float32", "T N"),
    "rewards": ("float32", "T N"),
    "terminated": ("bool", "T N"),
    "truncated": ("bool", "T N"),
    "next_obs": ("float32", "N O"),
    "next_value": ("float32", "N"),
    "trunc_idx": ("int64", "K"),
    "trunc_obs": ("float32", "K O"),
    "trunc_value": ("float32", "K"),
}


@pytest.mark.parametrize("name", sorted(n for n in FRAMES if n.split("-")[0] == "trajectory"))
def test_trajectory_example_matches_the_documented_layout(name: str) -> None:
    msg = P.decode([data for _, data in parse_frames(FRAMES[name])])
    a = msg.arrays
    T, N = a["rewards"].shape
    obs = list(a["next_obs"].shape[1:])
    done = np.flatnonzero((a["truncated"] & ~a["terminated"]).reshape(-1))
    dims = {"T": [T], "N": [N], "K": [len(done)], "O": obs}
    want = [k for k in TRAJECTORY_SPECS if k in P.TRAJECTORY_ARRAYS or len(done)]  # truncation arrays iff K >= 1
    assert list(a) == want and tuple(TRAJECTORY_SPECS) == P.TRAJECTORY_ARRAYS + P.TRUNCATION_ARRAYS
    for key in want:
        dtype, shape = TRAJECTORY_SPECS[key]
        assert a[key].dtype == P.DTYPES[dtype], key
        assert list(a[key].shape) == [d for s in shape.split() for d in dims[s]], key
        assert f"`{key}`" in DOC
    assert msg.env_steps == T * N and msg.info["num_envs"] == N
    if len(done):
        assert a["trunc_idx"].tolist() == done.tolist()
    assert len(msg.ep_returns) == len(msg.ep_lengths) == int((a["terminated"] | a["truncated"]).sum())


def test_the_documented_protocol_version_is_this_ones() -> None:
    """Every place the text names the current version says PROTOCOL_VERSION (a "version byte 4" outlived 5 and 6)."""
    from zddrl.protocol.signing import PARAMS_TAG, RUN_TAG

    v = P.PROTOCOL_VERSION
    said = [
        *re.findall(r"^# The zddrl wire protocol \(version (\d+)\)", DOC, re.MULTILINE),
        *re.findall(r"protocol version (\d+)\)", DOC),
        *re.findall(r"the protocol\s+version, which is `(\d+)`", DOC),
        *re.findall(r"version byte `?(\d+)`?", DOC),
    ]
    assert len(said) >= 4 and {int(s) for s in said} == {v}, said
    assert f'["{RUN_TAG}"' in DOC and f'["{PARAMS_TAG}"' in DOC, "section 5.7's payload tags"


def test_constants_and_names_are_documented() -> None:
    assert P.PREAMBLE.hex() in DOC and P.PREAMBLE.hex(" ") in DOC
    # Every preamble the text spells out is this version's (a stale one once survived a version bump).
    assert set(re.findall(r"5a ?44 ?52 ?4c ?[0-9a-f]{2}", DOC)) <= {P.PREAMBLE.hex(), P.PREAMBLE.hex(" ")}
    for value in (P.MAX_HEADER_BYTES, P.MAX_ARRAYS, P.MAX_ARRAYS + 2, P.MAX_NDIM, P.DEFAULT_MAX_MESSAGE_BYTES):
        assert str(value) in DOC, value
    for dtype in P.DTYPES:
        assert re.search(rf"^\| `{dtype}`", DOC, re.MULTILINE) or f"`{dtype}` /" in DOC or f"/ `{dtype}`" in DOC, dtype
    for reason in DROP_REASONS:
        assert f"| `{reason}` |" in DOC, reason
    assert P.param_hash(b"") in DOC


def test_reject_reasons_are_the_brokers() -> None:
    """A client stops on a reject whose reason starts with REFUSED_PREFIX (section 10.1): every refusal the docs quote
    starts with it, and the revoked reject is quoted whole (once shortened to "refused: ...", which stops no one)."""
    from zddrl.broker.guard import revoked_reject

    security = (DOC_PATH.parent / "security.md").read_text(encoding="utf-8")
    for doc in (DOC, security):
        quoted = [re.sub(r'^\{reason: "', "", q) for q in re.findall(r"`([^`\n]*refused: [^`\n]*)`", doc)]
        assert quoted and all(q.startswith(P.REFUSED_PREFIX) for q in quoted), quoted
        assert f"`{revoked_reject().reason}`" in doc
    assert f"starts with `{P.REFUSED_PREFIX}`" in DOC


def test_status_rows_name_every_role() -> None:
    section_9 = re.search(r"^## 9\. Status body\n(.*?)^## 10\. ", DOC, re.MULTILINE | re.DOTALL).group(1)
    for key in ("members_by_role", "role"):
        row = re.search(rf"^\| `{key}` \|.*$", section_9, re.MULTILINE).group(0)
        assert all(f"`{role}`" in row for role in P.ROLES), row


@pytest.mark.parametrize("kind", sorted(P.MESSAGE_TYPES))
def test_every_field_is_documented(kind: str) -> None:
    section = re.search(rf"^### {kind} \((.*?)(?=^### |^## )", DOC, re.MULTILINE | re.DOTALL)
    assert section, f"no section for {kind}"
    cls = P.MESSAGE_TYPES[kind]
    for f in dataclasses.fields(cls):
        row = re.search(rf"^\| `{f.name}` \| [^|]+ \| ([^|]+) \|", section.group(0), re.MULTILINE)
        assert row, f"{kind}.{f.name} is not in its table"
        # "arrays" has a Python default but is required on the wire (it must match the frames).
        required = f.name == "arrays" or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        cell = row.group(1).strip()
        assert (cell == "required") == required, f"{kind}.{f.name}: required/default is wrong"
        if not required:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if isinstance(default, bytes):  # a bin default is shown as the empty string it is
                default = default.decode()
            assert cell == f"`{'nil' if default is None else json.dumps(default)}`", f"{kind}.{f.name} default"
    assert "*arrays*" in section.group(1).split(";")[0] or not cls.HAS_ARRAYS
    # Section 2.2: the tables list the fields in the order the encoder writes them, which the examples show.
    rows = re.findall(r"^\| `(\w+)` \|", section.group(0), re.MULTILINE)
    name = next(n for n in FRAMES if n.split("-")[0] == kind)
    header = msgpack.unpackb(parse_frames(FRAMES[name])[1][1], raw=False)
    assert ["kind", *rows] == list(header), f"{kind}: the table's field order is not the encoder's"


def test_signed_examples_verify_under_the_documented_demo_key() -> None:
    """Section 5.7: the examples' signatures are the demo key's, over the payloads the section defines."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from zddrl.transport import signatures as signing

    public = re.search(r"\(public key `([0-9a-f]{64})`\)", DOC)
    assert public, "section 5.7 names the demo public key"
    pins = {"learner-0": Ed25519PublicKey.from_public_bytes(bytes.fromhex(public.group(1)))}
    for name in ("params", "params-bf16"):
        assert signing.params_refusal(example(name), pins) == "", name
    hello, welcome = example("hello-learner"), example("welcome")
    assert isinstance(hello, P.Hello) and isinstance(welcome, P.Welcome)
    assert signing.run_refusal(hello.run_id, hello.run, hello.run_signer, hello.run_signature, pins) == ""
    assert (welcome.run_signer, welcome.run_signature) == (hello.run_signer, hello.run_signature)
    assert signing.run_refusal(welcome.run_id, welcome.run, welcome.run_signer, welcome.run_signature, pins) == ""


def test_the_learner_hellos_bus_is_what_the_reference_learner_announces_for_its_run() -> None:
    """Section 11's learner hello and welcome carry the ``bus`` a zddrl learner builds from the (abridged) run spec
    they show: the defaults of the keys the spec leaves out, not numbers of their own."""
    from zddrl.config import Config

    hello = P.decode([data for _, data in parse_frames(FRAMES["hello-learner"])])
    welcome = P.decode([data for _, data in parse_frames(FRAMES["welcome"])])
    assert isinstance(hello, P.Hello) and isinstance(welcome, P.Welcome)
    expected = Config.from_dict(hello.run or {}).hello_bus()
    assert hello.bus == expected and welcome.bus == expected


def test_the_documented_welcome_bounds_are_the_decoders() -> None:
    """Section 3's welcome table and 2.4 item 9 give the same heartbeat bounds, the decoder's; a monitor's welcome
    without data ports (closed bus) decodes."""
    bounds = f"{P.MIN_HEARTBEAT_INTERVAL_S:g}..{P.MAX_HEARTBEAT_INTERVAL_S:g}"
    assert f"| `heartbeat_interval_s` | float | required | seconds between heartbeats, in {bounds} " in DOC
    assert f"`heartbeat_interval_s` in {bounds}," in DOC
    for interval in (P.MIN_HEARTBEAT_INTERVAL_S / 2, P.MAX_HEARTBEAT_INTERVAL_S * 2):
        bad = P.Welcome("m", "", None, {}, interval, 3, 0)
        with pytest.raises(P.ProtocolError, match="heartbeat_interval_s"):
            P.decode(wire(P.encode(bad)))
    monitor = P.Welcome("monitor-0", "", None, {}, 1.0, 3, 0)
    assert P.decode(wire(P.encode(monitor))).ports == {}
