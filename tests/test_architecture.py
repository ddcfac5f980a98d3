"""docs/architecture.md cannot drift from the tree: its module index names every module under zddrl/, and every
module path, and every name it cites in a module or as ``module.Name``, exists."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zddrl"
DOC = (ROOT / "docs" / "architecture.md").read_text()
KEY_FOLDERS = {"learners/", "actors/", "monitors/", "relays/", "replays/"}
"""Folders of a key directory (docs/security.md), not of the code."""
CONFIG_SECTIONS = {"env", "model", "algo", "bus", "replay", "train", "learner", "broker", "name"}
"""Dotted words that are config keys (``broker.upstream_window``), not code."""


def modules() -> list[Path]:
    """Every module of the package; an empty ``__init__.py`` is no module to describe."""
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py" or p.read_text().strip()]


@cache
def defined(path: Path) -> frozenset[str]:
    """Names a module defines at any depth: functions, classes, assignments, annotated attributes, imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def resolve(cited: str) -> Path | None:
    """The file a cited module path names, relative to zddrl/ or the repository (``broker/upstream.py``), or a bare
    file name in a row of the package it names (``routing.py``): the one module of that name, if only one."""
    for base in (PACKAGE, ROOT):
        path = base / cited
        if path.exists():
            return path
    name = cited.rstrip("/")
    if "/" not in name:
        found = [p for p in PACKAGE.rglob(name) if p.is_dir() == cited.endswith("/")]
        return found[0] if len(found) == 1 else (PACKAGE if found else None)
    return None


def test_the_index_names_every_module() -> None:
    indexed = set(re.findall(r"^\| `(zddrl/[\w/]+\.py)` \|", DOC, re.M))
    missing = sorted(str(p.relative_to(ROOT)) for p in modules() if str(p.relative_to(ROOT)) not in indexed)
    assert not missing, f"docs/architecture.md's module index lacks {missing} (one row each: what it holds)"
    gone = sorted(p for p in indexed if not (ROOT / p).exists())
    assert not gone, f"docs/architecture.md's module index names modules that do not exist: {gone}"


def test_every_module_path_it_cites_exists() -> None:
    cited = set(re.findall(r"[`*]((?:zddrl/)?[a-z_]+(?:/[a-z_]+)*(?:\.py|/))[`*]", DOC)) - KEY_FOLDERS
    missing = sorted(c for c in cited if resolve(c) is None)
    assert len(cited) > 40 and not missing, missing


def test_every_name_it_cites_in_a_module_exists_there() -> None:
    """``**broker/upstream.py** `Upstream``` and ```algos/flat.py` `unflatten``` name something of that module."""
    pairs = re.findall(r"[`*]{1,2}((?:zddrl/)?[a-z_/]+\.py)[`*]{1,2}\s+`([A-Za-z_]\w*)", DOC)
    wrong = [f"{module} {name}" for module, name in pairs if name not in defined(resolve(module) or PACKAGE)]
    assert len(pairs) > 15 and not wrong, wrong


def test_every_dotted_name_it_cites_exists() -> None:
    """``params.Assembler``, ``algos.spec.AlgorithmSpec``: the last module of the dots (any zddrl module whose dotted
    path ends so) defines the name."""
    wrong, seen = [], 0
    by_suffix = [(".".join(p.relative_to(PACKAGE).with_suffix("").parts), p) for p in modules()]
    for dotted in set(re.findall(r"`((?:[a-z_]+\.)+[A-Za-z_]\w*)(?:\(\))?`", DOC)):
        *parts, name = dotted.split(".")
        if parts[0] in CONFIG_SECTIONS or name == "py":
            continue
        prefix = ".".join(parts).removeprefix("zddrl.")
        candidates = [p for mod, p in by_suffix if mod == prefix or mod.endswith("." + prefix)]
        candidates += [p for mod, p in by_suffix if mod == prefix + ".__init__" or mod.endswith(f".{prefix}.__init__")]
        if not candidates:
            continue  # not a zddrl module: a key, a file name, another library's name
        seen += 1
        if not any(name in defined(p) for p in candidates):
            wrong.append(dotted)
    assert seen > 10 and not wrong, wrong
