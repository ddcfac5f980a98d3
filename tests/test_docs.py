"""The docs stay true: every config key is documented with its default; README commands exist."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from zddrl import config as C
from zddrl.algos.spec import algorithm
from zddrl.learner.runlog import METRIC_COLUMNS, SUMMARY_KEYS
from zddrl.plugin import BUILTIN_ALGORITHMS

ROOT = Path(__file__).resolve().parent.parent


SECTIONS = {
    C.Config: "## top level",
    C.EnvConfig: "## `[env]`",
    C.ModelConfig: "## `[model]`",
    C.AlgoConfig: "## `[algo]`",
    C.BusConfig: "## `[bus]`",
    C.ReplayConfig: "## `[replay]`",
    C.TrainConfig: "## `[train]`",
    C.LearnerConfig: "## `[learner]`",
    C.BrokerConfig: "## Broker profiles: `[broker]`",
    **{algorithm(name).settings: f"### `[algo]` keys of `{name}`" for name in BUILTIN_ALGORITHMS},
}
"""Each class's heading in docs/configuration.md: its keys are documented between it and the next heading."""


def section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1 :]
    end = re.search(r"^#", rest, re.M)
    return rest[: end.start()] if end else rest


@pytest.mark.parametrize("cls", list(SECTIONS), ids=lambda c: c.__name__)
def test_every_config_key_is_documented_with_its_default(cls: type) -> None:
    text = section((ROOT / "docs" / "configuration.md").read_text(), SECTIONS[cls])
    for f in dataclasses.fields(cls):
        if f.name in ("env", "model", "algo", "bus", "replay", "train", "learner", "settings"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, float) and math.isinf(default):
            default = "inf"
        if isinstance(default, tuple):
            default = list(default)
        row = re.search(rf"^\| `{f.name}` \| `([^`]*)` \| (.+) \|$", text, re.M)
        assert row, f"{cls.__name__}.{f.name} is not documented in docs/configuration.md"
        assert row.group(1) == str(default), f"{f.name}: documented default {row.group(1)}, real {default}"


def test_run_directory_names_are_documented() -> None:
    text = (ROOT / "docs" / "run-directory.md").read_text()
    for name in (*METRIC_COLUMNS, *SUMMARY_KEYS):
        assert f"`{name}`" in text, f"{name} is not documented in docs/run-directory.md"


def test_readme_has_the_two_setup_commands_and_ci_runs_the_test_one() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = re.search(r"^(python3 -m venv .venv && .+pytest.*)$", readme, re.M)
    assert test_cmd and test_cmd.group(1) in ci
    main_job = re.search(r"^python3 -m venv .venv && .+zddrl train examples/cartpole_ppo.toml$", readme, re.M)
    assert main_job and "grep -m1 '^python3 -m venv .venv && .*zddrl train examples/cartpole_ppo.toml$' README.md" in ci


def readme_commands() -> list[str]:
    """Every command line in README.md's code blocks, backslash continuations joined."""
    blocks = re.findall(r"^```\w*\n(.*?)^```$", (ROOT / "README.md").read_text(), re.M | re.S)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_readme_commands_to_the_closed_broker_carry_keys() -> None:
    # README's BROKER is the closed one of "Across hosts": a client without keys cannot reach it.
    talking = [line for line in readme_commands() if "--connect tcp://BROKER" in line]
    assert len(talking) >= 6
    for line in talking:
        assert "--keys " in line, f"README command talks to the closed broker without --keys: {line}"


def test_readme_makes_a_key_for_every_role_its_commands_use() -> None:
    commands = readme_commands()
    made = next(line for line in commands if "zddrl keys new" in line)
    roles_made = set(re.findall(r'"(\w+) \w+"', made)) | set(re.findall(r"zddrl keys new (\w+) ", made))
    role_of = {"broker": "broker", "learner": "learner", "actor": "actor", "status": "monitor", "replay": "replay"}
    for line in commands:
        cmd = re.match(r"zddrl (\w+) .*--keys keys/", line)
        if cmd and cmd.group(1) in role_of:
            assert role_of[cmd.group(1)] in roles_made, f"no {role_of[cmd.group(1)]} key is made for: {line}"


def test_readme_and_protocol_md_name_the_protocol_version_the_code_speaks() -> None:
    """README.md, docs/protocol.md (title, preamble, validation list, version history) and the code agree: the
    number is read from the code, so a bump that forgets a document fails here."""
    from zddrl.protocol import PREAMBLE, PROTOCOL_VERSION

    v = PROTOCOL_VERSION
    readme = (ROOT / "README.md").read_text()
    named = re.findall(r"protocol \(version (\d+)\)", readme)
    assert named and set(named) == {str(v)}, f"README.md names protocol version(s) {named}, the code speaks {v}"
    doc = (ROOT / "docs" / "protocol.md").read_text()
    assert doc.startswith(f"# The zddrl wire protocol (version {v})\n")
    assert f'("ZDRL" + protocol version {v})' in doc and f"which is `{v:02x}`" in doc
    assert f"version byte {v}, length 5" in doc
    spaced = " ".join(f"{b:02x}" for b in PREAMBLE)
    assert spaced in doc, f"docs/protocol.md's frame table does not show the preamble {spaced}"
    preambles = set(re.findall(r"5a44524c[0-9a-f]{2}", doc))
    assert preambles == {PREAMBLE.hex()}, f"docs/protocol.md shows {preambles}, the code {PREAMBLE.hex()}"
    history = [int(n) for n in re.findall(r"^Version (\d+) (?:added|changed|gave)", doc, re.M)]
    assert history and max(history) == v, f"docs/protocol.md's version history ends at {max(history, default=0)}"


def test_configuration_md_env_kwargs_example_is_an_env_zddrl_builds() -> None:
    """The `env.kwargs` row's example (an id and its kwargs) builds, with the kwarg taken."""
    import tomllib

    from zddrl.envs import make_factory, probe_spec

    row = section((ROOT / "docs" / "configuration.md").read_text(), SECTIONS[C.EnvConfig])
    found = re.search(r"^\| `kwargs` \|.*with `id = \"([^\"]+)\"`, `(kwargs = \{[^`]*\})`", row, re.M)
    assert found, "the env.kwargs row gives no `id = ...`, `kwargs = {...}` example"
    kwargs = tomllib.loads(found.group(2))["kwargs"]
    config = C.Config.from_dict({"env": {"id": found.group(1), "kwargs": kwargs}})
    probe_spec(config.env)  # spaces zddrl takes (FrozenLake's Discrete observations are refused here)
    env = make_factory(config.env)()
    try:
        for key, value in kwargs.items():
            assert getattr(env.unwrapped, key) == value
    finally:
        env.close()


def test_every_key_is_optional_but_the_config_file_is_an_argument(tmp_path: Path) -> None:
    """docs/configuration.md: an empty file is the whole default config; `zddrl train` and `zddrl learner` still
    take the file's path (CONFIG) as a required argument."""
    from click.testing import CliRunner

    from zddrl.cli import main

    text = (ROOT / "docs" / "configuration.md").read_text()
    assert "an empty file is a whole config" in text and "`CONFIG`" in text
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert C.load_config(empty) == C.Config()
    for command in ("train", "learner"):
        done = CliRunner().invoke(main, [command])
        assert done.exit_code == 2 and "Missing argument 'CONFIG'" in done.output, done.output


def test_extending_md_names_every_trajectory_array_and_how_figures_are_declared() -> None:
    """What an algorithm's ``update`` receives and reports is in docs/extending.md, not only in protocol.md."""
    from zddrl.algos.core import CORE_FIGURES
    from zddrl.algos.spec import FIGURE_GROUPS
    from zddrl.protocol.rules import OPTIONAL_STEP_ARRAYS, TRAJECTORY_ARRAYS, TRUNCATION_ARRAYS

    text = (ROOT / "docs" / "extending.md").read_text()
    for name in (*TRAJECTORY_ARRAYS, *TRUNCATION_ARRAYS, *OPTIONAL_STEP_ARRAYS):
        assert f"`{name}`" in text, f"docs/extending.md does not say what the {name} array of a rollout is"
    for name in (*(f.name for f in CORE_FIGURES), *FIGURE_GROUPS):
        assert f"`{name}`" in text, f"docs/extending.md does not name the figure or figure group {name}"
    assert "rollout.truncations(arrays)`" in text and "rollout.terminal(arrays)`" in text
