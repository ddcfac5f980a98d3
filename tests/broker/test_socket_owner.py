"""The broker's sockets have one owner (``sockets.BrokerSockets``) that every part holds: no part of the broker keeps
a socket of its own or a reference to the Broker, and no code reassigns a socket inside another object. A memory
reset then swaps the sockets in one place (memory.py), and every part uses the new ones."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from broker_clients import in_process_broker
from zddrl.broker.broker import Broker
from zddrl.broker.sockets import BrokerSockets

BROKER_PACKAGE = Path(__file__).resolve().parents[2] / "zddrl" / "broker"
SOCKET_ATTRIBUTES = {"control", "trajectories", "learners", "params", "sock", "pub", "sockets", "handshakes"}
"""Names under which the broker's parts held sockets (or their owner) before it had one."""


def _parsed() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(BROKER_PACKAGE.glob("*.py")):
        yield path.name, ast.parse(path.read_text())


def test_no_part_of_the_broker_imports_the_broker() -> None:
    """Only the package (its export) names the Broker: no part takes it whole."""
    importers = set()
    for name, tree in _parsed():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "zddrl.broker.broker":
                importers.add(name)
    assert importers <= {"__init__.py"}, importers


def test_no_code_assigns_a_socket_into_another_object() -> None:
    """``x.control = ...`` anywhere but on ``self`` is a part reaching into another's insides."""
    found = []
    for name, tree in _parsed():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and t.attr in SOCKET_ATTRIBUTES:
                        if not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                            found.append(f"{name}:{t.lineno} {ast.unparse(t)}")
    assert not found, found


def _held(root: object, skip: object) -> Iterator[tuple[str, object]]:
    """(path, value) of everything reachable from ``root`` through zddrl objects' attributes and containers, not
    through ``skip`` nor through callables handed over as hooks (a Broker method a part calls)."""
    seen = {id(skip)}
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield path, obj
        if isinstance(obj, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(obj))
        elif type(obj).__module__.startswith("zddrl") and hasattr(obj, "__dict__"):
            stack.extend((f"{path}.{k}", v) for k, v in vars(obj).items())


@pytest.fixture
def broker() -> Iterator[Broker]:
    with in_process_broker() as b:
        yield b


def _parts(b: Broker) -> list[tuple[str, object]]:
    return [(name, part) for name, part in vars(b).items() if type(part).__module__.startswith("zddrl")]


def _check(b: Broker) -> None:
    owner = b.sockets
    sockets = {id(s) for s in (owner.control, owner.trajectories, owner.learners, owner.params)}
    for name, part in _parts(b):
        if part is owner:
            continue
        for path, value in _held(part, owner):
            assert value is not b, f"{name}{path} is the Broker"
            assert not isinstance(value, zmq.Socket) or id(value) not in sockets, f"{name}{path} holds a socket"


def test_the_parts_hold_the_owner_not_the_sockets_nor_the_broker(broker: Broker) -> None:
    assert isinstance(broker.sockets, BrokerSockets)
    holders = [name for name, part in _parts(broker) for _, v in _held(part, broker) if v is broker.sockets]
    assert {"router", "shards", "replies", "resets"} <= set(holders), holders
    _check(broker)


def test_a_reset_swaps_the_sockets_in_the_owner_and_every_part_uses_the_new_ones(broker: Broker) -> None:
    owner = broker.sockets
    old = (owner.control, owner.trajectories, owner.learners, owner.params)
    broker.resets.reset(0.0)
    new = (owner.control, owner.trajectories, owner.learners, owner.params)
    assert all(a is not b for a, b in zip(old, new)) and all(s.closed for s in old)
    assert broker.sockets is owner, "the parts hold the same owner"
    _check(broker)
    polled = {s for s, _ in broker.poller.sockets}
    assert owner.control in polled and owner.learners in polled and not set(old) & polled
