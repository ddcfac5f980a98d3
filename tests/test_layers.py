"""The package layout's one rule: imports run one way (docs/architecture.md). A package imports only the
layers below it; nothing in the learning maths imports sockets or wire messages."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zddrl"
LAYERS = [
    {"protocol"},
    {"tomlconf"},
    {"plugin"},
    {"brokerconf", "algoconf"},
    {"config", "keys", "logs", "proc", "values"},
    {"envs", "intake"},
    {"shards"},
    {"algos", "transport"},
    {"replay"},
    {"broker", "actor", "learner"},
    {"ops"},
    {"cli"},
    {"bench", "__main__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def imports(path: Path) -> set[str]:
    """The zddrl top-level packages and modules ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "zddrl":
            parts = node.module.split(".")
            found.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("zddrl."))
    return found - {"STARTED_AT", "__version__"}


def owner(path: Path) -> str:
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def test_every_module_has_a_layer() -> None:
    missing = {owner(p) for p in PACKAGE.rglob("*.py")} - set(RANK) - {"__init__"}
    assert not missing, f"add {sorted(missing)} to LAYERS and docs/architecture.md"


def test_imports_run_one_way() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = owner(path)
        if src == "__init__":  # zddrl/__init__.py re-exports the public API (gae, vtrace) lazily
            continue
        for dst in imports(path):
            if dst != src and RANK[dst] >= RANK[src]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)} imports zddrl.{dst}")
    assert not wrong, "imports that go up or sideways:\n" + "\n".join(wrong)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, by its full dotted name."""
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_the_maths_and_the_wire_never_touch_sockets() -> None:
    for path in list((PACKAGE / "algos").rglob("*.py")) + list((PACKAGE / "protocol").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if owner(path) == "algos":  # its subpackages too (apex/, sac/, replay_buffer/)
            assert "zmq" not in names and not any(
                m.startswith(("zmq", "zddrl.protocol", "zddrl.transport")) for m in modules
            ), path
        else:  # the protocol reads zmq.Frame objects but never a socket
            assert "zmq" not in names, path


def test_the_bus_is_blind_to_training() -> None:
    """The broker and relays route runs they do not understand: what they need of one is the run announcement's
    ``bus`` field (docs/protocol.md), never the training config, the algorithms, the envs or user code."""
    wrong = [
        f"{path.relative_to(PACKAGE.parent)} imports zddrl.{dst}"
        for path in (PACKAGE / "broker").rglob("*.py")
        for dst in imports(path) & {"config", "algoconf", "algos", "plugin", "envs"}
    ]
    assert not wrong, wrong


def test_the_replay_buffer_is_numpy_only() -> None:
    """The buffer's data structures serve the cores, the actors (TD errors, without torch) and the replay service:
    numpy and the standard library, and nothing of zddrl outside their own package."""
    for path in (PACKAGE / "algos" / "replay_buffer").rglob("*.py"):
        for module in imported_modules(path):
            top = module.split(".")[0]
            inside = module.startswith("zddrl.algos.replay_buffer")
            assert inside or top == "numpy" or top in sys.stdlib_module_names, f"{path} imports {module}"
