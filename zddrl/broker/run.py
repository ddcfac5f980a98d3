"""The run a broker carries now, as far as the bus knows it: its id, its spec (opaque: passed on in welcomes, never
read), its learner's seal, what its hello said the bus must know (``protocol.rules.RunBus``: the staleness bound,
the actors' windows) and its newest published version. One record the joining, routing, publishing and relay sides
share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zddrl.protocol.rules import RunBus


@dataclass
class CurrentRun:
    run_id: str = ""
    """"" before any learner announced a run."""
    spec: dict[str, Any] | None = None
    """The run spec as its learner sent it: every welcome passes it on untouched."""
    seal: tuple[str, bytes] = ("", b"")
    """(signer, signature) of the spec, from its learner's hello: every welcome passes them on."""
    bus: RunBus = field(default_factory=RunBus)
    """What the learner's hello said the bus must know of the run (its ``bus``; the defaults if it said nothing)."""
    policy_version: int = -1
    """The newest version published in the run (the publisher's; read per trajectory, so kept here too)."""
    staleness: int = 0
    """Versions of lag a trajectory may have and still be forwarded (``bus.staleness``, read per trajectory)."""
    credit_batch: int = 1
    """An actor's credit goes back once this many of its trajectories were read: half its window, as a learner shard
    returns half of its own. An actor that may have 2 in flight gets its credit back after every burst; one with 16
    after 8."""

    def start(self, run_id: str, spec: dict[str, Any] | None, seal: tuple[str, bytes], bus: RunBus) -> None:
        """A new run: versions start again."""
        self.run_id, self.spec, self.seal, self.bus = run_id, spec, seal, bus
        self.policy_version = -1
        self.staleness = bus.staleness
        self.credit_batch = max(1, bus.max_in_flight // 2)
