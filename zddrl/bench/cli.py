"""`zddrl bench ...`: what a user runs on their own hardware to size a deployment (docs/benchmarks.md)."""

from __future__ import annotations

import click

from zddrl.bench.actor import actor
from zddrl.bench.bus import bus
from zddrl.bench.codec import codec
from zddrl.bench.learner import learner
from zddrl.bench.sample import sample


@click.group()
def bench() -> None:
    """Sizing a deployment on this hardware: actor, bus, codec, learner, sample (a table, or JSON: --json).
    zddrl's own studies (fleet, relay, replay, scale, train) run from a checkout: python -m benchmarks."""


bench.add_command(actor)
bench.add_command(bus)
bench.add_command(codec)
bench.add_command(learner)
bench.add_command(sample)
