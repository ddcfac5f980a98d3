"""`zddrl status` and `zddrl status --watch`: the fleet as members, health warnings and departures.

Units render hand-made status bodies; the rest runs a real broker process with real ``BrokerLink``
members, and ``--watch`` as a real `zddrl status` process, piped (plain text) or on a pseudo-terminal
(rich), stopped with SIGINT as Ctrl-C would.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from conftest import BrokerHandle, Procs, wait_for
from zddrl import protocol as P
from zddrl.config import Config
from zddrl.ops.status import PlainScreen, format_status
from zddrl.transport.link import BrokerLink
from zddrl.transport.status import request_status

WAIT_S = 10.0
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def body(**extra: Any) -> dict[str, Any]:
    """A status body as the broker sends it (docs/protocol.md, section 9)."""
    member = {
        "role": "actor",
        "host": "node1",
        "pid": 42,
        "num_envs": 4,
        "policy_version": 3,
        "last_seen_s": 0.2,
        "credit": 0,
        "messages": 9,
        "bytes": 100,
        "env_steps": 36,
        "stats": {"sps": 900.0, "comm_share": 0.5, "rss_mb": 123.4},
    }
    return {
        "broker": {
            "uptime_s": 12.5,
            "host": "node0",
            "run_id": "run-a",
            "policy_version": 3,
            "ports": {},
            "received": 10,
            "forwarded": 10,
            "dropped": {"malformed": 0},
            "in_flight": 0,
            "bytes_in": 100,
            "bytes_out": 100,
            "accounted": True,
        },
        "members": {"actor-0": member, "actor-1": {**member, "stats": {}}},
        **extra,
    }


def test_format_status_lists_health_warnings_and_departures() -> None:
    crash = "crashed: RuntimeError: " + "x" * 300 + "\nTraceback (most recent call last):\n  File ..."
    text = format_status(
        body(
            health=[{"member": "actor-0", "check": "comm_share", "message": "spends 50% of its time", "since_s": 4.0}],
            departures=[
                {
                    "member": "actor-7",
                    "role": "actor",
                    "host": "node7",
                    "pid": 7,
                    "reason": crash,
                    "crashed": True,
                    "time": 0.0,
                    "ago_s": 3.0,
                },
                {
                    "member": "actor-8",
                    "role": "actor",
                    "host": "node8",
                    "pid": 8,
                    "reason": "expired: silent for 3.1 s",
                    "crashed": False,
                    "time": 0.0,
                    "ago_s": 9.0,
                },
            ],
        )
    )
    rows = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.startswith("actor-")}
    assert set(rows) == {"actor-0", "actor-1"}, "only members' rows start at the margin"
    assert rows["actor-0"][-3:] == ["123", "1", "0.2"], "rss_mb, warnings, seen"
    assert rows["actor-1"][-3:] == ["-", "-", "0.2"]
    assert "health warnings (1):" in text and re.search(r"^  actor-0 +comm_share +4 +spends 50%", text, re.M)
    assert re.search(r"^  actor-7 +actor +node7:7 +3 +crashed: RuntimeError: x+\.\.\.$", text, re.M)
    assert "Traceback" not in text, "crash reports show their first line; --json has the rest"
    assert re.search(r"^  actor-8 .* expired: silent for 3.1 s$", text, re.M)


def test_format_status_of_a_broker_without_health_or_departures() -> None:
    text = format_status(body())
    assert "health: ok" in text and "departures" not in text


def test_plain_screen_appends_frames_when_not_a_terminal() -> None:
    out = io.StringIO()
    with PlainScreen(out) as screen:
        screen.show("header 1", body(), None)
        screen.show("header 2", body(), "broker unreachable at tcp://x:1: no answer within 1 s")
    text = out.getvalue()
    assert PlainScreen.CLEAR not in text
    assert text.index("header 1") < text.index("header 2") < text.index("broker unreachable")
    assert text.count("actor-0") >= 2, "the last status stays on screen under the warning"


# ------------------------------------------------------------------------------------------------
# A real broker
# ------------------------------------------------------------------------------------------------


class Members:
    def __init__(self, broker: BrokerHandle) -> None:
        self.broker = broker
        self.ctx = zmq.Context()
        self.links: list[BrokerLink] = []

    def join(self, role: str, peer_id: str, **hello: Any) -> BrokerLink:
        link = BrokerLink(self.broker.connect, P.Hello(role=role, peer_id=peer_id, **hello), context=self.ctx).start()
        self.links.append(link)
        assert link.wait_welcome(WAIT_S) is not None, f"{peer_id}: no welcome"
        return link

    def status(self) -> dict[str, Any]:
        got = request_status(self.broker.connect, WAIT_S, self.ctx)
        assert got is not None, "the broker did not answer"
        return got

    def close(self) -> None:
        for link in self.links:
            link.close("test over")
        self.ctx.destroy(linger=0)


def fleet(broker: BrokerHandle) -> Members:
    members = Members(broker)
    members.join("learner", "learner-0", run_id="run-w", run=Config().to_dict())
    for i in range(2):
        link = members.join("actor", f"actor-{i}", num_envs=2)
        link.send(P.Stats(peer_id=f"actor-{i}", role="actor", stats={"sps": 1000.0 + i, "comm_share": 0.1}))
    return members


@pytest.fixture
def fast_broker(procs: Procs, tmp_path: Path) -> BrokerHandle:
    """Heartbeats every 0.2 s: a silent member expires after 0.6 s."""
    handle = BrokerHandle(procs, tmp_path)
    profile = tmp_path / "broker.toml"
    profile.write_text("[broker]\nheartbeat_interval_s = 0.2\nheartbeat_liveness = 3\n")
    _, traj_port, learner_port, params_port = handle.ports
    handle.proc = procs.start(
        "broker",
        "broker",
        "--profile",
        str(profile),
        "--bind",
        handle.connect,
        "--insecure",
        "--trajectory-port",
        str(traj_port),
        "--learner-port",
        str(learner_port),
        "--params-port",
        str(params_port),
        "--ready-file",
        str(handle.ready),
    )
    wait_for(lambda: handle.ready.exists() or handle.proc.poll() is not None, 20, "the broker to bind")
    assert handle.proc.poll() is None, procs.log("broker")
    return handle


@pytest.fixture
def members(broker: BrokerHandle) -> Iterator[Members]:
    m = fleet(broker)
    try:
        yield m
    finally:
        m.close()


@pytest.mark.slow
def test_status_shows_every_live_member_and_drops_expired_ones(fast_broker: BrokerHandle) -> None:
    members = fleet(fast_broker)
    try:
        leaver = members.join("actor", "leaver")
        ghost = members.ctx.socket(zmq.DEALER)  # says hello, then never a word: expires
        ghost.setsockopt(zmq.LINGER, 0)
        ghost.connect(fast_broker.connect)
        ghost.send_multipart(P.encode(P.Hello(role="actor", peer_id="ghost")))
        assert ghost.poll(int(WAIT_S * 1000)) and isinstance(P.decode(ghost.recv_multipart()), P.Welcome)
        leaver.close("maintenance")
        got = wait_for(
            lambda: (b := members.status()) and {d["member"] for d in b["departures"]} == {"ghost", "leaver"} and b,
            WAIT_S,
            "the expiry and the bye",
        )
        assert set(got["members"]) == {"learner-0", "actor-0", "actor-1"}
        reasons = {d["member"]: d["reason"] for d in got["departures"]}
        assert reasons["leaver"] == "maintenance" and re.fullmatch(r"expired: silent for \d+\.\d s", reasons["ghost"])
        assert not any(d["crashed"] for d in got["departures"])

        out = subprocess.run(
            [sys.executable, "-m", "zddrl", "status", "--connect", fast_broker.connect],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
        assert out.returncode == 0, out.stderr
        rows = {ln.split()[0]: ln.split() for ln in out.stdout.splitlines() if re.match(r"(actor|learner)-\d", ln)}
        assert set(rows) == {"learner-0", "actor-0", "actor-1"}
        assert rows["actor-1"][1] == "actor" and "1001" in rows["actor-1"] and rows["learner-0"][1] == "learner"
        assert re.search(r"^  ghost +actor .* expired: silent for", out.stdout, re.M), out.stdout
        assert re.search(r"^  leaver +actor .* maintenance$", out.stdout, re.M)
    finally:
        members.close()


# ------------------------------------------------------------------------------------------------
# --watch as a real process
# ------------------------------------------------------------------------------------------------


def watch_cmd(connect: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "zddrl",
        "status",
        "--connect",
        connect,
        "--watch",
        "--interval",
        "0.2",
        "--timeout",
        "0.5",
    ]


@pytest.mark.slow
def test_watch_piped_prints_frames_survives_a_dead_broker_and_quits_on_sigint(
    broker: BrokerHandle, members: Members, tmp_path: Path
) -> None:
    log = tmp_path / "watch.out"
    with open(log, "w") as f:
        proc = subprocess.Popen(watch_cmd(broker.connect), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for(
            lambda: all(re.search(rf"^{m} ", log.read_text(), re.M) for m in ("learner-0", "actor-0", "actor-1")),
            20,
            "a frame listing every member",
        )
        assert "\x1b[" not in log.read_text(), "no terminal codes in a file"
        broker.proc.kill()
        broker.proc.wait(timeout=WAIT_S)
        wait_for(lambda: "broker unreachable at " + broker.connect in log.read_text(), 20, "the unreachable frame")
        assert proc.poll() is None, "the watch keeps going without a broker"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=WAIT_S) == 0, log.read_text()
        assert "Traceback" not in log.read_text() and "KeyboardInterrupt" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def read_pty(fd: int, timeout_s: float) -> bytes:
    """What the child wrote within ``timeout_s`` (b"" at its end)."""
    chunks = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, min(0.05, deadline - time.monotonic())))
        if not ready:
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.slow
def test_watch_on_a_terminal_draws_rich_tables_and_quits_on_ctrl_c(broker: BrokerHandle, members: Members) -> None:
    pytest.importorskip("rich")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # room for every column
    env = {**os.environ, "TERM": "xterm-256color", "PYTHONIOENCODING": "utf-8", "COLUMNS": "200", "LINES": "50"}
    proc = subprocess.Popen(watch_cmd(broker.connect), stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 30
        while not all(m in ANSI.sub("", seen.decode("utf-8", "replace")) for m in ("learner-0", "actor-0", "actor-1")):
            assert time.monotonic() < deadline and proc.poll() is None, seen.decode("utf-8", "replace")[-3000:]
            seen += read_pty(master, 0.2)
        text = ANSI.sub("", seen.decode("utf-8", "replace"))
        assert "members" in text and "health: ok" in text and "━" in text, "a rich table"
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + WAIT_S
        while proc.poll() is None and time.monotonic() < deadline:
            seen += read_pty(master, 0.1)  # keep reading: a full terminal would block its writes
        assert proc.wait(timeout=1) == 0
        assert b"Traceback" not in seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


@pytest.mark.slow
def test_status_json_has_the_new_keys(broker: BrokerHandle, members: Members) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "zddrl", "status", "--connect", broker.connect, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    got = json.loads(out.stdout)
    assert got["health"] == [] and got["departures"] == []
    assert set(got["members"]) == {"learner-0", "actor-0", "actor-1"}


def test_format_status_shows_a_replay_learners_buffer() -> None:
    actor = body()["members"]["actor-0"]
    learner = {
        **actor,
        "role": "learner",
        "stats": {
            "shard": 0,
            "policy_version": 7,
            "updates": 7,
            "replay_size": 12_345,
            "replay_fill": 0.125,
            "replay_bytes": 6_500_000,
            "grad_steps_total": 900,
        },
    }
    text = format_status(body(members={"learner-0": learner}))
    assert "replay: 12345 transitions, fill 12%, 6.5 MB, 900 gradient steps" in text


def test_format_status_shows_each_replay_service_with_its_accounting() -> None:
    actor = body()["members"]["actor-0"]
    stats = {"received": 10, "inserted_trajectories": 9, "invalid": 1, "replay_size": 2304, "replay_fill": 0.5}
    stats.update(replay_bytes=2_000_000, requests=40, served=10240)
    replay = {**actor, "role": "replay", "stats": stats}
    broken = {**actor, "role": "replay", "stats": {**stats, "invalid": 0}}
    text = format_status(body(members={"replay-0": replay, "replay-1": broken}))
    assert "replay replay-0: 2304 transitions, fill 50%, 2.0 MB; received 10 = inserted 9 + refused 1  [ok]" in text
    assert "replay replay-1:" in text and "[MISMATCH]" in text
