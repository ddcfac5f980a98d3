"""The sync learner's view of its actors: who is connected, who is a straggler, how long rollouts are.

The broker tells the learner which actors have joined, and how many envs each steps, in ``fleet``
messages on the learner's own link (``BrokerLink.fleet()``). A sync round waits for every connected
actor that is not a straggler; an actor that missed a round it was waited for is one (its data is dropped
as late) until it reports in time or is less than one version late again. The per-env rollout length of
the next round is ``ceil(batch_size / envs of the actors in the quota)``, so that one rollout from each
makes one batch and the batch stays fixed when actors join or leave.

The env count in a hello is the client's own claim, so the sizing trusts it only as far as the run does: an actor
counts with the env columns its newest accepted rollout was worth (its steps over the length its version asked:
``N`` for an honest one, less for one that sends short rollouts; never more than its claim), and before its
first, with its claim capped at the run's ``env.num_envs``. One claiming 1,048,576 envs therefore counts as one
ordinary actor until it sends, then as what it sends; refused rollouts (never accepted) never make it count more,
and the length is never more than ``batch_size``.

Straggler events are logged aggregated, once per ``STRAGGLER_LOG_EVERY_S``: on a busy host an actor
can miss every other round, and one line per event buries everything else in the log.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

STRAGGLER_LOG_EVERY_S = 10.0
LENGTHS_KEPT = 16
"""Published versions whose asked length is kept, to weigh what actors deliver for them (as ``admit.LENGTHS_KEPT``)."""


class FleetPlan:
    """``refresh(snapshot)`` with each new fleet message; ``publish(version)`` with each version; ``expected()`` and
    ``delivered(...)`` during a round; ``round_closed(...)`` after it; ``back_in_quota(peer_id)`` when a straggler's
    data is less than one version late."""

    def __init__(
        self, default_envs: int, batch_size: int, rollout_len: int, log: Any, sizes_rollouts: bool = True
    ) -> None:
        self.default_envs = default_envs
        self.batch_size = batch_size
        self.rollout_len = rollout_len
        """Per-env steps of the next round's rollouts (published with the parameters)."""
        self.sizes_rollouts = sizes_rollouts
        """The sync schedule sizes rollouts from the fleet; the async one keeps ``env.rollout_len``."""
        self.actors: dict[str, int] = {}
        """Connected actors and their env counts, as the broker last reported them (their own claims)."""
        self.worth: dict[str, float] = {}
        """Connected actors' env columns as their newest accepted rollout showed them (``delivered``)."""
        self.asked: dict[int, int] = {}
        """The per-env rollout length each of the newest LENGTHS_KEPT published versions asked."""
        self.seq = -1
        """The sequence number of the fleet message ``actors`` comes from (-1: none yet)."""
        self.hosts: set[str] = set()
        """Every host an actor of this run was seen on (for meta.json)."""
        self.stragglers: set[str] = set()
        self._snapshot_actors: dict[str, dict] | None = None
        self._log = log
        self._missed: Counter[str] = Counter()
        self._returned: Counter[str] = Counter()
        self._timeouts = 0
        self._next_log = 0.0  # the first event is logged at once, later ones per interval

    def refresh(self, snapshot: tuple[int, dict[str, dict]] | None) -> bool:
        """Take the newest fleet message's ``(seq, actors)``; True when it differs from what we had (a new seq,
        or the same seq with other actors: a restarted broker counts again from the start)."""
        if snapshot is None:
            return False
        seq, actors = snapshot
        if seq == self.seq and (actors is self._snapshot_actors or actors == self._snapshot_actors):
            return False
        self.seq, self._snapshot_actors = seq, actors
        self.actors = {peer: int(a.get("num_envs") or self.default_envs) for peer, a in actors.items()}
        self.hosts.update(str(a["host"]) for a in actors.values() if a.get("host"))
        self.stragglers &= self.actors.keys()
        self.worth = {peer: n for peer, n in self.worth.items() if peer in self.actors}
        self._size_rollouts()
        return True

    def publish(self, version: int) -> int:
        """The per-env rollout length ``version`` asks for (``rollout_len``), kept to weigh what actors deliver."""
        self.asked.pop(version, None)
        self.asked[version] = self.rollout_len
        while len(self.asked) > LENGTHS_KEPT:
            del self.asked[next(iter(self.asked))]
        return self.rollout_len

    def delivered(self, peer_id: str, policy_version: int, env_steps: int) -> None:
        """A rollout the run accepted (in time or not): ``env_steps`` steps acting with ``policy_version``. What
        the actor counts with from now on is the env columns it was worth at that version's length (at most its
        claim); takes effect at the next sizing (a fleet change or a round's close)."""
        asked, claim = self.asked.get(policy_version), self.actors.get(peer_id)
        if asked and claim:
            self.worth[peer_id] = min(env_steps / asked, float(claim))

    def expected(self) -> set[str]:
        """The actors a round waits for."""
        return self.actors.keys() - self.stragglers

    def round_closed(self, expected: set[str], reported: set[str], by_timeout: bool) -> None:
        """Actors the round waited for (``expected``) that did not report become stragglers; stragglers that
        reported in time, or came back within one version (``back_in_quota``), are not any more.
        ``by_timeout``: the round was closed by the straggler rule."""
        missed = expected - reported
        self.stragglers = ((self.stragglers - reported) | missed) & self.actors.keys()
        self._missed.update(missed)
        self._timeouts += by_timeout
        self._size_rollouts()
        self._maybe_log()

    def back_in_quota(self, peer_id: str) -> None:
        if peer_id in self.stragglers:
            self.stragglers.discard(peer_id)
            self._returned[peer_id] += 1

    def envs(self) -> float:
        """The env columns of the actors in the quota, as the run trusts them (the module docstring)."""
        return sum(
            self.worth.get(peer, min(claim, self.default_envs))
            for peer, claim in self.actors.items()
            if peer not in self.stragglers
        )

    def _size_rollouts(self) -> None:
        envs = self.envs()
        if envs and self.sizes_rollouts:
            self.rollout_len = max(1, min(self.batch_size, math.ceil(self.batch_size / envs)))

    def _maybe_log(self, final: bool = False) -> None:
        """One line for the stragglers seen since the last one, at most once per STRAGGLER_LOG_EVERY_S (the first
        at once); ``final``: whatever is left, at the end of the run."""
        now = time.monotonic()
        if not (self._missed or self._timeouts or self._returned) or (now < self._next_log and not final):
            return
        self._next_log = now + STRAGGLER_LOG_EVERY_S
        missed = ", ".join(f"{peer} x{n}" for peer, n in sorted(self._missed.items())) or "none"
        self._log.warning(
            f"stragglers since the last such line (rounds missed; their data is dropped as late "
            f"until they keep up): {missed}; {self._timeouts} round(s) closed by the straggler "
            f"timeout, {sum(self._returned.values())} return(s) to the quota"
        )
        self._missed.clear()
        self._returned.clear()
        self._timeouts = 0

    def flush_log(self) -> None:
        self._maybe_log(final=True)
