"""Actors never take code from the network (issue 13): a run whose env id names a module (``module:callable``)
is joined only by an actor host that allows that id on its own command line. Anyone who could announce a run
could otherwise make every actor import and call ``os:abort``, or worse.

This module is also the env factory of the test (``tests.actor.test_allow_env:recording_env``): it records
that it was called, so the test can prove a refusing actor never imported or called it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import gymnasium as gym
import pytest

from broker_clients import WAIT_S, Shard, status
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl.config import Config
from zddrl.envs import EnvError, env_factory, env_refusal
from zddrl.protocol import Welcome
from zddrl.transport.trust import joinable

ROOT = Path(__file__).resolve().parents[2]
ENV_ID = "tests.actor.test_allow_env:recording_env"
SENTINEL_ENV = "ZDDRL_TEST_ENV_SENTINEL"


def recording_env() -> gym.Env:
    """CartPole, after writing this process's pid to the file that $ZDDRL_TEST_ENV_SENTINEL names."""
    sentinel = os.environ.get(SENTINEL_ENV)
    if sentinel:
        with open(sentinel, "a") as out:
            out.write(f"{os.getpid()}\n")
    return gym.make("CartPole-v1")


def welcome_of(env_id: str) -> Welcome:
    run = Config().replace({"env.id": env_id}).to_dict()
    return Welcome(
        peer_id="actor-0",
        run_id="run-x",
        run=run,
        ports={},
        heartbeat_interval_s=1.0,
        heartbeat_liveness=3,
        max_message_bytes=1 << 20,
    )


@pytest.mark.parametrize("env_id", ["os:abort", "os:system", "gymnasium.envs.classic_control:CartPoleEnv", ENV_ID])
def test_a_module_env_id_is_refused_unless_allowed(env_id: str) -> None:
    config, why = joinable(welcome_of(env_id), None, frozenset())
    assert config is None and f"--allow-code {env_id}" in why
    with pytest.raises(EnvError, match="does not allow it"):
        env_factory(env_id, allowed=frozenset({"some.other:env"}))
    config, why = joinable(welcome_of(env_id), None, frozenset({env_id}))
    assert config is not None and why == ""


def test_registered_gymnasium_ids_need_no_allowing() -> None:
    assert env_refusal("CartPole-v1", frozenset()) == ""
    config, why = joinable(welcome_of("CartPole-v1"), None, frozenset())
    assert config is not None and why == ""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")
def test_an_actor_refuses_a_run_whose_env_it_does_not_allow_and_waits_idle(
    procs: Procs, broker: BrokerHandle, bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sentinel = tmp_path / "env-called"
    monkeypatch.setenv(SENTINEL_ENV, str(sentinel))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.delenv("ZDDRL_ALLOW_CODE", raising=False)
    Shard(bus, broker, "learner-0", "run-x", Config().replace({"env.id": ENV_ID}).to_dict())

    refusing = procs.start("refusing", "actor", "--connect", broker.connect, "--actor-id", "0")
    wait_for(lambda: "refused run 'run-x'" in procs.log("refusing"), 30, "the actor to refuse the run")
    log = procs.log("refusing")
    assert f"env '{ENV_ID}' names code to import" in log and f"--allow-code {ENV_ID}" in log, log[-2000:]
    wait_for(
        lambda: status(broker, bus)["members"]["actor-0"]["stats"].get("refused_runs") == 1, WAIT_S, "refused_runs"
    )
    before = cpu_seconds(refusing.pid)
    time.sleep(2.0)
    assert cpu_seconds(refusing.pid) - before < 0.5, "a refusing actor waits, it does not spin"
    assert refusing.poll() is None and log.count("refused run") == 1
    assert not sentinel.exists(), "the refusing actor imported and called the env factory"

    # The same run, on a host that allows the env (by the environment variable, comma separated): it is built.
    monkeypatch.setenv("ZDDRL_ALLOW_CODE", f"some.other:env,{ENV_ID}")
    procs.start("allowing", "actor", "--connect", broker.connect, "--actor-id", "1")
    wait_for(sentinel.exists, 30, "the allowing actor to build the env")
    assert str(refusing.pid) not in sentinel.read_text().split()


def test_allow_code_takes_several_references_in_one_value_and_a_pickled_envs_path_whole() -> None:
    from zddrl.cli.common import allowed_code

    assert allowed_code(("a:b, c:d", "e:f")) == {"a:b", "c:d", "e:f"}
    assert allowed_code(("cloudpickle:/runs/my run, 2/env.cloudpickle",)) == {
        "cloudpickle:/runs/my run, 2/env.cloudpickle"
    }
