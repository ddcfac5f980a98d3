"""`zddrl bench ...`: the benchmarks behind the figures in docs/benchmarks.md."""
from __future__ import annotations

import click

from .bus import bus
from .codec import codec
from .learner import learner
from .sample import sample
from .train import train


@click.group()
def bench() -> None:
    """Benchmarks: bus, codec, sample, train, learner. Each prints a table, or JSON with --json."""


bench.add_command(bus)
bench.add_command(codec)
bench.add_command(learner)
bench.add_command(sample)
bench.add_command(train)
