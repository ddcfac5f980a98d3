"""The standby pair: whether a broker that names another as ``broker.peer`` takes clients now (active) or sends
them to its peer (passive), and the probe of the peer's control port that decides it (the zguide's Binary Star).

Rules (docs/deploying.md, "A standby broker"; docs/protocol.md section 5.2):

* a backup starts passive; a primary starts "starting" (it refuses hellos like a passive broker): it becomes passive
  when its peer answers as active, so a primary restarted after a failover does not take clients back and split the
  run, and active at once when its peer answers as passive or starting;
* a broker that does not take clients becomes active when its peer answers as passive or starting, the primary at
  once and a backup after its peer has said so for heartbeat interval x liveness (two backups end up one active);
* it also becomes active when its peer has been silent for interval x liveness (counted from its own start when the
  peer never answered) and a client asked it within that time (the zguide's voter: a broker no client asks for has
  no reason to take over). A refused probe (the peer rate-limits status) is an answer: the peer lives, its last
  known state stands;
* an active broker stays active, with one exception that ends a split instead of starting one: an active broker
  that holds no members and finds its peer active with members (or, both without, is the backup) becomes passive.
  That happens after a partition that cut the primary from everyone heals: the backup took the clients over, and
  the primary, back and empty, would otherwise take every new or restarted client whose list names it first. Two
  active brokers that both hold members each log a warning once per interval and say so in their status
  (``both_active``): an operator stops one (its clients move to the other). A peer of the same role is a
  misconfiguration: an error once per interval, and ``same_role`` in the status.

The probe is a status request (``transport.status.ask_status``, a monitor's) once per heartbeat interval from a thread
with a ZeroMQ context of its own, so the broker's loop never waits on the peer. The thread only records what the
peer said (``observe``); the state changes on the broker's loop (``tick`` and ``admits``), between two hellos, so a
broker never steps down while it admits a client. On a closed bus the probe is a CURVE client with the monitor key
of the broker's key directory (``KEYS/monitor/``).
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


def peer_role(body: dict[str, Any] | None) -> str:
    """The role a status body says its broker has in its pair ("" when it does not say)."""
    broker = body.get("broker") if body is not None else None
    pair = broker.get("standby") if isinstance(broker, dict) else None
    role = pair.get("role") if isinstance(pair, dict) else None
    return role if role in ("primary", "backup") else ""


class Standby:
    """One broker's side of a standby pair. The probe thread records the peer's answers (``observe``); the broker's
    loop applies the rules (``tick`` once per heartbeat interval, ``admits`` on each hello), so a state change never
    falls between a hello's check and its admission. Tests may call all three directly with made-up answers.

    Usage::

        standby = Standby(config, credentials).start()
        ...
        if not standby.admits(now): refuse the hello with standby.refusal()
        ...
        standby.tick(now)  # in the broker's tick
        ...
        standby.close()
    """

    def __init__(
        self, config: BrokerConfig, credentials: keys.Credentials | None = None, members: Callable[[], int] = int
    ) -> None:
        self.peer, self.role = config.peer, config.peer_role
        self.members = members
        """How many members this broker holds now (read on the broker's loop)."""
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
        self.peer_role = ""
        """The role the peer's last answer gave ("" before any, or from a broker that does not say)."""
        self.peer_seen: float | None = None
        """When the peer last answered, a refusal included (monotonic); None if it never did."""
        self.peer_passive_since: float | None = None
        """Since when the peer's answers say it does not take clients (passive or starting); None while it does."""
        self.knocked: float | None = None
        """When a client last asked this broker while it did not take clients (monotonic): the voter rule."""
        self.probes = self.answers = self.refusals = 0
        self.log = logger.bind(role="broker")
        self._ratelog = RateLimitedLog()
        self._warned_at = self._misconfigured_at = -1e9
        self._lock = threading.Lock()
        self._probe_failed = False
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
        """The reason of the reject a client gets while this broker does not take clients."""
        why = "starting: asking its peer which broker is active" if self.state == STARTING else "its peer is active"
        return f"{P.PASSIVE_PREFIX}this broker is the passive one of a standby pair ({why}); use {self.peer}"

    def admits(self, now: float | None = None) -> bool:
        """Whether a client's hello may join now (called on the broker's loop): a hello to a broker that does not
        take clients is a knock (the voter rule), and takes it over at once if its peer has been silent long
        enough."""
        if self.state != ACTIVE:
            now = time.monotonic() if now is None else now
            self.knocked = now
            self.tick(now)
        return self.active

    def both_active(self, now: float) -> bool:
        """Both brokers take clients (they could not see each other): the run may be split between them."""
        return self.state == ACTIVE and self.peer_said == ACTIVE and self._recent(self.peer_seen, now)

    def observe(self, body: dict[str, Any] | None, now: float, *, refused: bool = False) -> None:
        """Record one probe's outcome (called from the probe thread): the peer's status body, or None when it did
        not answer in time, or ``refused`` when it answered with a reject (it lives; its last known state
        stands)."""
        said = peer_state(body)
        with self._lock:
            if said is not None:
                passive = said in (PASSIVE, STARTING)
                if not passive:
                    self.peer_passive_since = None
                elif self.peer_passive_since is None or not self._recent(self.peer_seen, now):
                    self.peer_passive_since = now
                self.peer_said, self.peer_members, self.peer_role = said, peer_members(body), peer_role(body)
                self.answers += 1
            elif refused:
                self.refusals += 1
            if said is not None or refused:
                self.peer_seen = now

    def tick(self, now: float) -> None:
        """Apply the rules to what the peer said last (called on the broker's loop)."""
        with self._lock:
            seen, said, passive_since = self.peer_seen, self.peer_said, self.peer_passive_since
        if self._probe_failed:
            if self.state != ACTIVE:
                self._become(ACTIVE, now, "the peer probe failed: this broker takes clients from now on")
        elif self.state != ACTIVE:
            self._decide(seen, said, passive_since, now)
        elif said == ACTIVE and self._recent(seen, now) and self.members() == 0:
            if self.peer_members > 0 or self.role == "backup":
                held = f"holds {self.peer_members} members" if self.peer_members else "holds none either"
                self._become(
                    PASSIVE, now, f"its peer {self.peer} is active too and {held}: this one holds none, passive"
                )
        self._warn(now)

    def _decide(self, seen: float | None, said: str, passive_since: float | None, now: float) -> None:
        """The rules of a broker that does not take clients (passive or starting)."""
        if self._recent(seen, now):
            if said == ACTIVE and self.state == STARTING:
                self._become(PASSIVE, now, f"its peer {self.peer} is active: this primary stays passive")
            elif said in (PASSIVE, STARTING) and passive_since is not None:
                if self.role == "primary" or now - passive_since >= self.silence_s:
                    self._become(ACTIVE, now, f"its peer {self.peer} is {said} too: this {self.role} is active")
            return
        silent_s = now - (seen if seen is not None else self.started)
        if silent_s >= self.silence_s and self._recent(self.knocked, now):
            self._become(
                ACTIVE, now, f"its peer {self.peer} silent for {silent_s:.1f} s and a client asked: taking over, active"
            )

    def _recent(self, at: float | None, now: float) -> bool:
        """Within the last silence period."""
        return at is not None and now - at < self.silence_s

    def _warn(self, now: float) -> None:
        if self.both_active(now) and now - self._warned_at >= self.interval_s:
            self._warned_at = now
            self.log.warning(
                f"both brokers of the standby pair are active (this {self.role} and its peer {self.peer}): the "
                "run may be split between them; stop one of them (its clients move to the other)"
            )
        if self.peer_role == self.role and now - self._misconfigured_at >= self.interval_s:
            self._misconfigured_at = now
            self.log.error(
                f"both brokers of the standby pair are configured {self.role} (this one and its peer {self.peer}): "
                "set broker.peer_role to primary on one and backup on the other"
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
            "peer_role": self.peer_role,
            "peer_members": self.peer_members,
            "peer_answered_s_ago": None if self.peer_seen is None else round(now - self.peer_seen, 3),
            "both_active": self.both_active(now),
            "same_role": self.peer_role == self.role,
            "probes": self.probes,
            "answers": self.answers,
            "refusals": self.refusals,
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
                self.observe(answer.body, time.monotonic(), refused=answer.refused)
                self._stop.wait(max(0.0, began + self.interval_s - time.monotonic()))
        except Exception:  # noqa: BLE001 - a dead probe would leave a passive broker passive for good
            self.log.exception("standby: the peer probe failed; this broker takes clients from now on")
            self._probe_failed = True
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
