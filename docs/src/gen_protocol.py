"""Regenerates docs/protocol.md from docs/src/protocol.md.in, filling in the worked examples' exact bytes.

Run from the repository root after changing a message format:
    python docs/src/gen_protocol.py fill docs/src/protocol.md.in > docs/protocol.md
tests/protocol/test_protocol_docs.py fails until the examples match the code again.
"""

import json, sys
from pathlib import Path
import numpy as np
import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zddrl import protocol as P
from zddrl.config import Config
from zddrl.transport import signatures as signing
from zddrl.transport.params import split

RUN = {
    "name": "demo",
    "env": {"id": "CartPole-v1", "num_envs": 2, "rollout_len": 2},
    "model": {"hidden": [1], "activation": "tanh"},
    "algo": {"name": "ppo", "schedule": "sync", "batch_size": 4},
}
RUN_ID = "demo-1a2b3c4d"
DEMO_SIGNER = ("learner-0", Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
"""The demo signing key of section 5.7 (Ed25519 signatures are deterministic: the examples are fixed bytes)."""


def traj():
    f32 = np.float32
    arrays = {
        "obs": np.array([[[0.5, -0.5], [1.0, 0.0]], [[0.25, 0.0], [-1.0, 2.0]]], f32),
        "actions": np.array([[1, 0], [0, 1]], np.int64),
        "logp": np.array([[-0.5, -1.0], [-0.75, -0.25]], f32),
        "values": np.array([[1.5, 2.0], [1.0, 0.5]], f32),
        "rewards": np.array([[1.0, 1.0], [1.0, 1.0]], f32),
        "terminated": np.array([[True, False], [False, False]]),
        "truncated": np.array([[False, False], [False, True]]),
        "next_obs": np.array([[0.0, 0.125], [0.5, 0.5]], f32),
        "next_value": np.array([1.25, 2.5], f32),
        "trunc_idx": np.array([3], np.int64),
        "trunc_obs": np.array([[-1.5, 2.5]], f32),
        "trunc_value": np.array([0.75], f32),
    }
    return P.Trajectory(
        run_id=RUN_ID,
        peer_id="actor-0",
        seq=7,
        policy_version=3,
        param_hash="0123456789abcdef",
        env_steps=4,
        arrays=arrays,
        info={"actor_id": 0, "num_envs": 2, "total_env_steps": 32},
        ep_returns=[3.0, 500.0],
        ep_lengths=[3, 500],
    )


def params(chunk_bytes=4 << 20, dtype="float32"):
    # obs [2], model.hidden [1], Discrete(2): pi 2 -> 1 -> 2 logits, v 2 -> 1 -> 1
    flat = np.array([0.5, -0.5, 0.0, 1.0, -1.0, 0.0, 0.0, 0.25, 0.75, 0.0, 2.0, 0.5], np.float32)
    layout = [
        ["pi.0.weight", "float32", [1, 2], 0],
        ["pi.0.bias", "float32", [1], 2],
        ["pi.2.weight", "float32", [2, 1], 3],
        ["pi.2.bias", "float32", [2], 5],
        ["v.0.weight", "float32", [1, 2], 7],
        ["v.0.bias", "float32", [1], 9],
        ["v.2.weight", "float32", [1, 1], 10],
        ["v.2.bias", "float32", [1], 11],
    ]
    return split(
        run_id=RUN_ID,
        peer_id="learner-0",
        version=3,
        flat=flat,
        layout=layout,
        extras={"obs_mean": np.array([0.0, 0.5], np.float32), "obs_var": np.array([1.0, 4.0], np.float32)},
        meta={"rollout_len": 2},
        chunk_bytes=chunk_bytes,
        dtype=dtype,
        signer=DEMO_SIGNER,
    )


STATUS = {
    "broker": {
        "uptime_s": 12.5,
        "host": "node0",
        "run_id": RUN_ID,
        "policy_version": 3,
        "ports": {"control": 5555, "trajectories": 5556, "learners": 5557, "params": 5558},
        "received": 10,
        "forwarded": 9,
        "dropped": {
            "malformed": 0,
            "unknown_sender": 0,
            "unknown_run": 0,
            "stale": 1,
            "unknown_version": 0,
            "no_route": 0,
        },
        "in_flight": 0,
        "bytes_in": 14000,
        "bytes_out": 12600,
        "accounted": True,
        "params_published": 4,
    },
    "members": {
        "actor-0": {
            "role": "actor",
            "host": "node1",
            "pid": 4242,
            "num_envs": 2,
            "policy_version": 3,
            "last_seen_s": 0.25,
            "credit": 0,
            "messages": 9,
            "bytes": 12600,
            "env_steps": 36,
            "dropped_stale": 1,
            "stats": {"sps": 900.0},
        }
    },
}

LEARNER_HELLO = signing.signed_hello(
    P.Hello(
        role="learner",
        peer_id="learner-0",
        host="node0",
        pid=4100,
        run_id=RUN_ID,
        run=RUN,
        bus=Config.from_dict(RUN).hello_bus(),  # what the reference learner announces for this run
    ),
    DEMO_SIGNER,
)

EXAMPLES = [
    ("hello", P.Hello(role="actor", peer_id="actor-0", host="node1", pid=4242, num_envs=2)),
    ("hello-learner", LEARNER_HELLO),
    (
        "welcome",
        P.Welcome(
            peer_id="actor-0",
            run_id=RUN_ID,
            run=RUN,
            ports={"trajectories": 5556, "learners": 5557, "params": 5558},
            heartbeat_interval_s=1.0,
            heartbeat_liveness=3,
            max_message_bytes=1 << 28,
            run_signer=LEARNER_HELLO.run_signer,
            run_signature=LEARNER_HELLO.run_signature,
            bus=LEARNER_HELLO.bus,
        ),
    ),
    ("heartbeat", P.Heartbeat(peer_id="actor-0", policy_version=3)),
    ("reject", P.Reject(reason="unknown peer: send hello first", rehello=True)),
    ("credit", P.Credit(peer_id="learner-0", credit=16)),
    ("params_request", P.ParamsRequest(peer_id="actor-0", policy_version=2)),
    ("trajectory", traj()),
    ("params", params()[0]),
    ("params-bf16", params(chunk_bytes=16, dtype="bfloat16")[0]),
    ("params_chunk", params(chunk_bytes=16, dtype="bfloat16")[1]),
    (
        "trajectory-empty",
        P.Trajectory(
            run_id=RUN_ID,
            peer_id="actor-1",
            seq=0,
            policy_version=0,
            param_hash="f160f70460b5fe44",
            env_steps=1,
            arrays={
                "obs": np.zeros((1, 1, 2), np.float32),
                "actions": np.zeros((1, 1), np.int64),
                "logp": np.full((1, 1), -0.5, np.float32),
                "values": np.zeros((1, 1), np.float32),
                "rewards": np.ones((1, 1), np.float32),
                "terminated": np.zeros((1, 1), bool),
                "truncated": np.zeros((1, 1), bool),
                "next_obs": np.zeros((1, 2), np.float32),
                "next_value": np.zeros(1, np.float32),
            },
            info={"actor_id": 1, "num_envs": 1, "total_env_steps": 1},
        ),
    ),
    ("stats", P.Stats(peer_id="actor-0", role="actor", stats={"env_steps": 36, "sps": 900.0, "comm_share": 0.125})),
    ("status_request", P.StatusRequest(peer_id="status")),
    ("status", P.Status(body=STATUS)),
    (
        "fleet",
        P.Fleet(
            run_id=RUN_ID,
            seq=1764547200042,
            actors={"actor-0": {"num_envs": 2, "host": "node1"}, "actor-1": {"num_envs": 0, "host": "node2"}},
        ),
    ),
    (
        "subtree",
        P.Subtree(
            peer_id="relay-rack7-5555",
            seq=12,
            full=False,
            actors={"actor-9": {"num_envs": 4, "host": "node9", "pid": 4242}},
            left=["actor-3"],
            counters={"received": 120, "forwarded": 118, "in_flight": 0, "dropped_stale": 2},
        ),
    ),
    (
        "replay_sample",
        P.ReplaySample(
            run_id=RUN_ID,
            peer_id="learner-0",
            request=7,
            batch=2,
            allow_steps=4096,
            policy_version=3,
            rollout_len=16,
            report=True,
            arrays={"ids": np.array([5, 9], np.int64), "td_errors": np.array([0.5, 0.25], np.float32)},
        ),
    ),
    (
        "replay_batch",
        P.ReplayBatch(
            run_id=RUN_ID,
            peer_id="replay-0",
            request=7,
            held=1200,
            total=950.5,
            min_priority=0.125,
            max_priority=2.0,
            inserted=1280,
            newest_version=3,
            capacity=100000,
            nbytes=6800000,
            env_steps=128,
            trajectories=2,
            ep_returns=[21.0, 35.0],
        ),
    ),
    ("bye", P.Bye(peer_id="actor-0", reason="actor stopping")),
]


def wrap(h, first_prefix, width=64):
    lines = [h[i : i + width] for i in range(0, len(h), width)] or ["(empty)"]
    pad = " " * len(first_prefix)
    return [first_prefix + lines[0]] + [pad + l for l in lines[1:]]


def shown(value):
    """A header value as the JSON blocks show it: a bin as "bin:" and its hex."""
    if isinstance(value, bytes):
        return "bin:" + value.hex()
    if isinstance(value, dict):
        return {k: shown(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shown(v) for v in value]
    return value


def block(name, msg):
    frames = [bytes(P._buffer(f)) for f in P.encode(msg)]
    header = msgpack.unpackb(frames[1], raw=False)
    if "arrays" in header:  # travels as bin (section 2.3); shown unpacked
        header["arrays"] = msgpack.unpackb(header["arrays"], raw=False)
    rows = []
    for k, v in header.items():
        if k in ("arrays", "layout") and v:
            inner = ",\n".join("    " + json.dumps(r) for r in v)
            rows.append(f"  {json.dumps(k)}: [\n{inner}\n  ]")
        else:
            rows.append(f"  {json.dumps(k)}: {json.dumps(shown(v))}")
    out = [f"```json {name}", "{\n" + ",\n".join(rows) + "\n}", "```", "", f"```frames {name}"]
    labels = ["preamble", "header"] + [f"array:{s[0]}" for s in header.get("arrays", [])]
    w = max(len(l) for l in labels) + 2
    for label, f in zip(labels, frames):
        out += wrap(f.hex(), label.ljust(w))
    out.append("```")
    return "\n".join(out)


def fill(template):
    blocks = {n: block(n, m) for n, m in EXAMPLES}
    import re

    return re.sub(r"<!-- EXAMPLE ([\w-]+) -->", lambda m: blocks[m.group(1)], template)


if __name__ == "__main__" and sys.argv[1:2] == ["fill"]:
    sys.stdout.write(fill(open(sys.argv[2]).read()))
    sys.exit(0)

if __name__ == "__main__":
    which = sys.argv[1:] or [n for n, _ in EXAMPLES]
    for n, m in EXAMPLES:
        if n in which:
            print(f"<!-- {n} -->")
            print(block(n, m))
            print()
