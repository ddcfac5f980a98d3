"""`zddrl bench ...`: the benchmarks behind the figures in docs/benchmarks.md."""
from __future__ import annotations

import click


@click.group()
def bench() -> None:
    """Benchmarks: bus, sample, train. Each prints a table, or JSON with --json."""
