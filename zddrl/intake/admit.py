"""The first check a learner shard makes of a received trajectory: the numbers of its header and the shapes of its
arrays (both known without reading a single array element), before anything costs time or memory.

A trajectory the protocol accepts may still be far bigger than its sender's share of the work: the broker's
message limit (256 MiB by default) lets one CartPole rollout hold millions of steps, and one of 262k steps
(9.5 MiB) used to cost the learner 7 s and 640 MB in GAE and batch building. So a rollout may hold at most
``ROLLOUT_SLACK`` times what its sender was asked for:

* at most ``ROLLOUT_SLACK x L`` steps per env, where ``L`` is the longest per-env rollout length the run asked for
  in its last ``LENGTHS_KEPT`` versions (sync mode sizes it from the fleet and publishes it with each version; the
  the async schedule asks ``env.rollout_len``);
* at most ``ROLLOUT_SLACK x L x E`` steps in all, where ``E`` is the sender's env count as the broker's fleet
  message announces it (the run's ``env.num_envs`` when it says 0; an actor the fleet does not list yet gets the
  most envs of any listed actor, or ``env.num_envs`` if that is more), **bounded by the run**: a hello's
  ``num_envs`` is the client's own claim, so ``E`` is at most ``envs_bound(config)`` (``train.max_actor_envs``;
  0: ``16 x env.num_envs``; never fewer than ``env.num_envs``). One claiming 1,048,576 envs gets no more room.

``L`` is the run's own: the sync schedule sizes it from the env steps actors actually delivered, never from what
they claim (``fleet.FleetPlan``).

Every shard checks its own share of the stream: the main shard knows ``L`` first and sends it to the others in
every poll's exchange (``ShardPoller.asked_len``); every shard reads the fleet message on its own link.

And a trajectory must name a version the run has published (``0 <= policy_version <= current``): its version is
used for staleness, lag and the parameter-hash check, and no honest actor acts with a version from the future.

What fails here is refused like any trajectory the run cannot train on: dropped, counted for its actor
(``dropped_invalid``), logged with this reason, never read further.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

from zddrl.config import Config

ROLLOUT_SLACK = 2
"""How many times the steps it was asked for a rollout may hold. 1 would do for zddrl's actors, which sample
exactly what a version asks; 2 leaves room for a client that rounds up, while a rollout 1000 times too big is
refused before it is read."""
ENVS_FACTOR = 16
"""``train.max_actor_envs = 0`` bounds an actor's claimed envs at this many times ``env.num_envs``."""
LENGTHS_KEPT = 16
"""Published versions whose asked rollout length still bounds a rollout: a straggler's rollout of a version
asked longer ones is dropped as late or stale, not refused as too big."""


class AskedLengths:
    """``asked(length)`` once per update with the per-env rollout length the newest version asks; ``most()`` the
    longest of the last LENGTHS_KEPT."""

    def __init__(self, first: int) -> None:
        self.recent: deque[int] = deque([first], maxlen=LENGTHS_KEPT)

    def asked(self, length: int) -> None:
        self.recent.append(length)

    def most(self) -> int:
        return max(self.recent)


def envs_bound(config: Config) -> int:
    """The most envs the learner counts one actor with, whatever it claims (``train.max_actor_envs``)."""
    env = config.env.num_envs
    return max(config.train.max_actor_envs or ENVS_FACTOR * env, env)


def envs_of(peer_id: str, fleet: tuple[int, Mapping[str, Any]] | None, default_envs: int, most: int) -> int:
    """The env count the broker's newest ``fleet`` message announces for ``peer_id``, at most ``most``
    (``envs_bound``; see the module docstring)."""
    actors = fleet[1] if fleet is not None else {}
    listed = actors.get(peer_id)
    if listed is not None:
        return min(int(listed.get("num_envs") or default_envs), most)
    return min(max([default_envs, *(int(a.get("num_envs") or default_envs) for a in actors.values())]), most)


def refusal(shape: tuple[int, ...], policy_version: int, version: int, asked_len: int, envs: int) -> str:
    """Why a trajectory of arrays ``[T, N]`` (``shape``), acting with ``policy_version``, is not admitted to a run at
    ``version`` that asked for ``asked_len`` steps per env of ``envs`` envs; "" when it is."""
    if not 0 <= policy_version <= version:
        return f"policy version {policy_version}, not one of the published 0..{version}"
    T, N = shape[:2]
    if T > ROLLOUT_SLACK * asked_len:
        return f"a rollout of {T} steps per env, over {ROLLOUT_SLACK} x the {asked_len} the run asked for"
    if T * N > ROLLOUT_SLACK * asked_len * envs:
        return (
            f"a rollout of {T} x {N} env steps, over {ROLLOUT_SLACK} x the {asked_len} x {envs} the run asked "
            f"of this actor"
        )
    return ""
