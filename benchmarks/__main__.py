"""``python -m benchmarks NAME ...`` from a checkout: fleet, handshakes, memory_bounds, relay, replay, scale,
train (a table, or JSON: --json)."""

from __future__ import annotations

import click

from benchmarks.fleet import fleet
from benchmarks.handshakes import handshakes
from benchmarks.memory_bounds import memory_bounds
from benchmarks.relay import relay
from benchmarks.replay import replay
from benchmarks.scale import scale
from benchmarks.train import train
from zddrl.logs import configure


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", default="INFO", show_default=True, help="DEBUG, INFO, WARNING or ERROR.")
@click.pass_context
def main(ctx: click.Context, log_level: str) -> None:
    """zddrl's studies (docs/benchmarks.md): fleet, handshakes, memory_bounds, relay, replay, scale, train (a
    table, or JSON: --json). What sizes a deployment on one's own hardware is `zddrl bench`."""
    configure(log_level, role="bench")


main.add_command(fleet)
main.add_command(handshakes)
main.add_command(memory_bounds)
main.add_command(relay)
main.add_command(replay)
main.add_command(scale)
main.add_command(train)

if __name__ == "__main__":
    main()
