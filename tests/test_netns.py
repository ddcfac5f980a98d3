"""Hosts that are really apart: a broker, a standby broker, a learner, two actor hosts, a relay and a monitor, each in
a network namespace of its own on one bridge (10.77.0.N), on a closed bus where each host holds only its role's key
files (docs/security.md); the relay serves with a broker pair of its own and holds the root's public key only.

One IMPALA CartPole run serves every check, in order: it trains; partitions of 10 s (the host's link into the bridge
down, then up) of an actor and a relay together, of the learner, and of the broker each heal with no process
restarted and the accounting invariant intact in every status answer, the recovery time (link up to the role's
traffic counted again) measured and bounded. The standby (``--peer-role backup``) is up from the start and passive:
a client cut off from the primary alone is sent back by it, so the run stays on the primary; the primary's own
partition is a failover (the standby takes over, every client follows, and the primary, back and empty, turns
passive: the run stays on one broker). Last, the active broker gets kill -9 and every client moves to the other
within the bound docs/deploying.md states. Figures are printed and written to figures.json in the test's directory.
Root only (namespaces, veths, a bridge); CI runs as root.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from netns import POLL_INTERVAL_S, Net, Samples
from test_train import metrics
from zddrl.brokerconf import load_broker_config
from zddrl.tomlconf import to_toml

pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,
    pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="network namespaces need root here"),
]

ROOT = Path(__file__).resolve().parent.parent
ZDDRL = str(Path(sys.executable).with_name("zddrl"))
CONFIG = str(ROOT / "examples" / "cartpole_impala.toml")
"""Asynchronous: versions go on while one actor host is cut off."""
HEARTBEAT = {"heartbeat_interval_s": 0.5, "heartbeat_liveness": 5}
"""In place of brokers/cluster.toml's 2 s x 5, so that a partition's expiry and the failover fit a CI run."""
HOSTS = ["broker", "standby", "learner", "actor1", "relay", "actor2", "monitor"]
PARTITION_S = 10.0
"""Four times a member's expiry (0.5 s x 5): the cut-off roles leave the broker's members well inside it, and the
broker's own partition fails over to the standby (training through it 2.6-2.8 s after the cut, measured) before
it ends."""
RECOVERY_BOUND_S = 30.0
"""Link up to traffic again, at most: a client tries its brokers in turn with a capped back-off (8 s) between passes,
and a TCP connection that lost segments in the partition retransmits on its own back-off."""
START_S = 150.0
"""To the first versions: every process imports torch, and on a loaded machine that alone has taken over 40 s."""
PRIMARY, STANDBY = "a", "b"
"""The poller's names of the two brokers."""


@dataclass
class Run:
    """The hosts, the processes in them and what the monitor hears: one run for every test of the module."""

    net: Net
    samples: Samples
    folder: Path
    keys: dict[str, Path]
    profile: Path
    run_dir: Path
    brokers: str
    """The fallback list every client of the root is given: primary, standby."""
    figures: dict[str, Any] = field(default_factory=dict)

    def record(self, key: str, value: Any) -> None:
        self.figures[key] = value
        path = self.folder / "figures.json"
        path.write_text(json.dumps(self.figures, indent=2))
        print(f"\n{key}: {json.dumps(value)}  (all figures: {path})")

    def pid(self, name: str) -> int:
        return self.net.procs[name].pid

    def explain(self, what: str) -> str:
        return f"{what}\n{self.net.logs()}"


def zddrl_keys(keys: Path, role: str, name: str) -> None:
    subprocess.run([ZDDRL, "keys", "new", role, name, "--keys", str(keys)], check=True, capture_output=True)


def lay_out_keys(folder: Path) -> dict[str, Path]:
    """Keys made with `zddrl keys` on one trusted machine, then each host's folder with its role's files only
    (docs/security.md, "Distribution across hosts"; a relay: "Relays"). The standby is the broker's second host."""
    trusted, edge = folder / "trusted", folder / "edge"
    made = [("broker", "hub"), ("learner", "trainer"), ("actor", "fleet"), ("actor", "rack"), ("monitor", "ops")]
    made.append(("monitor", "pair"))  # the brokers' probe of each other (docs/deploying.md, "A standby broker")
    for role, name in [*made, ("relay", "r")]:
        zddrl_keys(trusted, role, name)
    zddrl_keys(edge, "broker", "edge")  # one broker key per directory: the relay's own pair is made apart
    hub, pins = ["broker/hub.key"], ["learners/trainer.sign.pub"]
    root = [*hub, "broker/hub.key_secret", "learners/trainer.key", *pins, "actors/fleet.key", "monitors/ops.key"]
    root += ["monitors/pair.key", "monitors/pair.key_secret"]
    files = {
        "broker": [*root, "relays/r.key"],
        "learner": [*hub, "learners/trainer.key", "learners/trainer.key_secret", "learners/trainer.sign", *pins],
        "actor1": [*hub, "actors/fleet.key", "actors/fleet.key_secret", *pins],
        "relay": ["@broker/edge.key", "@broker/edge.key_secret", *hub, "relays/r.key", "relays/r.key_secret"]
        + ["actors/rack.key", *pins],
        "actor2": ["@broker/edge.key", "actors/rack.key", "actors/rack.key_secret", *pins],
        "monitor": [*hub, "monitors/ops.key", "monitors/ops.key_secret"],
    }
    files["standby"] = files["broker"]
    hosts = {}
    for host, names in files.items():
        hosts[host] = folder / host
        for name in names:
            source = edge / name[1:] if name.startswith("@") else trusted / name
            (hosts[host] / name.lstrip("@")).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, hosts[host] / name.lstrip("@"))  # keeps a secret's 0600
    return hosts


def write_profile(folder: Path) -> Path:
    """brokers/cluster.toml with HEARTBEAT: the test's brokers and its failover bound read the same file."""
    profile = folder / "broker.toml"
    profile.write_text(to_toml({"broker": asdict(load_broker_config(ROOT / "brokers" / "cluster.toml", HEARTBEAT))}))
    return profile


def start_broker(run: Run, host: str, *options: str) -> None:
    net, ready = run.net, run.folder / f"{host}-ready.json"
    keys = ["--keys", str(run.keys[host])]
    bind = ["--bind", net.endpoint(host), "--ready-file", str(ready)]
    proc = net.start(host, host, ZDDRL, "broker", "--profile", str(run.profile), *keys, *bind, *options)
    deadline = time.monotonic() + 60
    while not ready.exists() and proc.poll() is None:
        assert time.monotonic() < deadline, run.explain(f"the {host} did not bind")
        time.sleep(0.05)
    assert proc.poll() is None, run.explain(f"the {host} exited")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    if not shutil.which("ip"):
        pytest.skip("no `ip` (iproute2) to make network namespaces with")
    folder = tmp_path_factory.mktemp("netns")
    net = Net(folder)
    try:
        net.make(HOSTS)
    except subprocess.CalledProcessError as exc:
        left = net.remove([])
        pytest.skip(f"cannot make network namespaces here: {exc.stderr.strip()} {left or ''}")
    try:
        yield start_run(net, folder)
    finally:
        order = ["learner", "actor1", "actor2", "relay", "broker", "standby", "monitor"]
        left = net.remove(order) + net.leftovers()
        assert not left, f"left on the machine: {left}"


def start_run(net: Net, folder: Path) -> Run:
    brokers = f"{net.endpoint('broker')},{net.endpoint('standby')}"
    samples = Samples(folder / "status.jsonl")
    run = Run(net, samples, folder, lay_out_keys(folder), write_profile(folder), folder / "run", brokers)
    start_broker(run, "broker", "--peer", net.endpoint("standby"), "--peer-role", "primary")
    start_broker(run, "standby", "--peer", net.endpoint("broker"), "--peer-role", "backup")
    assert net.reachable("monitor", "broker", 5555), (
        "the bridge forwards nothing between the test's namespaces: where br_netfilter is loaded, an iptables FORWARD "
        "policy of DROP (Docker sets one) drops bridged traffic"
    )
    start_broker(run, "relay", "--key", "edge", "--upstream", brokers)
    watched = [f"{PRIMARY}={net.endpoint('broker')}", f"{STANDBY}={net.endpoint('standby')}"]
    poller = [sys.executable, str(Path(__file__).with_name("netns.py")), "--out", str(samples.path)]
    net.start("monitor", "monitor", *poller, "--keys", str(run.keys["monitor"]), *watched)
    limits = [f"--set=train.{k}" for k in ("until_return=1e9", "max_seconds=900", "max_steps=100000000")]
    net.start(
        "learner", "learner", ZDDRL, "learner", CONFIG, "--connect", brokers, "--keys", str(run.keys["learner"]),
        "--run-dir", str(run.run_dir), *limits,
    )  # fmt: skip
    client = [ZDDRL, "actor", "--keys"]
    net.start("actor1", "actor1", *client, str(run.keys["actor1"]), "--connect", brokers, "--actor-id", "1")
    net.start(
        "actor2", "actor2", *client, str(run.keys["actor2"]), "--connect", net.endpoint("relay"), "--actor-id", "2"
    )
    return run


# ----------------------------------------------------------------------------------------------- status answers
def rows(sample: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return sample["members"] if sample is not None else {}


def messages(sample: dict[str, Any] | None, peer: str) -> int:
    return int(rows(sample).get(peer, {}).get("messages") or 0)


def version(sample: dict[str, Any] | None) -> int:
    return int(sample["broker"]["policy_version"]) if sample is not None else -1


def relay_id(sample: dict[str, Any] | None) -> str | None:
    return next((peer for peer, row in rows(sample).items() if row["role"] == "relay"), None)


def everyone(sample: dict[str, Any]) -> bool:
    """The learner, the direct actor, the relay and the relayed actor are members, and both actors' trajectories
    are counted."""
    return "learner-0" in rows(sample) and relay_id(sample) is not None and all(
        messages(sample, a) > 0 for a in ("actor-1", "actor-2")
    )  # fmt: skip


def joined(peer: str, sample: dict[str, Any]) -> bool:
    """``peer`` is a member ("relay": the relay, whatever its id)."""
    return (relay_id(sample) if peer == "relay" else peer) in rows(sample)


def check_accounting(run: Run, broker: str) -> int:
    """received = forwarded + dropped (by reason) + in flight, at the broker and at every relay it lists, in every
    status answer the monitor got from ``broker``; returns how many answers were checked."""
    answers = run.samples.at(broker)
    for s in answers:
        b = s["broker"]
        assert b["received"] == b["forwarded"] + sum(b["dropped"].values()) + b["in_flight"], s
        assert b["accounted"] and b["accounted_subtree"], s
        assert all(view["accounted"] for view in b["relays"].values()), s
    return len(answers)


def pair_state(sample: dict[str, Any] | None) -> str:
    """What a broker of the standby pair says it is: active, passive or starting ("" without an answer)."""
    return str(sample["broker"]["standby"]["state"]) if sample is not None else ""


def check_same_processes(run: Run, sample: dict[str, Any], killed: str = "") -> None:
    """Every process but ``killed`` still runs, and the members are the processes the test started (their pids in
    the rows)."""
    for name, proc in run.net.procs.items():
        assert proc.poll() is None or name == killed, run.explain(f"{name} exited ({proc.returncode})")
    members = rows(sample)
    relay = relay_id(sample)
    assert relay is not None, sample
    for peer, name in [("learner-0", "learner"), ("actor-1", "actor1"), (relay, "relay"), ("actor-2", "actor2")]:
        assert members[peer]["pid"] == run.pid(name), (peer, members[peer], run.pid(name))


def status_cli(run: Run) -> dict[str, Any]:
    """`zddrl status --json` from the monitor host, with the monitor's key folder."""
    keys = ["--keys", str(run.keys["monitor"])]
    command = ["ip", "netns", "exec", run.net.hosts["monitor"][0], ZDDRL, "status", "--connect", run.brokers, *keys]
    done = subprocess.run([*command, "--json", "--timeout", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    body: dict[str, Any] = json.loads(done.stdout)
    return body


# ----------------------------------------------------------------------------------------------------------- tests
def test_a_closed_bus_across_hosts_trains(run: Run) -> None:
    started = time.monotonic()
    first = run.samples.first(PRIMARY, 0.0, lambda s: everyone(s) and version(s) >= 1, START_S)
    assert first is not None, run.explain("the learner, both actors and the relay at the broker, and a version")
    later = run.samples.first(PRIMARY, first["t"], lambda s: version(s) >= version(first) + 5, 60)
    assert later is not None, run.explain("5 more versions")
    check_same_processes(run, later)
    versions = [int(r["policy_version"]) for r in metrics(run.run_dir)]
    assert versions == sorted(versions) and len(versions) >= 5, versions
    body = status_cli(run)
    b = body["broker"]
    assert b["received"] == b["forwarded"] + sum(b["dropped"].values()) + b["in_flight"] and b["accounted"], b
    assert {"learner-0", "actor-1", "actor-2"} <= set(body["members"]) and b["policy_version"] >= version(later)
    assert body["members"]["actor-2"]["relay"] == relay_id(later)
    run.record("start_to_training_s", round(first["t"] - started, 2))
    check_accounting(run, PRIMARY)
    standby = run.samples.last(STANDBY, time.monotonic())
    assert standby is not None and pair_state(standby) == "passive" and rows(standby) == {}, standby
    assert not standby["broker"]["standby"]["both_active"] and pair_state(later) == "active", standby


@dataclass(frozen=True)
class Role:
    host: str
    gone: Callable[[dict[str, Any]], bool]
    """True in an answer of the broker that shows the partition took effect (the member expired)."""
    resumed: Callable[[dict[str, Any] | None, dict[str, Any]], bool]
    """(the last answer before the link came up, an answer): the role's traffic is counted again."""


ROLES = {
    "actor": Role(
        "actor1",
        lambda s: "actor-1" not in rows(s),
        lambda before, s: messages(s, "actor-1") > messages(before, "actor-1"),
    ),
    "relay": Role(
        "relay",
        lambda s: relay_id(s) is None and "actor-2" not in rows(s),
        lambda before, s: messages(s, "actor-2") > messages(before, "actor-2"),
    ),
    "learner": Role("learner", lambda s: "learner-0" not in rows(s), lambda before, s: version(s) > version(before)),
    "broker": Role(
        "broker",
        lambda s: False,  # nobody hears the broker cut off: broker_was_cut_off checks what it did meanwhile
        lambda before, s: everyone(s) and version(s) > version(before),
    ),
}


def broker_was_cut_off(run: Run, down: float, up: float, relay: str | None) -> None:
    """The monitor heard nothing from the broker in the partition, and the broker's first answer after it lists the
    learner, the actor and the relay as departed in it: so the members of its first answers after it are new
    sessions, and their counts (``everyone``) are traffic after the link came up."""
    heard = [s for s in run.samples.at(PRIMARY, down + 1.0) if s["t"] < up]
    assert not heard, f"the monitor heard the broker through its partition: {heard[0]}"
    first = run.samples.first(PRIMARY, up, lambda s: True, RECOVERY_BOUND_S)
    assert first is not None, run.explain("an answer of the broker after its partition")
    left = {d["member"] for d in first["departures"] if down < d["left"] < up + 1.0}
    assert {"learner-0", "actor-1", relay} <= left, first["departures"]


@pytest.mark.parametrize("roles", [("actor", "relay"), ("learner",), ("broker",)], ids="+".join)
def test_a_partition_heals_with_no_process_restarted(run: Run, roles: tuple[str, ...]) -> None:
    """The roles' links go down together for PARTITION_S (an actor and a relay are on separate paths: cutting
    both at once measures each), then up; each role's traffic comes back within RECOVERY_BOUND_S. The passive
    standby sends back whoever tries it meanwhile. The broker's own partition is a failover instead: the standby
    takes over, the clients follow it, and the primary, back, finds it active with the run and turns passive."""
    assert run.samples.first(PRIMARY, 0.0, everyone, 60) is not None, run.explain("everyone at the broker")
    down = time.monotonic()
    for role in roles:
        run.net.cut(ROLES[role].host)
    try:
        for role in roles:
            if role == "broker":
                continue
            gone = run.samples.first(PRIMARY, down, ROLES[role].gone, PARTITION_S)
            assert gone is not None, run.explain(f"the {role} cut off to leave the broker's members")
        time.sleep(max(0.0, down + PARTITION_S - time.monotonic()))  # the partition's length, not a wait
    finally:
        up = time.monotonic()
        for role in roles:
            run.net.heal(ROLES[role].host)
    before = run.samples.last(PRIMARY, up)
    assert before is not None
    if "broker" in roles:
        broker_was_cut_off(run, down, up, relay_id(before))
        broker_partition_was_a_failover(run, down, up, before)
        return
    for role in roles:
        back = run.samples.first(PRIMARY, up, partial(ROLES[role].resumed, before), RECOVERY_BOUND_S)
        assert back is not None, run.explain(f"the {role}'s traffic within {RECOVERY_BOUND_S} s of the link up")
        run.record(f"partition_{role}", {"cut_s": round(up - down, 2), "recovery_s": round(back["t"] - up, 2)})
    settled = run.samples.first(PRIMARY, up, everyone, RECOVERY_BOUND_S)
    assert settled is not None, run.explain("everyone back at the broker")
    check_same_processes(run, settled)
    run.record(f"accounting_checked_after_{'+'.join(roles)}", check_accounting(run, PRIMARY))
    standby = run.samples.last(STANDBY, time.monotonic())
    assert standby is not None and pair_state(standby) == "passive" and rows(standby) == {}, standby


def broker_partition_was_a_failover(run: Run, down: float, up: float, before: dict[str, Any]) -> None:
    """In the primary's partition the standby took over and the run went on through it; after it the primary, which
    holds nobody, turned passive (the run stays on one broker) and the standby kept every client."""
    moved = run.samples.first(STANDBY, down, lambda s: everyone(s) and version(s) > version(before), PARTITION_S)
    assert moved is not None and moved["t"] < up, run.explain("the run on the standby within the partition")
    run.record(
        "partition_broker", {"cut_s": round(up - down, 2), "failover_to_training_s": round(moved["t"] - down, 2)}
    )
    yielded = run.samples.first(PRIMARY, up, lambda s: pair_state(s) == "passive", RECOVERY_BOUND_S)
    assert yielded is not None, run.explain("the primary passive after its partition")
    run.record("primary_passive_after_heal_s", round(yielded["t"] - up, 2))
    later = run.samples.first(STANDBY, yielded["t"] + 2.0, lambda s: True, 30)  # what holds some time after it
    assert later is not None and everyone(later) and pair_state(later) == "active", later
    assert not later["broker"]["standby"]["both_active"], later
    primary = run.samples.last(PRIMARY, time.monotonic())
    assert primary is not None and pair_state(primary) == "passive" and rows(primary) == {}, primary
    check_same_processes(run, later)
    run.record("accounting_checked_after_broker", check_accounting(run, PRIMARY) + check_accounting(run, STANDBY))


def test_clients_move_to_the_other_broker_when_the_active_one_is_killed(run: Run) -> None:
    """Within heartbeat interval x (liveness + 2) + 0.5 s (docs/deploying.md, "A standby broker": the passive one's
    takeover, one interval on the dead broker, a short back-off), as the profile both brokers run with says; then
    training goes on through the other broker. The active one is the standby if the broker's partition moved the
    run there."""
    profile = load_broker_config(run.profile)
    interval, liveness = profile.heartbeat_interval_s, profile.heartbeat_liveness
    bound = interval * (liveness + 2) + 0.5
    now = time.monotonic()
    active = next((at for at in (PRIMARY, STANDBY) if pair_state(run.samples.last(at, now)) == "active"), PRIMARY)
    other = STANDBY if active == PRIMARY else PRIMARY
    host, other_host = ("broker", "standby") if active == PRIMARY else ("standby", "broker")
    settled = run.samples.first(active, time.monotonic(), everyone, 30)
    assert settled is not None, run.explain(f"everyone at the {host}")
    killed = time.monotonic()
    run.net.procs[host].send_signal(signal.SIGKILL)
    moved = {}
    for peer in ("learner-0", "actor-1", "relay"):
        there = run.samples.first(other, killed, partial(joined, peer), bound + 10)
        assert there is not None, run.explain(f"{peer} at the {other_host}")
        moved[peer] = round(there["t"] - killed, 2)
    run.record("failover_s", {**moved, "bound_s": bound, "to": other_host})
    assert max(moved.values()) <= bound + POLL_INTERVAL_S, moved  # the poller sees a join up to a poll after it
    resumed = run.samples.first(other, killed, lambda s: everyone(s) and version(s) > version(settled), 60)
    assert resumed is not None, run.explain(f"training through the {other_host}")
    run.record("failover_to_training_s", round(resumed["t"] - killed, 2))
    check_same_processes(run, resumed, killed=host)
    body = status_cli(run)  # the fallback list: one broker is dead, the other answers
    assert body["broker"]["run_id"] == settled["broker"]["run_id"] and body["broker"]["accounted"]
    assert body["broker"]["standby"]["state"] == "active", body["broker"]["standby"]
    run.record(f"accounting_checked_at_{other_host}", check_accounting(run, other))
    endpoint = run.net.endpoint(other_host)
    for name in ("learner", "actor1"):
        assert f"moving to the broker at {endpoint}" in run.net.log(name, 10**6), name
