"""deploy/slurm/zddrl.sbatch for real: a one-node Slurm cluster on this machine (slurmctld, slurmd, munge from
Debian's packages, installed if missing), the keys made before submission, the job submitted with CartPole and
waited for; it must end with the target reached. Root only (the daemons run as root here); CI runs as root and
.ci/run installs the packages."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from zddrl.keys import new_key
from zddrl.proc import free_ports

pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,
    pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="a Slurm cluster needs root here"),
]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "slurm" / "zddrl.sbatch"
PACKAGES = ("slurm-wlm", "munge")
ZDDRL = str(Path(sys.executable).with_name("zddrl"))


def _installed() -> bool:
    return all(shutil.which(cmd) for cmd in ("slurmctld", "slurmd", "sbatch", "munged"))


def _install() -> None:
    """Debian's packages, when they are missing (CI's .ci/run installs them first)."""
    if _installed():
        return
    if not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], env=env, capture_output=True, timeout=900)
    if done.returncode != 0 or not _installed():
        pytest.skip(f"could not install {PACKAGES}: {done.stderr.decode()[-300:]}")


def _config(folder: Path, host: str) -> Path:
    """slurm.conf and cgroup.conf of a one-node cluster whose state, logs and ports are the test's own."""
    for sub in ("state", "spool", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    conf, ports = folder / "slurm.conf", free_ports(2, "0.0.0.0")
    conf.write_text(
        "\n".join(
            [
                "ClusterName=zddrltest",
                f"SlurmctldHost={host}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "MpiDefault=none",
                "ReturnToService=2",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                # sbatch --wait polls every 2 s, and backs off (x4, up to 32 s) only while below MinJobAge / 2: 0 keeps
                # it at 2 s, so the job's end is seen within 2 s (0 also means job records are never purged)
                "MinJobAge=0",
                f"StateSaveLocation={folder / 'state'}",
                f"SlurmdSpoolDir={folder / 'spool'}",
                f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
                f"SlurmdPidFile={folder / 'slurmd.pid'}",
                f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={folder / 'log' / 'slurmd.log'}",
                f"SlurmctldPort={ports[0]}",
                f"SlurmdPort={ports[1]}",
                f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
                "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    (folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nIgnoreSystemd=yes\n")
    return conf


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A running one-node cluster: the environment that points Slurm's commands at it. Its daemons (and a munged
    this test started) are stopped at the end; a munged that was running already is left as it was."""
    _install()
    folder = tmp_path / "slurm"
    env = {**os.environ, "SLURM_CONF": str(_config(folder, socket.gethostname()))}
    started: list[int] = []
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
        # munge's init script makes its socket folder; where none ran (no systemd, policy-rc.d), make it here
        subprocess.run(["install", "-d", "-o", "munge", "-g", "munge", "-m", "0755", "/run/munge"], check=True)
        subprocess.run(["/usr/sbin/munged", "--force"], check=True, capture_output=True, timeout=30)
        started.append(int(subprocess.run(["pgrep", "-x", "munged"], capture_output=True, text=True).stdout.split()[0]))
    try:
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([f"/usr/sbin/{daemon}", "-f", env["SLURM_CONF"]], env=env, check=True, timeout=30)
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, (folder / "log" / "slurmctld.log").read_text()[-2000:]
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True, timeout=30)
        for name in ("slurmd", "slurmctld"):
            pid_file = folder / f"{name}.pid"
            if pid_file.exists():
                _kill(int(pid_file.read_text().split()[0]))
        for pid in started:
            _kill(pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def test_a_batch_job_trains_cartpole_to_the_target(cluster: dict[str, str], tmp_path: Path) -> None:
    keys = tmp_path / "keys"  # made before submission, on the "shared filesystem" (one node: the local one)
    for role, name in (("broker", "hub"), ("learner", "trainer"), ("actor", "fleet"), ("monitor", "ops")):
        new_key(keys, role, name)  # what `zddrl keys new ROLE NAME --keys KEYS` does, without a process start
    run_dir = tmp_path / "run"
    env = {
        **cluster,
        "ZDDRL_KEYS": str(keys),
        "ZDDRL_COMMAND": ZDDRL,
        "ZDDRL_PORT": str(free_ports(4, "0.0.0.0")[0]),  # the broker binds it and the next three
        "ZDDRL_RUN_DIR": str(run_dir),
    }
    config = ROOT / "examples" / "cartpole_ppo.toml"
    done = subprocess.run(
        ["sbatch", "--wait", f"--chdir={tmp_path}", str(SCRIPT), str(config), "--set", "train.max_seconds=240"],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    output = "\n".join(p.read_text() for p in tmp_path.glob("zddrl-*.out"))
    assert done.returncode == 0, f"{done.stderr[-1000:]}\n{output[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reached"] is True and summary["return_at_target"] >= 475, summary
    assert "broker and learner on" in output and "learner finished" in output
