"""A replay's own socket on a closed bus (docs/security.md "Replay services"): a CURVE server with the replay's key
pair whose ZAP handler admits the keys in KEYS/learners/ only, re-read while it serves."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import zmq

from zddrl import protocol as P
from zddrl.config import Config
from zddrl.envs import EnvSpec
from zddrl.keys import credentials, folder, public_key
from zddrl.ops.train import throwaway_keys
from zddrl.replay.client import RemoteReplay
from zddrl.replay.service import ReplayService
from zddrl.transport.io import NOBLOCK, recv_frames

SPEC = EnvSpec((4,), True, 2)
CONFIG = Config().replace({"algo.name": "apex", "replay.placement": "service"})
WAIT_MS = 5000


@pytest.fixture
def served() -> Iterator[tuple[zmq.Context, ReplayService, zmq.Socket, str]]:
    keys_dir = throwaway_keys()
    ctx = zmq.Context()
    svc = ReplayService(
        "tcp://127.0.0.1:1",  # no broker needed: only the replay's own socket is exercised
        "tcp://127.0.0.1:0",
        context=ctx,
        credentials=credentials(str(keys_dir), "replay", None),
        learner_keys=folder(str(keys_dir), "learner"),
    )
    server = svc._open_server()
    try:
        yield ctx, svc, server, str(keys_dir)
    finally:
        server.close(linger=0)
        if svc._auth is not None:
            svc._auth.stop()
        ctx.destroy(linger=0)
        shutil.rmtree(keys_dir, ignore_errors=True)


def client(ctx: zmq.Context, svc: ReplayService, keys_dir: str, role: str) -> RemoteReplay:
    return RemoteReplay(
        [f"tcp://127.0.0.1:{svc.port}"],
        CONFIG,
        SPEC,
        "r",
        f"{role}-0",
        context=ctx,
        credentials=credentials(keys_dir, role, None),
        replay_public=public_key(keys_dir, "replay", None),
    )


def requests(server: zmq.Socket, wait_ms: int) -> list[P.Message]:
    got: list[P.Message] = []
    while server.poll(wait_ms if not got else 50):
        got.append(P.decode(P.split_routed(recv_frames(server, NOBLOCK))[1]))
    return got


def test_a_learner_key_is_admitted_and_others_are_not(served) -> None:
    ctx, svc, server, keys_dir = served
    learner = client(ctx, svc, keys_dir, "learner")
    learner.refresh(0.05)  # no answer (nobody serves the socket here); the request must arrive
    got = requests(server, WAIT_MS)
    assert got and all(isinstance(m, P.ReplaySample) and m.peer_id == "learner-0" for m in got)
    actor = client(ctx, svc, keys_dir, "actor")  # a key of the bus, but not a learner's
    for _ in range(6):  # past its send queue: it says the replay takes no requests
        actor.refresh(0.05)
    assert requests(server, 500) == []
    assert actor.counters["unreachable"] >= 1
    learner.close()
    actor.close()


def test_a_learner_key_removed_from_the_folder_is_refused_from_the_next_handshake(served) -> None:
    ctx, svc, server, keys_dir = served
    folder(keys_dir, "learner").joinpath("learner.key").unlink()
    svc._reload_learner_keys()
    learner = client(ctx, svc, keys_dir, "learner")
    learner.refresh(0.05)
    assert requests(server, 1000) == []
    learner.close()
