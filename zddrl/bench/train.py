"""`zddrl bench train` (placeholder until written)."""
from __future__ import annotations

import click


@click.command("train")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def train(as_json: bool) -> None:
    """Not written yet."""
    raise click.ClickException("not written yet")
