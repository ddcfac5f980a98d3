"""Broker profiles in brokers/: they load, the CLI flags override them, and bad ones are clear errors."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from conftest import Procs, wait_for
from zddrl import protocol as P
from zddrl.config import BrokerConfig, ConfigError, load_broker_config
from zddrl.proc import free_ports

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "brokers" / "local.toml"
CLUSTER = ROOT / "brokers" / "cluster.toml"
FIELDS = {f.name for f in dataclasses.fields(BrokerConfig)}


def test_local_profile_is_the_builtin_defaults_on_the_local_bus() -> None:
    config = load_broker_config(LOCAL)
    assert config == BrokerConfig()
    assert config.bind == "", "empty: `zddrl broker` makes the local bus in a fresh owner-only directory"


def test_cluster_profile_listens_on_all_interfaces_with_larger_limits() -> None:
    config = load_broker_config(CLUSTER)
    local = BrokerConfig()
    assert config.bind == "tcp://0.0.0.0:5555"
    assert config.max_message_bytes > local.max_message_bytes
    expiry = config.heartbeat_interval_s * config.heartbeat_liveness
    assert expiry > local.heartbeat_interval_s * local.heartbeat_liveness, "more tolerance on a network"
    assert config.trajectory_hwm >= 1 and config.params_hwm >= 1
    assert len({config.trajectory_port, config.learner_port, config.params_port, 5555}) == 4


@pytest.mark.parametrize("profile", [LOCAL, CLUSTER], ids=["local", "cluster"])
def test_profiles_spell_out_and_comment_every_setting(profile: Path) -> None:
    doc = tomllib.loads(profile.read_text())
    assert set(doc) == {"broker"}, "a profile is a single [broker] table"
    assert set(doc["broker"]) == FIELDS, "every BrokerConfig setting is written out"
    lines = profile.read_text().splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.lstrip().startswith("#"):
            assert lines[i - 1].lstrip().startswith("#"), f"{profile.name}: {line.split('=')[0].strip()} has no comment"


@pytest.mark.slow
@pytest.mark.parametrize("profile", [LOCAL, CLUSTER], ids=["local", "cluster"])
def test_cli_flags_override_the_profile(profile: Path, procs: Procs, tmp_path: Path) -> None:
    c, t, lp, p = free_ports(4)
    ready = tmp_path / "ready.json"
    proc = procs.start(
        "broker",
        "broker",
        "--profile",
        str(profile),
        "--bind",
        f"tcp://127.0.0.1:{c}",
        "--insecure",
        "--trajectory-port",
        str(t),
        "--learner-port",
        str(lp),
        "--params-port",
        str(p),
        "--ready-file",
        str(ready),
    )
    wait_for(lambda: ready.exists() or proc.poll() is not None, 20, "the broker to bind")
    assert proc.poll() is None, procs.log("broker")
    assert json.loads(ready.read_text()) == {"control": c, "trajectories": t, "learners": lp, "params": p}

    # The settings the flags did not name come from the profile: the welcome carries them.
    expected = load_broker_config(profile)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{c}")
        sock.send_multipart(P.encode(P.Hello(role="monitor", peer_id="probe")))
        assert sock.poll(10_000), "no welcome"
        welcome = P.decode(sock.recv_multipart())
    finally:
        ctx.destroy(linger=0)
    assert isinstance(welcome, P.Welcome)
    assert welcome.ports == {"trajectories": t, "learners": lp, "params": p}
    assert welcome.heartbeat_interval_s == expected.heartbeat_interval_s
    assert welcome.heartbeat_liveness == expected.heartbeat_liveness
    assert welcome.max_message_bytes == expected.max_message_bytes
    assert procs.stop(proc) == 0, "SIGTERM is a clean shutdown"


@pytest.mark.slow
def test_a_random_port_bind_overrides_the_profiles_fixed_one(procs: Procs, tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = procs.start(
        "broker",
        "broker",
        "--profile",
        str(LOCAL),
        "--bind",
        "tcp://127.0.0.1:*",
        "--insecure",
        "--ready-file",
        str(ready),
    )
    wait_for(lambda: ready.exists() or proc.poll() is not None, 20, "the broker to bind")
    assert proc.poll() is None, procs.log("broker")
    ports = json.loads(ready.read_text())
    assert set(ports) == {"control", "trajectories", "learners", "params"} and 5555 not in ports.values()


BAD_PROFILES = {
    "unknown-key": ('[broker]\nbind = "tcp://127.0.0.1:5555"\nbogus_hwm = 3\n', "broker.bogus_hwm"),
    "bad-bind": ('[broker]\nbind = "127.0.0.1:5555"\n', "broker.bind"),
    "bad-scheme": ('[broker]\nbind = "udp://127.0.0.1:5555"\n', "broker.bind"),
    "bad-type": ('[broker]\ntrajectory_hwm = "many"\n', "broker.trajectory_hwm"),
    "bad-value": ("[broker]\nheartbeat_liveness = 0\n", "heartbeat_liveness"),
    "bad-port": ("[broker]\nparams_port = 70000\n", "broker.params_port"),
    "other-table": ("[broker]\n[actor]\nenvs = 4\n", "one [broker] table"),
    "not-toml": ("[broker\nbind = ", "not valid TOML"),
}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zddrl", *args],
        capture_output=True,
        text=True,
        timeout=20,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_PROFILES))
def test_a_bad_profile_is_a_clear_cli_error(case: str, tmp_path: Path) -> None:
    text, names = BAD_PROFILES[case]
    profile = tmp_path / f"{case}.toml"
    profile.write_text(text)
    with pytest.raises(ConfigError, match=names.replace("[", r"\[").replace("]", r"\]")):
        load_broker_config(profile)
    # --bind would override the profile's bind; elsewhere it keeps a broken test off port 5555.
    bind = [] if "bind" in names else ["--bind", "tcp://127.0.0.1:*", "--insecure"]
    out = run_cli("broker", "--profile", str(profile), *bind)
    assert out.returncode == 2, out.stderr
    assert names in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_missing_profile_is_a_clear_cli_error(tmp_path: Path) -> None:
    out = run_cli("broker", "--profile", str(tmp_path / "nope.toml"))
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_non_numeric_bind_port_names_the_setting(tmp_path: Path) -> None:
    profile = tmp_path / "port.toml"
    profile.write_text('[broker]\nbind = "tcp://127.0.0.1:fivefive"\ninsecure = true\n')
    out = run_cli("broker", "--profile", str(profile))
    assert out.returncode != 0
    assert "broker.bind port must be 1..65535 or *" in out.stderr
