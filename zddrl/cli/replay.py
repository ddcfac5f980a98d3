"""`zddrl replay`: a replay service on the bus (zddrl/replay/service.py; docs/protocol.md section 5.9)."""

from __future__ import annotations

from pathlib import Path

import click

from zddrl.cli.common import (
    allow_code_option,
    allowed_code,
    connect_list,
    credentials_of,
    key_option,
    keys_option,
    stop_on_signals,
)
from zddrl.transport.link import Refused

CONNECT_HELP = "The broker's control endpoint(s), tcp://HOST:PORT[,tcp://HOST2:PORT] (fallbacks)."


@click.command()
@click.option("--connect", required=True, envvar="ZDDRL_CONNECT", callback=connect_list, help=CONNECT_HELP)
@click.option(
    "--bind",
    default="tcp://127.0.0.1:0",
    show_default=True,
    envvar="ZDDRL_REPLAY_BIND",
    help="Where learners reach this replay (port 0: a free one, written to --ready-file).",
)
@click.option("--replay-id", default="replay-0", show_default=True, help="This replay's peer id on the bus.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    default=None,
    envvar="ZDDRL_REPLAY_STATE",
    help="Save the buffer here every --save-every-s and at a clean stop; load it at start (same layout only).",
)
@click.option("--save-every-s", type=click.FloatRange(min=1.0), default=60.0, show_default=True)
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None, help="Write the bound port here.")
@allow_code_option("here (the replay builds the run's env once to learn its spaces)")
@keys_option
@key_option
def replay(connect, bind, replay_id, state_dir, save_every_s, ready_file, allow_code, keys_dir, key_name) -> None:
    """Run a replay service: take a replay run's trajectories from the broker, serve sampled batches to learners.

    For runs with replay.placement = "service" (algorithms apex, sac); learners reach it with --replay tcp://HOST:PORT.
    It keeps its buffer across learner restarts while the run's buffer layout stays the same."""
    import threading

    from zddrl.keys import folder
    from zddrl.replay.service import ReplayService

    creds = credentials_of(keys_dir, "replay", key_name)
    allowed = allowed_code(allow_code)
    service = ReplayService(
        connect,
        bind,
        replay_id,
        credentials=creds,
        learner_keys=folder(keys_dir, "learner") if keys_dir else None,
        allowed_code=allowed,
        state_dir=Path(state_dir) if state_dir else None,
        save_every_s=save_every_s,
    )
    stop = stop_on_signals()
    if ready_file:  # the port is known once bound: write it from a watcher so `zddrl train` can pass it on

        def announce() -> None:
            if service.bound.wait(60):
                Path(ready_file).write_text(str(service.port))

        threading.Thread(target=announce, daemon=True).start()
    try:
        service.run(stop)
    except (Refused, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
