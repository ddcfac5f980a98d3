"""`zddrl bench bus`, parameter broadcasts: latency from a learner's send to the moment the last of N subscribed
actors holds the verified version, on an open bus and (``--secure``) on a closed one, where every version is
signed by the learner and checked by the broker and each actor, and every hop is CURVE-encrypted. Also the cost
of a signature alone: signing a version's head and checking it, in this process.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import numpy as np
import zmq
from loguru import logger

from zddrl import protocol as P
from zddrl.bench import common as C
from zddrl.bench.bus_report import size_label
from zddrl.proc import free_ports

BCAST_REPS = (20, 5)
"""Repetitions for broadcasts under / over 10 MB (the big ones take ~0.1-1 s each)."""
BCAST_TIMEOUT_S = 30.0
SIGN_REPS = 200


def _ep(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


class BenchPublisher:
    """The learner side of a broadcast: joined as the run's learner, publishing on its DEALER (signed versions
    on a closed bus)."""

    def __init__(self, control: str, learner_port: int, keys_dir: str | None = None) -> None:
        self.run_id = f"bench-bcast-{uuid.uuid4().hex[:8]}"
        self.link = C.link_of(control, C.make_hello("learner", C.LEARNER_ID, self.run_id), keys_dir=keys_dir)
        self.sock: zmq.Socket = self.link.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.link.data_identity)
        self.sock.connect(_ep(learner_port))
        self.version = 0
        self.publish(np.zeros(16, np.float32))

    def publish(self, flat: np.ndarray) -> float:
        """Send the next version; returns the monotonic time after its hash (the learner hashes every version
        on either bus) and before its signature, encoding and send."""
        params = C.parameters(self.run_id, self.version, flat)
        started = time.monotonic()
        self.sock.send_multipart(P.encode(C.signed(params, self.link.credentials)), copy=False)
        return started

    def close(self) -> None:
        self.sock.close(linger=0)
        self.link.close()


def run_broadcast(
    workers: C.Workers, sizes: list[int], counts: list[int], broker_spec: str, keys_dir: str | None = None
) -> list[dict]:
    ports = free_ports(4)
    workers.start("bcast-broker", C.broker_main, ports, broker_spec, keys_dir)
    slots = C.shared_slots(max(counts))
    pub = BenchPublisher(_ep(ports[0]), ports[2], keys_dir)
    rows, started = [], 0
    try:
        for count in sorted(counts):
            for index in range(started, count):  # subscribers join once and stay for larger counts
                workers.start(f"subscriber-{index}", C.subscriber_main, _ep(ports[0]), index, slots, keys_dir)
            started = count
            _wait_versions(workers, slots, count, pub.version)  # late joiners get the cached version
            for size in sizes:
                rows.append(_broadcast_row(workers, pub, slots, size, count, keys_dir is not None))
    finally:
        pub.close()
    return rows


def _broadcast_row(workers: C.Workers, pub: BenchPublisher, slots: Any, size: int, count: int, closed: bool) -> dict:
    flat = np.random.default_rng(size).standard_normal(size // 4, np.float32)
    reps = BCAST_REPS[0] if size < 10_000_000 else BCAST_REPS[1]
    latencies = []
    for rep in range(reps + 1):  # the first one warms the path (buffers, page faults) and is not kept
        pub.version += 1
        flat[0] = pub.version  # every version has its own hash
        sent = pub.publish(flat)
        _wait_versions(workers, slots, count, pub.version)
        if rep:
            latencies.append((max(slots[2 * i + 1] for i in range(count)) - sent) * 1e3)
    bus = "closed" if closed else "open"
    logger.info(f"broadcast {size_label(size)} to {count} ({bus}): median {statistics.median(latencies):.2f} ms")
    return {
        "bus": bus,
        "payload_bytes": size,
        "subscribers": count,
        "latency_ms": round(statistics.median(latencies), 3),
        "min_ms": round(min(latencies), 3),
        "max_ms": round(max(latencies), 3),
        "reps": reps,
    }


def _wait_versions(workers: C.Workers, slots: Any, count: int, version: int) -> None:
    workers.wait(
        lambda: all(slots[2 * i] >= version for i in range(count)),
        BCAST_TIMEOUT_S,
        f"{count} subscribers to hold parameters version {version}",
    )


def run_signing(keys_dir: str, sizes: list[int]) -> list[dict]:
    """Microseconds to sign a version's head and to check it, per parameter size (the signature covers the
    header, whose hashes were computed anyway: its cost hardly grows with the weights)."""
    from zddrl.transport.signatures import params_refusal

    creds = C.client_credentials(keys_dir, "learner")
    rows = []
    for size in sizes:
        head = C.parameters("bench-sign", 1, np.zeros(size // 4, np.float32))
        t0 = time.perf_counter()
        for _ in range(SIGN_REPS):
            signed = C.signed(head, creds)
        t1 = time.perf_counter()
        for _ in range(SIGN_REPS):
            assert params_refusal(signed, creds.pins) == ""
        t2 = time.perf_counter()
        rows.append(
            {
                "payload_bytes": size,
                "sign_us": round((t1 - t0) / SIGN_REPS * 1e6, 1),
                "verify_us": round((t2 - t1) / SIGN_REPS * 1e6, 1),
            }
        )
    return rows
