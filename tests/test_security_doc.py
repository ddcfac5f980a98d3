"""docs/security.md against the test suite: every test it cites exists, and every row of its threat-model table and
of its "Bounded resources" table cites at least one test, so that no claim there stands on prose alone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "security.md"
TESTS = ROOT / "tests"

NAME = re.compile(r"`(test_\w+)`")
PATH = re.compile(r"\b(tests/[\w/]+\.py)(?:::(test_\w+))?")


def functions_by_file() -> dict[str, set[str]]:
    """Every ``test_*`` function (top level or in a class) of every test module, by its path from the repository."""
    found: dict[str, set[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        if ".mypy_cache" in path.parts:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        names = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
        }
        found[path.relative_to(ROOT).as_posix()] = names
    return found


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section, up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match is not None, f"docs/security.md has no section {title!r}"
    return match.group(1)


def table_rows(body: str) -> list[str]:
    """The rows of the first markdown table in ``body``, header and rule excluded."""
    lines = body.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def cites_a_test(row: str) -> bool:
    return bool(NAME.search(row) or PATH.search(row))


def test_every_test_the_doc_cites_exists() -> None:
    text = DOC.read_text()
    functions = functions_by_file()
    every_name = set().union(*functions.values())
    names = set(NAME.findall(text))
    assert names, "docs/security.md cites no test by name"
    assert sorted(names - every_name) == [], "docs/security.md cites tests that do not exist"
    missing_paths = sorted({p for p, _ in PATH.findall(text) if p not in functions})
    assert missing_paths == [], "docs/security.md cites test files that do not exist"
    misplaced = sorted(f"{p}::{n}" for p, n in PATH.findall(text) if n and n not in functions.get(p, set()))
    assert misplaced == [], "docs/security.md cites a test in a file that does not hold it"


@pytest.mark.parametrize("title", ["Threat model", "Bounded resources"])
def test_every_row_of_the_security_tables_cites_a_test(title: str) -> None:
    rows = table_rows(section(DOC.read_text(), title))
    assert len(rows) >= 8, f"the {title!r} table has shrunk to {len(rows)} rows: is the parser still right?"
    bare = [row.split("|")[1].strip() for row in rows if not cites_a_test(row)]
    assert bare == [], f"rows of {title!r} that cite no test"


def test_the_checks_would_catch_a_missing_test_and_an_uncited_row() -> None:
    functions = functions_by_file()
    assert "test_every_test_the_doc_cites_exists" in functions["tests/test_security_doc.py"]
    assert not cites_a_test("| members | 10,000 actors |")
    assert cites_a_test("| members | `test_caps_per_role_and_per_host` |")
    assert cites_a_test("| x | tests/broker/test_peer_ids.py |")
    rows = table_rows("text\n\n| a | b |\n|---|---|\n| one | two |\n| three | four |\n\nafter\n| not | this |\n")
    assert rows == ["| one | two |", "| three | four |"]
