"""The local bus: a run on one machine talks over ipc sockets in an owner-only directory, which no other local user
can connect to (docs/security.md, "Local runs"); the open TCP bus only when chosen (`--open-tcp`, `--insecure`)."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from conftest import Procs, wait_for
from zddrl.config import ConfigError, ipc_endpoint, private_bus_dir, socket_endpoint, split_endpoints
from zddrl.transport.status import request_status

ROOT = Path(__file__).resolve().parents[2]
CARTPOLE = str(ROOT / "examples" / "cartpole_ppo.toml")
BOUND = re.compile(r"broker bound on (ipc://\S+/control)")


def test_the_data_sockets_of_a_local_bus_are_files_beside_its_control_endpoint() -> None:
    control = "ipc:///tmp/zddrl-abc/control"
    assert split_endpoints(control) == (control,)
    for name in ("trajectories", "learners", "params"):  # the welcome names no ports on a local bus
        assert socket_endpoint(control, name, {}) == f"ipc:///tmp/zddrl-abc/{name}"
    assert socket_endpoint("tcp://10.0.0.2:5555", "params", {"params": 5558}) == "tcp://10.0.0.2:5558"


@pytest.mark.parametrize(
    "bad", ["ipc://relative/control", "ipc:///tmp/zddrl-abc/trajectories", "ipc:///" + "d" * 100 + "/control"]
)
def test_a_local_endpoint_is_an_absolute_directory_and_short_enough(bad: str) -> None:
    with pytest.raises(ConfigError, match="ipc://DIR/control|a Unix socket takes"):
        split_endpoints(bad)


def test_a_private_bus_directory_is_owner_only_and_short() -> None:
    directory = private_bus_dir()
    try:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert len(ipc_endpoint(directory, "trajectories")) - len("ipc://") <= 107
    finally:
        directory.rmdir()


def ready_endpoint(ready: Path) -> str | None:
    """The endpoint a broker wrote to its --ready-file, once the whole file is there (it is written, not renamed)."""
    try:
        return json.loads(ready.read_text())["endpoint"]
    except (OSError, ValueError, KeyError):
        return None


def zddrl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zddrl", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_broker_without_a_bind_serves_the_local_bus_and_removes_it(procs: Procs, tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = procs.start("broker", "broker", "--ready-file", str(ready))
    wait_for(lambda: ready_endpoint(ready) or proc.poll() is not None, 20, "the broker to bind")
    assert proc.poll() is None, procs.log("broker")
    endpoint = ready_endpoint(ready)
    assert endpoint is not None
    directory = Path(endpoint.removeprefix("ipc://")).parent
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert sorted(os.listdir(directory)) == ["control", "learners", "params", "trajectories"]
    status = request_status(endpoint, 10)
    assert status is not None and status["broker"]["ports"] == {}, status
    assert procs.stop(proc) == 0
    assert not directory.exists(), "the local bus's directory outlived the broker"


@pytest.mark.slow
def test_a_tcp_bind_without_keys_is_the_open_bus_only_when_chosen() -> None:
    refused = zddrl("broker", "--bind", "tcp://127.0.0.1:*")
    assert refused.returncode == 2, refused.stderr
    assert "open TCP bus" in refused.stderr and "--insecure" in refused.stderr and "Traceback" not in refused.stderr


PROBE = r"""
import json, os, socket, sys, time, zmq
from zddrl import protocol as P

control = sys.argv[1]
path = control.removeprefix("ipc://")
out = {}
try:
    os.listdir(os.path.dirname(path))
    out["list"] = "listed"
except OSError as exc:
    out["list"] = exc.strerror
raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    raw.connect(path)
    out["connect"] = "connected"
except OSError as exc:
    out["connect"] = exc.strerror
ctx = zmq.Context()


def ask(endpoint, kind, msg):
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.immediate = True  # queue only to a connection that is made: a send that succeeds reached the broker's socket
    sock.connect(endpoint)
    frames = P.encode(msg) if msg is not None else [P.PREAMBLE, b"junk"]
    deadline = time.monotonic() + 3
    while True:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            break
        except zmq.Again:
            if time.monotonic() > deadline:
                return "unsent: no connection"
            time.sleep(0.05)
    if kind == zmq.PUSH:
        return "sent"
    return "answered" if sock.poll(3000) else "no answer"


out["hello"] = ask(control, zmq.DEALER, P.Hello(role="monitor", peer_id="monitor-probe"))
out["status"] = ask(control, zmq.DEALER, P.StatusRequest(peer_id="status"))
out["push"] = ask(os.path.join(os.path.dirname(control), "trajectories"), zmq.PUSH, None)
print(json.dumps(out))
"""


def other_user() -> str:
    """A fresh local user for the test (skips when not root or without useradd); the caller removes it."""
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("needs root and useradd to make another local user")
    name = f"zddrlp{os.getpid() % 100000}"
    made = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/bin/false", name], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"useradd failed: {made.stderr.decode(errors='replace').strip()}")
    return name


def as_user(name: str, python: str, *args: str) -> subprocess.CompletedProcess:
    """``python *args`` run as the user ``name`` (its own uid and gid, no other groups), importing zddrl from here."""
    entry = pwd.getpwnam(name)
    site = str(Path(zmq.__file__).resolve().parents[1])  # pyzmq's, msgpack's, numpy's: this environment's packages
    return subprocess.run(
        [python, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        user=entry.pw_uid,
        group=entry.pw_gid,
        extra_groups=[],
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join([str(ROOT), site])},
    )


def python_for(name: str) -> str:
    """An interpreter the user ``name`` may run with this environment's packages: this one, else the system's
    python3 of the same version (this one may sit under a home directory only its owner enters); skips if none."""
    why = ""
    for python in dict.fromkeys([sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"]):
        try:
            tried = as_user(name, python, "-c", "import zmq, zddrl.protocol")
        except OSError as exc:
            why = f"{python}: {exc.strerror}"
            continue
        if tried.returncode == 0:
            return python
        why = f"{python}: {tried.stderr.strip()[-300:]}"
    pytest.skip(f"no Python the other user may run with these packages ({why})")


@pytest.mark.slow
def test_another_local_user_gets_nothing_from_a_running_train(tmp_path: Path) -> None:
    user = other_user()
    run_dir = tmp_path / "run"
    train = subprocess.Popen(
        [sys.executable, "-m", "zddrl", "train", CARTPOLE, "--run-dir", str(run_dir), "--max-steps", "30000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        python = python_for(user)
        log = run_dir / "logs" / "broker.log"
        found = wait_for(lambda: log.exists() and BOUND.search(log.read_text()), 60, "the broker to bind")
        endpoint = found.group(1)  # type: ignore[union-attr]
        wait_for(lambda: (run_dir / "metrics.csv").exists(), 90, "the run to learn")
        own = subprocess.run([sys.executable, "-c", PROBE, endpoint], capture_output=True, text=True, timeout=60)
        assert json.loads(own.stdout) == {  # the probe can tell: the run's own user reaches every socket
            "list": "listed", "connect": "connected", "hello": "answered", "status": "answered", "push": "sent"
        }, own.stderr[-2000:]  # fmt: skip
        probe = as_user(user, python, "-c", PROBE, endpoint)
        assert probe.returncode == 0, probe.stderr[-2000:]
        assert json.loads(probe.stdout) == {
            "list": "Permission denied", "connect": "Permission denied", "hello": "unsent: no connection",
            "status": "unsent: no connection", "push": "unsent: no connection",
        }  # fmt: skip
        out, err = train.communicate(timeout=300)
    finally:
        if train.poll() is None:  # Ctrl-C: it stops its processes and removes its bus directory
            train.send_signal(signal.SIGINT)
            try:
                train.wait(timeout=30)
            except subprocess.TimeoutExpired:
                train.kill()
                train.wait()
        subprocess.run(["userdel", user], capture_output=True)
    assert train.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["total_env_steps"] > 0 and summary["policy_version"] > 5, summary
    assert not Path(endpoint.removeprefix("ipc://")).parent.exists(), "the bus directory outlived the run"
    broker_log = (run_dir / "logs" / "broker.log").read_text()
    assert broker_log.count("monitor monitor-probe joined") == 1, "the own user's probe joined, the other's never"


@pytest.mark.slow
def test_the_open_tcp_bus_is_there_when_chosen(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = zddrl("train", CARTPOLE, "--run-dir", str(run_dir), "--max-steps", "3000", "--open-tcp", timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    broker_log = (run_dir / "logs" / "broker.log").read_text()
    assert re.search(r"broker bound on 127\.0\.0\.1: \{'control': \d+", broker_log), broker_log[-2000:]
    assert "open (TCP on loopback)" in done.stderr


def local_broker(procs: Procs, name: str, *options: str) -> tuple[str, Path]:
    """A `zddrl broker` given no bind (``options``: e.g. --upstream): its local bus's control endpoint and directory."""
    ready = procs.log_dir / f"{name}-ready.json"
    proc = procs.start(name, "broker", "--ready-file", str(ready), *options)
    wait_for(lambda: ready_endpoint(ready) or proc.poll() is not None, 30, f"the {name} to bind")
    assert proc.poll() is None, procs.log(name)
    endpoint = ready_endpoint(ready)
    assert endpoint is not None
    return endpoint, Path(endpoint.removeprefix("ipc://")).parent


@pytest.mark.slow
def test_every_role_works_over_the_local_bus(procs: Procs, tmp_path: Path) -> None:
    """A root broker and a relay under it (--upstream), each on its own local bus; a learner of two CPU shards on the
    root, an actor host of two processes (--procs) on the relay; `zddrl status` over ipc. The run learns, the root
    sees both relayed actors, and each bus's directory goes with its broker."""
    root, root_dir = local_broker(procs, "root")
    relay, relay_dir = local_broker(procs, "relay", "--upstream", root)
    run_dir = tmp_path / "run"
    limits = [f"--set=train.{k}" for k in ("until_return=1e9", "max_seconds=300", "max_steps=100000000")]
    learner = ["learner", CARTPOLE, "--connect", root, "--run-dir", str(run_dir), "--gpus", "cpu:2", *limits]
    started = [procs.start("learner", *learner), procs.start("actors", "actor", "--connect", relay, "--procs", "2")]
    rows = run_dir / "metrics.csv"
    wait_for(lambda: rows.exists() and len(rows.read_text().splitlines()) > 3, 120, "3 updates through the relay")
    shown = zddrl("status", "--connect", root, "--json")
    assert shown.returncode == 0, shown.stderr
    members = json.loads(shown.stdout)["members"]
    relayed = [m for m in members.values() if m["role"] == "actor" and m.get("relay")]
    assert len(relayed) == 2, members
    assert {"learner-0", "learner-1"} <= set(members), members
    for proc in [*started, *procs.procs[:2][::-1]]:  # the clients, then the relay, then the root
        procs.stop(proc)
    assert not root_dir.exists() and not relay_dir.exists(), "a local bus's directory outlived its broker"
