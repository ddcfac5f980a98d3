"""Which benchmarks ship: `zddrl bench` sizes a deployment on one's own hardware; zddrl's own studies run from a
checkout (`python -m benchmarks`, outside the installed package, which never imports them)."""

from __future__ import annotations

import ast
from pathlib import Path

from click.testing import CliRunner

from benchmarks.__main__ import main as benchmarks_main
from zddrl.cli import main as zddrl_main

ROOT = Path(__file__).resolve().parents[2]


def commands(output: str) -> set[str]:
    listed = output.split("Commands:")[1].splitlines()
    return {line.split()[0] for line in listed if line.strip()}


def test_the_product_keeps_what_sizes_a_deployment() -> None:
    shipped = CliRunner().invoke(zddrl_main, ["bench", "--help"])
    assert shipped.exit_code == 0 and commands(shipped.output) == {"actor", "bus", "codec", "learner", "sample"}
    studies = CliRunner().invoke(benchmarks_main, ["--help"])
    assert studies.exit_code == 0 and commands(studies.output) == {
        "fleet",
        "handshakes",
        "memory_bounds",
        "relay",
        "replay",
        "scale",
        "train",
    }


def test_the_package_never_imports_the_benchmarks() -> None:
    wrong = []
    for path in sorted((ROOT / "zddrl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            wrong += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not wrong, wrong
