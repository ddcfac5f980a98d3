"""An actor host whose re-hello is refused (another live process took its peer id while the broker was down)
stops with the broker's reason instead of spinning: its link has stopped, so waiting for parameters returned
at once, forever, at 100 % CPU."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from broker_clients import WAIT_S, Shard, run_spec, status
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl import protocol as P
from zddrl.algos.model import ActorCritic, flatten_params
from zddrl.config import Config
from zddrl.envs import probe_spec
from zddrl.transport.link import hello_fields
from zddrl.transport.params import split


def test_an_actor_refused_mid_run_exits_with_the_reason(procs: Procs, broker: BrokerHandle, bus: Bus) -> None:
    Shard(bus, broker, "learner-0", "run-r", run_spec())  # a run with no parameters yet: the actor waits for them
    actor = procs.start("actor", "actor", "--connect", broker.connect, "--actor-id", "0")
    wait_for(lambda: "actor-0" in status(broker, bus)["members"], WAIT_S, "the actor to join")

    os.kill(actor.pid, signal.SIGSTOP)  # the squatter must say hello to the new broker first: hold the actor
    try:
        broker.proc.kill()
        broker.proc.wait(timeout=WAIT_S)
        broker.start()  # same ports
        squatter = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-0", **hello_fields()))
        assert squatter.wait_welcome(WAIT_S) is not None, "the squatter holds actor-0 at the new broker"
    finally:
        os.kill(actor.pid, signal.SIGCONT)  # its link reconnects and says hello again: refused

    wait_for(lambda: actor.poll() is not None, 30, "the refused actor to stop")
    log = procs.log("actor")
    assert actor.returncode == 1 and "is in use by pid" in log, log[-2000:]


BOGUS_LAYOUT = {"flat": np.arange(16, dtype=np.float32), "layout": [["w", "float32", [16], 0]], "meta": {}}
HUGE_ROLLOUTS = {"meta": {"rollout_len": 2**40}}


@pytest.mark.parametrize(
    "bad, why",
    [(BOGUS_LAYOUT, "its layout does not build this run's network"), (HUGE_ROLLOUTS, "meta.rollout_len 1099511627776")],
    ids=["bogus-layout", "huge-rollouts"],
)
def test_an_actor_refuses_parameters_it_cannot_act_with(
    procs: Procs, broker: BrokerHandle, bus: Bus, bad: dict, why: str
) -> None:
    """A learner (here a test-side shard) publishes a version the actor cannot act with: the actor refuses it,
    says why, counts it and lives on; the next, good version is used."""
    config = Config()
    shard = Shard(bus, broker, "learner-0", "run-p", config.to_dict())
    shard.grant(4)
    actor = procs.start("actor", "actor", "--connect", broker.connect, "--actor-id", "0")
    flat, layout = flatten_params(ActorCritic(probe_spec(config.env.id), config.model))

    def publish(version: int, flat: np.ndarray = flat, layout: list = layout, meta: dict | None = None) -> None:
        messages = split(
            run_id="run-p",
            peer_id="learner-0",
            version=version,
            flat=flat,
            layout=layout,
            extras={},
            meta={"rollout_len": 8} if meta is None else meta,
            chunk_bytes=1 << 20,
            dtype="float32",
        )
        for msg in messages:
            shard.sock.send_multipart(P.encode(msg))

    wait_for(lambda: "actor-0" in status(broker, bus)["members"], WAIT_S, "the actor to join")
    publish(0, **bad)
    wait_for(lambda: f"refused version 0: {why}" in procs.log("actor"), WAIT_S, "the actor to refuse version 0")
    publish(1)
    got, deadline = None, time.monotonic() + WAIT_S
    while not isinstance(got, P.Trajectory) and time.monotonic() < deadline:
        got = shard.recv(100)
    assert isinstance(got, P.Trajectory), "no trajectory with the good version"
    assert got.policy_version == 1 and got.env_steps == 8 * config.env.num_envs
    assert actor.poll() is None, procs.log("actor")[-2000:]
    stats = lambda: status(broker, bus)["members"]["actor-0"]["stats"]  # noqa: E731
    wait_for(lambda: stats().get("refused_versions") == 1, WAIT_S, "the actor to count the refused version")
