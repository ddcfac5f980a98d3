"""`zddrl bench ...`: the benchmarks behind the figures in docs/benchmarks.md."""

from __future__ import annotations

import click

from zddrl.bench.actor import actor
from zddrl.bench.bus import bus
from zddrl.bench.codec import codec
from zddrl.bench.fleet import fleet
from zddrl.bench.learner import learner
from zddrl.bench.relay import relay
from zddrl.bench.replay import replay
from zddrl.bench.sample import sample
from zddrl.bench.scale import scale
from zddrl.bench.train import train


@click.group()
def bench() -> None:
    """Benchmarks: actor, bus, codec, fleet, learner, relay, replay, sample, scale, train (a table, or JSON: --json)."""


bench.add_command(actor)
bench.add_command(bus)
bench.add_command(codec)
bench.add_command(fleet)
bench.add_command(learner)
bench.add_command(relay)
bench.add_command(replay)
bench.add_command(sample)
bench.add_command(scale)
bench.add_command(train)
