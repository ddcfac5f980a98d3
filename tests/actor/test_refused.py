"""An actor host whose re-hello is refused (another live process took its peer id while the broker was down)
stops with the broker's reason instead of spinning: its link has stopped, so waiting for parameters returned
at once, forever, at 100 % CPU."""

from __future__ import annotations

import os
import signal

from broker_clients import WAIT_S, Shard, run_spec, status
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl import protocol as P
from zddrl.transport.link import hello_fields


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
