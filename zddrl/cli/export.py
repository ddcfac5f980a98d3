"""`zddrl export`: a checkpoint's policy as a TorchScript or ONNX file that runs without zddrl (zddrl.ops.export)."""

from __future__ import annotations

from pathlib import Path

import click

from zddrl.cli.common import allow_code_option, allowed_code

FORMATS = ("torchscript", "onnx")
"""``zddrl.ops.export.FORMATS``, repeated so that ``--help`` does not import torch."""


@click.command("export")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    required=True,
    help="torchscript (needs torch alone to run) or onnx (onnxruntime; extra: onnx).",
)
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="File to write (its folder is made if missing; an existing file is replaced).",
)
@allow_code_option("when reading the checkpoint's run (a checkpoint may come from anywhere)")
def export(checkpoint: str, fmt: str, output: Path, allow_code: tuple[str, ...]) -> None:
    """Write CHECKPOINT's acting policy (RUN_DIR/checkpoints/*.pt, or RUN_DIR: its final, else newest) as one
    file: obs [B, *obs_shape] -> (deterministic action, distribution parameters), observation normalisation included
    (docs/export.md)."""
    from zddrl.learner.runlog import CheckpointError
    from zddrl.ops.export import ExportError, export_policy

    try:
        result = export_policy(checkpoint, fmt, output, allowed_code(allow_code))
    except (CheckpointError, ExportError) as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:  # an env that cannot be built here, a checkpoint of another network, a torch refusal
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise click.ClickException(f"cannot export {checkpoint}: {type(exc).__name__}: {first_line}") from None
    action = result["action_space"]
    space = f"{action['n']} actions" if action["kind"] == "discrete" else f"{action['shape'][0]}-d Box actions"
    click.echo(
        f"{output}: {fmt}, {result['network']} of {result['env_id']} ({result['obs_dtype']} "
        f"{tuple(result['obs_shape'])} -> {space}), largest difference to the checkpoint {result['max_error']:.2g}"
    )
