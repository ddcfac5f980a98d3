"""The standby pair: whether a broker that names another as ``broker.peer`` takes clients now (active) or sends
them to its peer (passive), and the probe of the peer's control port that decides it (the zguide's Binary Star).

Rules (docs/deploying.md, "A standby broker"; docs/protocol.md section 5.2):

* a backup starts passive; a primary starts "starting" (it refuses hellos like a passive broker) until its first
  probe: active unless the peer answers as active, so a primary restarted after a failover does not take clients
  back and split the run;
* a passive broker becomes active once its peer has been silent for heartbeat interval x liveness (counted from its
  own start when the peer never answered);
* an active broker stays active, with one exception that ends a split instead of starting one: an active broker
  that holds no members and finds its peer active with members (or, both without, is the backup) becomes passive.
  That happens after a partition that cut the primary from everyone heals: the backup took the clients over, and
  the primary, back and empty, would otherwise take every new or restarted client whose list names it first. Two
  active brokers that both hold members each log a warning once per interval and say so in their status
  (``both_active``): an operator stops one (its clients move to the other).

The probe is a status request (``transport.status.ask_status``, a monitor's) once per heartbeat interval from a thread
with a ZeroMQ context of its own, so the broker's loop never waits on the peer; it only reads ``state``. On a closed
bus the probe is a CURVE client with the monitor key of the broker's key directory (``KEYS/monitor/``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from loguru import logger

from zddrl import keys
from zddrl import protocol as P
from zddrl.brokerconf import BrokerConfig
from zddrl.logs import RateLimitedLog
from zddrl.tomlconf import ConfigError

ACTIVE, PASSIVE, STARTING = "active", "passive", "starting"
STATES = (ACTIVE, PASSIVE, STARTING)


def peer_members(body: dict[str, Any] | None) -> int:
    """How many members a status body says its broker holds (0 when it does not say)."""
    broker = body.get("broker") if body is not None else None
    total = broker.get("members_total") if isinstance(broker, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) else 0


def peer_state(body: dict[str, Any] | None) -> str | None:
    """The state a status body says its broker is in (None: no answer). A broker without a peer takes clients: it
    counts as active; a body that says something else than a known state counts as active too (it may take them)."""
    if body is None:
        return None
    broker = body.get("broker")
    pair = broker.get("standby") if isinstance(broker, dict) else None
    state = pair.get("state") if isinstance(pair, dict) else None
    return state if state in STATES else ACTIVE


class Standby:
    """One broker's side of a standby pair. ``observe(body, now)`` is the state machine (the probe thread feeds it;
    tests may call it directly); ``active`` is what the broker's loop reads before it takes a hello.

    Usage::

        standby = Standby(config, credentials).start()
        ...
        if not standby.active: refuse the hello with standby.refusal()
        ...
        standby.close()
    """

    def __init__(
        self, config: BrokerConfig, credentials: keys.Credentials | None = None, members: Callable[[], int] = int
    ) -> None:
        self.peer, self.role = config.peer, config.peer_role
        self.members = members
        """How many members this broker holds now (read from the probe thread: a len(), never an iteration)."""
        self.interval_s = config.heartbeat_interval_s
        self.silence_s = config.heartbeat_interval_s * config.heartbeat_liveness
        """The peer counts as gone after this long without an answer."""
        self.credentials = credentials
        self.started = time.monotonic()
        self.state = STARTING if self.role == "primary" else PASSIVE
        self.since = self.started
        """When ``state`` began."""
        self.peer_said = ""
        """The state the peer's last answer gave ("" before any)."""
        self.peer_members = 0
        """The members the peer's last answer counted."""
        self.peer_seen: float | None = None
        """When the peer last answered (monotonic); None if it never did."""
        self.probes = self.answers = 0
        self.log = logger.bind(role="broker")
        self._ratelog = RateLimitedLog()
        self._warned_at = -1e9
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="standby-probe", daemon=True)

    @property
    def active(self) -> bool:
        return self.state == ACTIVE

    def start(self) -> Standby:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 2.0)

    def refusal(self) -> str:
        """The reason of the reject a hello gets while this broker does not take clients."""
        why = "starting: asking its peer which broker is active" if self.state == STARTING else "its peer is active"
        return f"{P.PASSIVE_PREFIX}this broker is the passive one of a standby pair ({why}); use {self.peer}"

    def both_active(self, now: float) -> bool:
        """Both brokers take clients (they could not see each other): the run may be split between them."""
        recent = self.peer_seen is not None and now - self.peer_seen <= self.silence_s
        return self.state == ACTIVE and self.peer_said == ACTIVE and recent

    def observe(self, body: dict[str, Any] | None, now: float) -> None:
        """One probe's outcome: the peer's status body, or None when it did not answer in time."""
        said = peer_state(body)
        if said is not None:
            self.peer_seen, self.peer_said, self.peer_members = now, said, peer_members(body)
            self.answers += 1
        if self.state == STARTING:
            if said == ACTIVE:
                self._become(PASSIVE, now, f"its peer {self.peer} is active: this primary stays passive")
            else:
                why = "does not answer" if said is None else f"is {said}"
                self._become(ACTIVE, now, f"its peer {self.peer} {why}: this primary is active")
        elif self.state == PASSIVE:
            silent_s = now - (self.peer_seen if self.peer_seen is not None else self.started)
            if silent_s >= self.silence_s:
                self._become(ACTIVE, now, f"its peer {self.peer} silent for {silent_s:.1f} s: taking over, active")
        elif said == ACTIVE and self.members() == 0 and (self.peer_members > 0 or self.role == "backup"):
            held = f"holds {self.peer_members} members" if self.peer_members else "holds none either"
            self._become(PASSIVE, now, f"its peer {self.peer} is active too and {held}: this one holds none, passive")
        if self.both_active(now) and now - self._warned_at >= self.interval_s:
            self._warned_at = now
            self.log.warning(
                f"both brokers of the standby pair are active (this {self.role} and its peer {self.peer}): the "
                "run may be split between them; stop one of them (its clients move to the other)"
            )

    def _become(self, state: str, now: float, why: str) -> None:
        self.state, self.since = state, now
        level = "WARNING" if state == ACTIVE and self.role == "backup" else "INFO"  # a failover is news
        self.log.log(level, f"standby {self.role}: {why}")

    def status(self, now: float | None = None) -> dict[str, Any]:
        """The ``standby`` map of the status body (docs/protocol.md section 9)."""
        now = time.monotonic() if now is None else now
        return {
            "role": self.role,
            "state": self.state,
            "state_s": round(now - self.since, 3),
            "peer": self.peer,
            "peer_state": self.peer_said,
            "peer_members": self.peer_members,
            "peer_answered_s_ago": None if self.peer_seen is None else round(now - self.peer_seen, 3),
            "both_active": self.both_active(now),
            "probes": self.probes,
            "answers": self.answers,
        }

    # ---------------------------------------------------------------- probe thread
    def _run(self) -> None:
        from zddrl.transport.status import ask_status  # imported here, off the broker's import

        ctx = zmq.Context()
        try:
            while not self._stop.is_set():
                began = time.monotonic()
                answer = ask_status(self.peer, self.interval_s, ctx, self.credentials)
                self.probes += 1
                if answer.body is None and answer.why:
                    self._ratelog.warning("peer_probe", f"standby: no status from the peer {self.peer}: {answer.why}")
                    self._ratelog.flush()
                self.observe(answer.body, time.monotonic())
                self._stop.wait(max(0.0, began + self.interval_s - time.monotonic()))
        except Exception:  # noqa: BLE001 - a dead probe would leave a passive broker passive for good
            self.log.exception("standby: the peer probe failed; this broker takes clients from now on")
            self.state = ACTIVE
        finally:
            ctx.destroy(linger=0)


def standby_of(config: BrokerConfig, members: Callable[[], int] = int) -> Standby | None:
    """The standby side of a broker whose config names a peer (None without one), its probe started. On a closed bus the
    probe needs the monitor key of the broker's key directory: ConfigError if it is missing."""
    if not config.peer:
        return None
    credentials = None
    if config.keys:
        try:
            credentials = keys.credentials(config.keys, "monitor")
        except keys.KeysError as exc:
            raise ConfigError(
                f"broker.peer on a closed bus: the peer probe asks for status with a monitor key in --keys "
                f"(zddrl keys new monitor NAME): {exc}"
            ) from None
    return Standby(config, credentials, members).start()
