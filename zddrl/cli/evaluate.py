"""`zddrl eval`: deterministic episodes of a checkpoint's policy (zddrl.ops.evaluate)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from zddrl.cli.common import allow_code_option, allowed_code


@click.command("eval")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--episodes", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--seed", type=int, default=10_000, show_default=True)
@click.option(
    "--max-episode-steps",
    type=click.IntRange(min=0),
    default=0,
    help="Cut an episode after this many agent steps (counted as truncated); 0: the env's own limit.",
)
@click.option(
    "--video",
    "video_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write each episode as DIR/episode-NNN.mp4 (H.264; needs the video extra: "
    'pip install -c constraints.txt -e ".[video]").',
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the per-episode lines go to stderr).")
@allow_code_option("when reading the checkpoint's run (a checkpoint may come from anywhere)")
def eval_cmd(checkpoint, episodes, seed, max_episode_steps, video_dir, as_json, allow_code) -> None:
    """Deterministic evaluation of CHECKPOINT (a checkpoint file, or a run directory: its final, else newest,
    checkpoint): a line per episode, then the mean/std return."""
    from zddrl.learner.runlog import CheckpointError
    from zddrl.ops.evaluate import Episode, evaluate

    def progress(k: int, ep: Episode) -> None:
        cut = " (cut by the step limit)" if ep.truncated else ""
        film = f", video {ep.video}" if ep.video else ""
        click.echo(
            f"episode {k + 1}/{episodes}: return {ep.ret:g} in {ep.steps:,} steps{cut}, {duration(ep.seconds)}{film}",
            err=as_json,
        )

    try:
        result = evaluate(checkpoint, episodes, seed, max_episode_steps, video_dir, progress, allowed_code(allow_code))
    except CheckpointError as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:  # an env that cannot be built here, no encoder, a checkpoint of another network
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise click.ClickException(f"cannot evaluate {checkpoint}: {type(exc).__name__}: {first_line}") from None
    click.echo(
        json.dumps(result)
        if as_json
        else f"{result['episodes']} episodes of {result['env_id']}: return {result['mean']:.2f} +- {result['std']:.2f}"
    )


def duration(seconds: float) -> str:
    """A CartPole episode lasts milliseconds, an Atari game minutes: each in a unit that shows it."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"
