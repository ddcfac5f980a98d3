"""Learner shards: device plans, 2 gloo shards == 1 learner on the same data, failures, CartPole end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import BrokerHandle, Procs, wait_for
from test_train import CARTPOLE, ROOT, processes_mentioning, train
from zddrl.proc import free_ports
from zddrl.shards.launch import DevicePlan, Rendezvous, launched_as_shard, plan_devices, shard_environments

WORKER = str(Path(__file__).resolve().parent / "shard_worker.py")


# ---------------------------------------------------------------- device plans and rendezvous
def test_device_plans() -> None:
    assert plan_devices("auto", cuda_count=0).devices == ("cpu",)
    assert plan_devices("auto", cuda_count=2).devices == ("cuda:0",)
    assert plan_devices("cpu:2", cuda_count=2).devices == ("cpu", "cpu")
    assert plan_devices("cpu", cuda_count=0).backend == "gloo"
    plan = plan_devices("0,1", cuda_count=2)
    assert plan.devices == ("cuda:0", "cuda:1") and plan.backend == "nccl"
    for bad, why in [("1", "does not exist here"), ("cpu:0", "cpu:N"), ("1,1", "distinct"), ("x", "expected")]:
        with pytest.raises(ValueError, match=why):
            plan_devices(bad, cuda_count=1)


@pytest.mark.slow
def test_a_bad_gpus_value_is_a_usage_error_before_anything_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "zddrl", "train", CARTPOLE, "--gpus", "cpu:x", "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "learner.gpus: --gpus 'cpu:x': cpu:N needs N in 1..64" in done.stderr
    assert not (tmp_path / "run").exists()


def test_shard_environments_are_torchruns() -> None:
    envs = shard_environments(
        DevicePlan(("cpu",) * 2), Rendezvous(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500), base={}
    )
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [("2", "0", "4"), ("3", "1", "4")]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"} and all(launched_as_shard(e) for e in envs)
    with pytest.raises(ValueError, match="master-port"):
        shard_environments(DevicePlan(("cpu",)), Rendezvous(nnodes=2), base={})
    with pytest.raises(ValueError, match="not loopback"):
        shard_environments(DevicePlan(("cpu",)), Rendezvous(nnodes=2, master_port=29500), base={})


# ---------------------------------------------------------------- equivalence
@pytest.mark.slow
def test_exchange_carries_small_and_long_payloads_between_shards(tmp_path: Path) -> None:
    """Small payloads ride the first all-gather; a long one (on any shard) takes a second one, on all."""
    procs = []
    for rank, env in enumerate(shard_environments(DevicePlan(("cpu",) * 2), Rendezvous())):
        out = tmp_path / f"x{rank}.npy"
        procs.append((subprocess.Popen([sys.executable, WORKER, "exchange", str(out)], env=env), out))
    for proc, _ in procs:
        assert proc.wait(timeout=60) == 0
    got = [str(np.load(out)) for _, out in procs]
    assert got[0] == got[1]  # every shard sees the same
    small0, small1 = (
        {"records": [{"peer_id": "actor-0", "seq": 0}], "stop": False},
        {"records": [{"peer_id": "actor-0", "seq": 1}], "stop": False},
    )
    big0, big1 = {"blob": b"\x00" * 10_000}, {"blob": b"\x01" * 20_000}
    assert got[0] == repr([[small0, small1], [big0, big1], [big0, small1], [None, None]])


def _start_workers(mode: str, tmp_path: Path, world: int) -> list[tuple[subprocess.Popen, Path]]:
    """``world`` gloo shards on a rendezvous port of their own (1: one learner, no rendezvous), each with its own
    output file: runs of different sizes are independent and may run at the same time."""
    envs = shard_environments(DevicePlan(("cpu",) * world), Rendezvous()) if world > 1 else [dict(os.environ)]
    procs = []
    for rank, env in enumerate(envs):
        out = tmp_path / f"{mode}-{world}-{rank}.npz"
        procs.append(
            (
                subprocess.Popen([sys.executable, WORKER, mode, str(out)], env=env, stderr=subprocess.PIPE, text=True),
                out,
            )
        )
    return procs


def _collect(procs: list[tuple[subprocess.Popen, Path]]) -> list[dict[str, np.ndarray]]:
    """Each worker's saved arrays, in order, once it exited cleanly; every worker is killed at the end either way."""
    results = []
    try:
        for proc, out in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            results.append(dict(np.load(out)))
    finally:
        for proc, _ in procs:
            proc.kill()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async", "impala"])
def test_two_shards_with_half_batches_learn_what_one_learner_learns(mode: str, tmp_path: Path) -> None:
    """Same data, 4 updates x 3 epochs with observation and reward normalisation: 2 gloo shards, each
    with part of every batch (2+2, 1+3, 3+1 and 4+0 trajectories), end with the parameters,
    normalisation statistics and reward streams of one learner that saw every batch whole."""
    single, shard0, shard1 = _collect(_start_workers(mode, tmp_path, 1) + _start_workers(mode, tmp_path, 2))
    np.testing.assert_array_equal(shard0["flat"], shard1["flat"])  # identical, not merely close
    assert not np.allclose(single["flat"], _run_initial(mode))  # they did learn something
    for key in single:
        np.testing.assert_allclose(shard0[key], single[key], rtol=2e-5, atol=2e-6, err_msg=key)


def _run_initial(mode: str) -> np.ndarray:
    from shard_worker import SPEC, config

    from zddrl.algos.impala.learner import ImpalaLearner
    from zddrl.algos.ppo.learner import PPOLearner

    return (ImpalaLearner if mode == "impala" else PPOLearner)(config(mode), SPEC).params()[0]


# ---------------------------------------------------------------- the real thing
@pytest.mark.slow
def test_train_with_two_cpu_shards_feeds_both_and_stops_at_max_steps(tmp_path: Path) -> None:
    # The plumbing of `--gpus cpu:2` through `zddrl train`. That 2 shards learn what 1 learner does is pinned by
    # test_two_shards_with_half_batches_learn_what_one_learner_learns; that a cpu:2 group learns to a target through
    # `zddrl train`, by ops/test_restart.py's test_train_restarts_the_whole_shard_group_when_one_shard_dies.
    run_dir = tmp_path / "run"
    summary = train(run_dir, "--gpus", "cpu:2", "--max-steps", "3000")
    assert summary["total_env_steps"] >= 3000 and summary["updates"] >= 10, summary  # 3000 / 256: 12 updates
    assert summary["shards"] == 2
    assert all(n > 0 for n in summary["shard_trajectories"])  # the broker fed both shards
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["shards"] == 2
    assert (run_dir / "logs" / "learner.loguru.shard1.log").exists()
    assert not processes_mentioning(str(run_dir))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "impala"])
def test_two_cpu_shards_train_in_the_async_modes(mode: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = CARTPOLE if mode == "async" else str(ROOT / "examples" / "cartpole_impala.toml")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "zddrl",
            "train",
            config,
            "--schedule",
            "async",
            "--gpus",
            "cpu:2",
            "--run-dir",
            str(run_dir),
            "--until-return",
            "100",
            "--max-seconds",
            "90",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["reached"] is True and summary["algorithm"] == ("impala" if mode == "impala" else "ppo")
    assert all(n > 0 for n in summary["shard_trajectories"])


@pytest.mark.slow
def test_a_dead_shard_takes_the_group_down_with_a_clear_error(
    procs: Procs, broker: BrokerHandle, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    learner = procs.start(
        "learner",
        "learner",
        CARTPOLE,
        "--connect",
        broker.connect,
        "--shards",
        "2",
        "--run-dir",
        str(run_dir),
        "--set",
        "train.max_seconds=120",
    )
    procs.start("actor", "actor", "--connect", broker.connect, "--actor-id", "0")
    wait_for(
        lambda: (run_dir / "metrics.csv").exists() and len((run_dir / "metrics.csv").read_text().splitlines()) > 3,
        60,
        "the sharded learner to train",
    )
    shard1 = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_shard(int(p), "1", str(run_dir))]
    assert len(shard1) == 1
    os.kill(shard1[0], signal.SIGKILL)
    assert learner.wait(timeout=60) != 0
    log = procs.log("learner")
    assert "learner shard 1" in log and "exited with code -9" in log and "--resume" in log
    wait_for(lambda: not processes_mentioning(str(run_dir)), 20, "every shard to be gone")


def _is_shard(pid: int, rank: str, marker: str) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return marker.encode() in cmd and f"RANK={rank}".encode() in env


@pytest.mark.slow
def test_a_hung_shard_fails_the_group_within_the_collective_timeout(
    procs: Procs, broker: BrokerHandle, tmp_path: Path
) -> None:
    """A shard that stops answering (SIGSTOP: alive, silent) is a failure after learner.collective_timeout_s."""
    run_dir = tmp_path / "run"
    learner = procs.start(
        "learner",
        "learner",
        CARTPOLE,
        "--connect",
        broker.connect,
        "--shards",
        "2",
        "--run-dir",
        str(run_dir),
        "--set",
        "learner.collective_timeout_s=3",
        "--set",
        "train.max_seconds=120",
    )
    procs.start("actor", "actor", "--connect", broker.connect, "--actor-id", "0")
    wait_for(
        lambda: (run_dir / "metrics.csv").exists() and len((run_dir / "metrics.csv").read_text().splitlines()) > 3,
        60,
        "the sharded learner to train",
    )
    (shard1,) = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_shard(int(p), "1", str(run_dir))]
    os.kill(shard1, signal.SIGSTOP)
    try:
        assert learner.wait(timeout=45) != 0
    finally:
        try:
            os.kill(shard1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert "learner shard 0" in procs.log("learner") and "timed out" in procs.log("learner").lower()
    wait_for(lambda: not processes_mentioning(str(run_dir)), 20, "every shard to be gone")


def _own_address() -> str | None:
    """This host's non-loopback IPv4 address (multi-node rendezvous refuses loopback), if it has one."""
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
        address = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if address.startswith("127.") else address


@pytest.mark.slow
def test_two_nodes_meet_through_the_multi_node_rendezvous(procs: Procs, broker: BrokerHandle, tmp_path: Path) -> None:
    """Two `zddrl learner --nnodes 2` commands, one per "node" (here both on this host, through its own
    address), form one group of two shards: node 0 runs the run, node 1's shard trains in step."""
    address = _own_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 address on this host")
    port = str(free_ports(1)[0])
    common = [
        "--connect",
        broker.connect,
        "--shards",
        "1",
        "--nnodes",
        "2",
        "--master-addr",
        address,
        "--master-port",
        port,
        "--set",
        "train.max_steps=3000",
    ]
    node1 = procs.start("node1", "learner", CARTPOLE, *common, "--node-rank", "1", "--run-dir", str(tmp_path / "n1"))
    node0 = procs.start("node0", "learner", CARTPOLE, *common, "--node-rank", "0", "--run-dir", str(tmp_path / "n0"))
    procs.start("actor", "actor", "--connect", broker.connect, "--actor-id", "0")
    assert node0.wait(timeout=90) == 0, procs.log("node0")[-3000:]
    assert node1.wait(timeout=30) == 0, procs.log("node1")[-3000:]
    summary = json.loads((tmp_path / "n0" / "summary.json").read_text())
    assert summary["shards"] == 2 and summary["updates"] >= 5 and all(n > 0 for n in summary["shard_trajectories"])
    assert not (tmp_path / "n1" / "summary.json").exists()  # only the main shard writes the run directory
