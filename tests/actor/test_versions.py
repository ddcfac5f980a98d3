"""The actor's version state machine (actor/versions.py) by its transitions, without sockets or envs: which version
it acts with, which it refuses once and for all, when a sync actor waits, and the resample after a re-welcome."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from zddrl import protocol as P
from zddrl.actor.versions import Phase, Verdict, VersionState


def version(v: int) -> P.Parameters:
    return P.Parameters(
        run_id="r", peer_id="learner-0", policy_version=v, param_hash="", layout=[], arrays={"flat": np.zeros(2)}
    )


class Judge:
    """Usable unless its version is in ``bad``; counts what it was asked."""

    def __init__(self, *bad: int) -> None:
        self.bad, self.asked = set(bad), []

    def __call__(self, params: P.Parameters) -> tuple[Any, str]:
        self.asked.append(params.policy_version)
        return (None, "bad") if params.policy_version in self.bad else (f"policy-{params.policy_version}", "")


@pytest.mark.parametrize("sync", [True, False])
def test_no_policy_until_a_usable_version_then_ready(sync: bool) -> None:
    s, judge = VersionState(sync), Judge(0)
    assert s.phase is Phase.NO_POLICY and s.acting is None and s.judged == -1
    assert s.offer(version(0), judge) is Verdict.REFUSED and s.phase is Phase.NO_POLICY and s.why == "bad"
    assert s.judged == 0, "a refused version counts as judged: the next asked for is newer"
    assert s.offer(version(1), judge) is Verdict.USED and s.phase is Phase.READY
    acting = s.acting
    assert acting is not None and acting[0].policy_version == 1 and acting[1] == "policy-1"


def test_a_version_is_judged_once() -> None:
    s, judge = VersionState(sync=False), Judge(2)
    s.offer(version(1), judge)
    assert s.offer(version(1), judge) is Verdict.HELD and s.offer(version(0), judge) is Verdict.HELD
    assert s.offer(version(2), judge) is Verdict.REFUSED and s.offer(version(2), judge) is Verdict.HELD
    assert judge.asked == [1, 2]


def test_a_refused_newer_version_leaves_async_acting_and_sync_behind() -> None:
    for sync, phase in [(False, Phase.READY), (True, Phase.BEHIND)]:
        s, judge = VersionState(sync), Judge(2)
        s.offer(version(1), judge)
        s.offer(version(2), judge)
        assert s.phase is phase, sync
        assert (s.acting is None) == sync, "sync samples only with the newest version"
        assert s.offer(version(3), judge) is Verdict.USED and s.phase is Phase.READY and s.judged == 3


def test_relinked_resamples_the_held_version_once() -> None:
    s, judge = VersionState(sync=True), Judge()
    s.relinked()
    assert s.wanted() is None, "nothing held: look for a version"
    s.offer(version(4), judge)
    s.relinked()
    held = s.wanted()
    assert held is not None and held.policy_version == 4 and s.wanted() is None, "once"
    assert s.offer(held, judge) is Verdict.HELD and s.acting is not None, "acted with, not judged again"
    assert judge.asked == [4]
