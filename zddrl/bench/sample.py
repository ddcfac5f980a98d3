"""`zddrl bench sample` (placeholder until written)."""
from __future__ import annotations

import click


@click.command("sample")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def sample(as_json: bool) -> None:
    """Not written yet."""
    raise click.ClickException("not written yet")
