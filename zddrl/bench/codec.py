"""Encode + decode of trajectories: zddrl's frames next to pickle and msgpack-numpy, in one process.

What is timed is what each codec costs a sender and a receiver per message:

* zddrl: ``protocol.encode(msg)`` (frames ready for ``send_multipart(copy=False)``) and
  ``protocol.decode(frames)`` of the frames a socket hands the receiver (``zmq.Frame`` objects, as
  ``recv_multipart(copy=False)`` returns them; made once before timing through an inproc socket
  pair), with every check decode makes;
* pickle: ``pickle.dumps`` of the same fields and arrays, and ``pickle.loads`` of those bytes
  (in this process only: zddrl never unpickles what came off a socket);
* msgpack-numpy: ``packb``/``unpackb`` likewise (local only, for reference).

Two kinds of data, both reported:

* ``fresh``: a stream of distinct trajectories, each encoded and decoded once per pass, the pool
  bigger than the CPU caches (``FRESH_POOL_BYTES``). That is the bus's situation (every rollout is
  new memory) and the figure the target is judged on. Copying codecs pay for memory traffic here;
  zddrl's never touches the payload. Each timed pass follows an untimed one over the same stream,
  so that a codec's own state (the interpreter's, its caches, the messages' small objects) is as
  warm as in a process that runs it all the time, while the payload, three times the cache, never
  is. Without it every pass began right after another codec had flushed the caches: zddrl's
  figure then grew with the payload it never reads (22 us at 8 MiB against 11 us at 1 MiB, the
  cold start spread over 8x fewer messages).
* ``hot``: one trajectory over and over, its bytes in cache: the copying codecs' best case.

Passes interleave the codecs (noise hits all alike) and medians are kept.
"""

from __future__ import annotations

import json
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

import click
import msgpack
import zmq

from zddrl import protocol as P
from zddrl.bench import common as C

CODEC_TARGET, CODEC_PAYLOAD = 10.0, 1 << 20
CODEC_SIZES = (CODEC_PAYLOAD, 8 << 20)
"""The target is judged at 1 MiB; 8 MiB shows how the gap grows with size (zddrl's cost does not)."""
FRESH_POOL_BYTES = 96 << 20
"""Distinct trajectories per ``fresh`` pass, in bytes: three times a 32 MiB last-level cache."""
HOT_LOOP_S = 0.02
"""A ``hot`` timing repeats one message for about this long (timer noise stays small)."""


def _as_fields(msg: P.Trajectory) -> dict[str, Any]:
    """What pickle and msgpack-numpy carry: the same fields and arrays the zddrl message has."""
    return {"kind": msg.KIND, **{k: v for k, v in vars(msg).items() if k != "arrays"}, "arrays": dict(msg.arrays)}


def _received(frames_of: list[list[Any]]) -> list[list[Any]]:
    """Each message's frames as a receiving socket delivers them (zmq.Frame, zero-copy)."""
    ctx: zmq.Context = zmq.Context.instance()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        tx.bind("inproc://zddrl-bench-codec")
        rx.connect("inproc://zddrl-bench-codec")
        out = []
        for frames in frames_of:
            tx.send_multipart(frames, copy=False)
            out.append(rx.recv_multipart(copy=False))
        return out
    finally:
        tx.close(linger=0)
        rx.close(linger=0)


class _Codec:
    """``encode`` and ``decode`` of one codec, and the decoder's inputs made from the messages."""

    def __init__(
        self,
        encode: Callable[[Any], Any],
        decode: Callable[[Any], Any],
        prepare: Callable[[list[Any]], list[Any]] = list,
    ) -> None:
        self.encode, self.decode, self.prepare = encode, decode, prepare


def _codecs() -> dict[str, tuple[_Codec, Callable[[P.Trajectory], Any]]]:
    """name -> (codec, what it encodes of a message)."""
    try:  # the reference codec only: the wire never uses it, so zddrl does not depend on it
        import msgpack_numpy
    except ImportError:
        raise click.ClickException(
            "the codec bench times msgpack-numpy for reference: pip install 'zddrl[bench]'"
        ) from None
    highest = pickle.HIGHEST_PROTOCOL
    return {
        "zddrl": (_Codec(P.encode, P.decode, _received), lambda m: m),
        "pickle": (_Codec(lambda d: pickle.dumps(d, protocol=highest), pickle.loads), _as_fields),
        "msgpack-numpy": (
            _Codec(
                lambda d: msgpack.packb(d, default=msgpack_numpy.encode),
                lambda b: msgpack.unpackb(b, object_hook=msgpack_numpy.decode),
            ),
            _as_fields,
        ),
    }


def _per_item_us(fn: Callable[[Any], Any], items: list[Any], loops: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(loops):
        for item in items:
            fn(item)
    return (time.perf_counter() - t0) / (loops * len(items)) * 1e6


def run_codec(payload: int = CODEC_PAYLOAD, passes: int = 7) -> list[dict]:
    """Rows of ``codec``, ``payload_bytes``, ``data`` (fresh/hot), ``encode_us``, ``decode_us``,
    ``encode_decode_us`` and ``x_slower_than_zddrl`` (same data, same run)."""
    count = max(2, FRESH_POOL_BYTES // payload)
    messages = [C.trajectory("bench-codec", i, C.trajectory_arrays(payload, seed=i)) for i in range(count)]
    _warm_allocator()
    rows = []
    for data, pool in (("fresh", messages), ("hot", messages[:1])):
        times: dict[str, dict[str, list[float]]] = {}
        prepared = {}
        for name, (codec, view) in _codecs().items():
            items = [view(m) for m in pool]
            prepared[name] = (codec, items, codec.prepare([codec.encode(x) for x in items]))
            times[name] = {"encode": [], "decode": []}
        for _ in range(passes):
            for name, (codec, items, encoded) in prepared.items():
                for op, inputs in (("encode", items), ("decode", encoded)):
                    fn = getattr(codec, op)
                    if data == "fresh":
                        _per_item_us(fn, inputs)  # the untimed pass: see the module's docstring
                        loops = 1
                    else:
                        loops = _loops(fn, inputs[0])
                    times[name][op].append(_per_item_us(fn, inputs, loops))
        us = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
        base = us["zddrl"]["encode"] + us["zddrl"]["decode"]
        for name, u in us.items():
            total = u["encode"] + u["decode"]
            rows.append(
                {
                    "codec": name,
                    "payload_bytes": payload,
                    "data": data,
                    "encode_us": round(u["encode"], 2),
                    "decode_us": round(u["decode"], 2),
                    "encode_decode_us": round(total, 2),
                    "x_slower_than_zddrl": round(total / base, 2),
                    "messages": len(pool),
                }
            )
    return rows


def _warm_allocator() -> None:
    """Put glibc's malloc in the state of a long-running process before timing the copying codecs.

    In a fresh process every MiB-sized buffer pickle or msgpack allocates is a new mmap (page
    faults: pickle of 1 MiB then takes ~0.5 ms instead of ~0.08 ms); once a big block has been freed,
    malloc raises its mmap threshold and serves them from the heap. Which state the timings see
    would depend on what ran before, so pin the warm one: it is the copying codecs' best case.
    """
    block = bytearray(16 << 20)
    del block


def _loops(fn: Callable[[Any], Any], item: Any) -> int:
    """Repeats of ``fn(item)`` that take about HOT_LOOP_S."""
    t0 = time.perf_counter()
    fn(item)
    return max(1, int(HOT_LOOP_S / max(time.perf_counter() - t0, 1e-7)))


def codec_ratio(rows: list[dict], data: str = "fresh") -> float:
    """How many times slower pickle's encode + decode is than zddrl's at CODEC_PAYLOAD."""
    return next(
        r["x_slower_than_zddrl"]
        for r in rows
        if r["codec"] == "pickle" and r["payload_bytes"] == CODEC_PAYLOAD and r["data"] == data
    )


def format_rows(rows: list[dict]) -> str:
    """The codec rows as a table (zddrl bench codec, zddrl bench bus)."""
    header = ["payload", "data", "codec", "encode us", "decode us", "total us", "x zddrl"]
    body = [
        [
            f"{r['payload_bytes'] >> 20} MiB" if r["payload_bytes"] % (1 << 20) == 0 else str(r["payload_bytes"]),
            r["data"],
            r["codec"],
            f"{r['encode_us']:.1f}",
            f"{r['decode_us']:.1f}",
            f"{r['encode_decode_us']:.1f}",
            f"{r['x_slower_than_zddrl']:.1f}",
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *body])


@click.command("codec")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--passes",
    type=click.IntRange(1, 50),
    default=7,
    show_default=True,
    help="Timed passes per codec and kind of data (medians kept).",
)
def codec(as_json: bool, passes: int) -> None:
    """Encode + decode of a trajectory: zddrl frames vs pickle vs msgpack-numpy (also part of `bench bus`)."""
    rows = [row for size in CODEC_SIZES for row in run_codec(size, passes)]
    target = {
        "threshold": CODEC_TARGET,
        "payload_bytes": CODEC_PAYLOAD,
        "ratio": codec_ratio(rows, "fresh"),
        "hot_ratio": codec_ratio(rows, "hot"),
    }
    target["met"] = target["ratio"] >= CODEC_TARGET
    if as_json:
        click.echo(json.dumps({"bench": "codec", "codec": rows, "target": target}))
        return
    click.echo(format_rows(rows))
    click.echo(
        f"\npickle vs zddrl at 1 MiB: {target['ratio']:.1f}x on fresh trajectories (target >= "
        f"{CODEC_TARGET:g}x: {'met' if target['met'] else 'NOT met'}), {target['hot_ratio']:.1f}x hot"
    )
