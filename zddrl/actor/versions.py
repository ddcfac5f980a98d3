"""Which policy version an actor acts with in one run: a small state machine, apart from sockets and envs.

States (``VersionState.phase``)::

    NO_POLICY  no usable version yet: wait for one
    READY      act with ``params`` and ``policy``
    BEHIND     sync only: a version newer than the one held was refused; a sync run samples only with the newest
               version, so the actor waits for the next one instead of acting with an older one

Transitions::

    offer(version, judge)  a version newer than every one judged (used or refused) is judged once:
                           usable -> USED (it is held: READY); not -> REFUSED (never judged again; the held
                           one, if any, stays: READY under async, BEHIND under sync)
                           a version not newer -> HELD (nothing changes)
    relinked()             the link was welcomed anew: a restarted broker may have lost the last rollout, which a
                           sync learner waits for, so the next rollout is sampled with the version held
                           (``resample`` -> ``wanted`` returns it once) instead of waiting for a newer one
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from zddrl import protocol as P
from zddrl.algos.policy import Policy


class Phase(Enum):
    NO_POLICY = "no_policy"
    READY = "ready"
    BEHIND = "behind"


class Verdict(Enum):
    USED = "used"
    REFUSED = "refused"
    HELD = "held"


Judge = Callable[[P.Parameters], tuple[Policy | None, str]]
"""A version -> (its policy, "") or (None, why it cannot be used here)."""


class VersionState:
    """The version an actor acts with in one run (module docstring: states and transitions). ``sync``: the run's
    schedule is sync."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.params: P.Parameters | None = None
        """The version acted with (None: none usable yet)."""
        self.policy: Policy | None = None
        """Its policy."""
        self.refused = -1
        """The newest version judged unusable (-1: none)."""
        self.resample = False
        """Relinked: the next rollout is sampled with the version held."""
        self.why = ""
        """Why the last refused version was refused."""

    @property
    def judged(self) -> int:
        """The newest version judged, used or refused (-1: none): only newer ones are judged."""
        return max(self.refused, self.params.policy_version if self.params is not None else -1)

    @property
    def phase(self) -> Phase:
        if self.params is None:
            return Phase.NO_POLICY
        if self.sync and self.refused > self.params.policy_version:
            return Phase.BEHIND
        return Phase.READY

    @property
    def acting(self) -> tuple[P.Parameters, Policy] | None:
        """(version, policy) to sample with when READY, else None (wait)."""
        if self.phase is not Phase.READY or self.params is None or self.policy is None:
            return None
        return self.params, self.policy

    def relinked(self) -> None:
        """The link was welcomed anew: sample once more with the version held, if any."""
        self.resample = self.params is not None

    def wanted(self) -> P.Parameters | None:
        """The held version once after ``relinked`` (resample it), else None (look for a newer one)."""
        if not self.resample:
            return None
        self.resample = False
        return self.params

    def offer(self, version: P.Parameters, judge: Judge) -> Verdict:
        """Judge ``version`` if it is newer than every one judged (module docstring)."""
        if version.policy_version <= self.judged:
            return Verdict.HELD
        policy, why = judge(version)
        if policy is None:
            self.refused, self.why = max(self.refused, version.policy_version), why
            return Verdict.REFUSED
        self.params, self.policy = version, policy
        return Verdict.USED
