"""Algorithm specs: every figure a built-in core reports is declared, the registry refuses what is not a spec, and no
code outside the specs branches on an algorithm's name."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from test_apex_sac import BOX, DISCRETE, rollout

from samples import rollout_of
from zddrl.algos.core import CORE_FIGURES
from zddrl.algos.spec import AlgorithmSpec, algorithm, declared, declared_arrays
from zddrl.config import SHARED_ALGO_KEYS, Config, ConfigError
from zddrl.envs import EnvSpec
from zddrl.plugin import BUILTIN_ALGORITHMS
from zddrl.shards.group import ShardGroup

PACKAGE = Path(__file__).resolve().parents[2] / "zddrl"
CARTPOLE = EnvSpec((4,), True, 2)
ENVS = {"ppo": CARTPOLE, "impala": CARTPOLE, "apex": DISCRETE, "sac": BOX}


def _batch(name: str) -> list:
    """A batch the algorithm's core trains on: two trajectories of 8 steps x 2 envs."""
    if name in ("apex", "sac"):
        return [rollout(ENVS[name], seed=s) for s in (1, 2)]
    return [rollout_of("a", s, 0, 8, 2, trunc_at=(1, 0), ep_returns=(1.0,)) for s in (1, 2)]


@pytest.mark.parametrize("name", sorted(BUILTIN_ALGORITHMS))
def test_every_figure_a_builtin_core_reports_is_declared(name: str) -> None:
    spec = algorithm(name)
    config = Config().replace(
        {
            "algo.name": name,
            "model.hidden": [8],
            "replay.capacity": 256,
            "replay.batch_size": 4,
            "replay.learning_starts": 0,
            "replay.replay_ratio": 0.5,
        }
    )
    core = spec.learner(config, ENVS[name], ShardGroup())
    figures = core.update(_batch(name))
    undeclared = set(figures) - set(declared(spec, CORE_FIGURES))
    assert not undeclared, f"{name} reports figures its spec does not declare: {sorted(undeclared)}"


@pytest.mark.parametrize("name", sorted(BUILTIN_ALGORITHMS))
def test_builtin_specs_are_whole(name: str) -> None:
    spec = algorithm(name)
    assert isinstance(spec, AlgorithmSpec) and spec.name == name
    assert spec.schedules and set(spec.schedules) <= {"sync", "async"}
    assert not {f.name for f in dataclasses.fields(spec.settings)} & SHARED_ALGO_KEYS
    assert spec.settings() == Config().replace({"algo.name": name}).algo.settings  # defaults from one place


def test_a_name_that_is_not_a_spec_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="does not name an AlgorithmSpec"):
        Config().replace({"algo.name": "zddrl.config:Config"})
    with pytest.raises(ConfigError, match="must be one of"):
        Config().replace({"algo.name": "a2c"})


def test_nothing_outside_the_specs_branches_on_an_algorithm_name() -> None:
    """``algo.name`` is compared with nothing in zddrl/ (the spec answers instead); the built-in names appear as
    strings only in the specs, the registry and the benchmarks' run labels."""
    names = set(BUILTIN_ALGORITHMS)
    allowed = {PACKAGE / "plugin.py", PACKAGE / "config.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in allowed or "bench" in path.parts or path.parent.name in names:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                consts = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                if names & set(consts):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "mode" and isinstance(node.value, ast.Attribute):
                if node.value.attr == "algo":
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} (algo.mode)")
    assert not found, "branches on an algorithm's name outside its spec:\n" + "\n".join(found)


def test_a_builtins_declared_arrays_are_named_only_in_its_own_package() -> None:
    """An array an algorithm declares (``AlgorithmSpec.arrays``: Ape-X's ``q_taken`` and ``actor_td``) is the
    algorithm's business: no other file under zddrl/ names it. The protocol's generic part knows declared arrays
    only as a declaration (docs/protocol.md section 7.1), never by name."""
    found = []
    for name in sorted(BUILTIN_ALGORITHMS):
        for array in declared_arrays(algorithm(name), Config().replace({"algo.name": name}), ENVS[name]):
            word = re.compile(rf"\b{re.escape(array.name)}\b")
            for path in sorted(PACKAGE.rglob("*.py")):
                if path.parent.name == name:
                    continue
                found += [
                    f"{path.relative_to(PACKAGE.parent)} names {name}'s {array.name!r}"
                    for _ in word.finditer(path.read_text())
                ][:1]
    assert algorithm("apex").arrays, "Ape-X declares its arrays: the test must have something to look for"
    assert not found, "\n".join(found)


@pytest.mark.parametrize("name", sorted(BUILTIN_ALGORITHMS))
def test_a_builtins_declaration_is_one_the_brokers_accept(name: str) -> None:
    from zddrl import protocol as P
    from zddrl.algos.spec import sent_arrays

    config = Config().replace({"algo.name": name})
    declared = [a.to_wire() for a in sent_arrays(algorithm(name), config, ENVS[name])]
    bus = {"sync": True, "max_staleness": 0, "max_in_flight": 2, "arrays": declared}
    assert P.bus_refusal(bus) == ""
