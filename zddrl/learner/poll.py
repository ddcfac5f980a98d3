"""One shard's data socket, polled in step with the other shards.

``ShardPoller.poll`` takes at most one trajectory of this run off the shard's data channel (returning its
credit), checks that the run can train on it, and then exchanges a record of what it got with every
other shard (``intake/records.py``). Every shard calls it the same number of times, so a round or batch ends at
the same poll everywhere; decisions that depend on time (the straggler timeout, run limits) come from
the main shard as ``control`` in that same exchange.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from zddrl import protocol as P
from zddrl.intake.records import Record, in_order, record_of, records_of
from zddrl.shards.group import ShardGroup
from zddrl.transport.channel import DataChannel
from zddrl.transport.link import BrokerLink

RECV_POLL_MS = 20
SHARDED_POLL_MS = 5
"""Shards exchange what they received after every poll: a short poll keeps a round's end prompt."""


class Polled(NamedTuple):
    records: list[Record]
    """Every shard's usable trajectories of this poll, in (peer_id, seq) order."""
    invalid: list[Record]
    """Every shard's trajectories that the run cannot train on (fresh ones; never in a batch)."""
    received: list[int]
    """Per shard: the usable trajectories it took off its socket in this poll (how the broker spreads the stream)."""
    control: dict[str, Any]
    """The main shard's control (``stop`` also set when any shard was asked to stop)."""


class ShardPoller:
    """``poll(stop, control, use, batch)`` once per step of a round or batch; ``send_params(messages)`` to
    publish (sent again after a re-welcome); ``keep(batch)`` what a stopped run collected. ``check(msg) -> why``
    says why the run cannot use a trajectory ("" when it can); ``open_channel()`` opens a data channel to the
    link's learners port (again when a re-welcome names another). ``admit(msg) -> why`` runs first, on shapes
    and header numbers alone: what it refuses is never read further (``intake/admit.py``). ``asked()`` (main shard) is
    the rollout length that ``admit`` bounds rollouts with; every exchange hands it to the other shards
    (``asked_len``)."""

    def __init__(
        self,
        link: BrokerLink,
        open_channel: Callable[[], DataChannel],
        run_id: str,
        group: ShardGroup,
        check: Callable[[P.Trajectory], str],
        log: Any,
        asked: Callable[[], int] | None = None,
        first_len: int = 0,
        admit: Callable[[P.Trajectory], str] = lambda msg: "",
    ) -> None:
        self.link, self.open_channel, self.run_id = link, open_channel, run_id
        self.group, self.check, self.log, self.admit = group, check, log, admit
        self.asked = asked
        """Main shard: the longest per-env rollout length the run asked for lately (``admit.AskedLengths``)."""
        self.asked_len = asked() if asked is not None else first_len
        """That length, as of the main shard's last exchange (``first_len`` before the first); what ``check``
        bounds rollouts with on every shard."""
        self.poll_ms = SHARDED_POLL_MS if group.sharded else RECV_POLL_MS
        self.channel = open_channel()
        self.pending: list[tuple[P.Trajectory, bool]] = []
        """Trajectories to use first, and whether they are new (not yet counted): taken off a replaced data
        socket (new), or collected before the run was stopped mid-round (counted already)."""
        self.published: list[P.Message] = []
        """The messages of the newest published version (sent again after a re-welcome)."""

    def send_params(self, messages: list[P.Message]) -> None:
        self.published = messages
        for msg in messages:
            self.channel.send(msg)

    def keep(self, batch: list[P.Trajectory]) -> None:
        """What a stopped round or batch collected (counted already): used first if polling goes on."""
        self.pending.extend((t, False) for t in batch)

    def close(self) -> None:
        self.channel.close()

    def poll(
        self,
        stop: threading.Event,
        control: dict[str, Any],
        use: Callable[[P.Trajectory], bool],
        batch: list[P.Trajectory],
    ) -> Polled:
        """One poll, then one exchange. A received trajectory for which ``use(msg)`` is true is appended to
        ``batch`` (this shard's part of the batch being collected)."""
        self._reconnect_if_needed()
        if self.asked is not None:
            self.asked_len = self.asked()
        mine: list[Record] = []
        msg, fresh = self._receive()
        if msg is not None:
            refused = self.admit(msg) if fresh else ""  # kept ones were checked when they came
            why = refused or (self.check(msg) if fresh else "")
            taken = not why and use(msg)
            if taken:
                batch.append(msg)
            mine.append(record_of(msg, fresh, taken, why, readable=fresh and not refused))
        parts = self.group.exchange(
            {
                "records": [list(r) for r in mine],
                "stop": stop.is_set(),
                "control": control if self.group.is_main else None,
                "asked_len": self.asked_len if self.group.is_main else None,
            }
        )
        self.asked_len = int(parts[0]["asked_len"])
        control = dict(parts[0]["control"])
        control["stop"] = control.get("stop", False) or any(p["stop"] for p in parts)
        by_shard = [records_of(p["records"]) for p in parts]
        received = [sum(r.fresh and not r.invalid for r in records) for records in by_shard]
        everything = in_order(by_shard)
        return Polled([r for r in everything if not r.invalid], [r for r in everything if r.invalid], received, control)

    def _receive(self) -> tuple[P.Trajectory | None, bool]:
        """The next trajectory of this run (its credit returned) and whether it is new, or (None, False) after a
        quiet poll. Trajectories kept from earlier come first."""
        if self.pending:
            return self.pending.pop(0)
        msg = self.channel.recv(self.poll_ms)
        if isinstance(msg, P.Trajectory):
            self.channel.ack()  # only trajectories cost credit
        msg = self._take(msg)
        return msg, msg is not None

    def _take(self, msg: P.Message | None) -> P.Trajectory | None:
        """A trajectory of this run; anything else is ignored."""
        if not isinstance(msg, P.Trajectory):
            return None
        if msg.run_id != self.run_id:  # another run's data (a broker serving two runs): never trained on
            self.log.warning(f"ignored a trajectory of run {msg.run_id!r} from {msg.peer_id}")
            return None
        return msg

    def keep_link(self) -> None:
        """After a new welcome, credit and parameters again (what ``poll`` does first; for a caller that does not
        poll this socket: the service placement, whose data goes to the replays)."""
        self._reconnect_if_needed()

    def _reconnect_if_needed(self) -> None:
        """After a new welcome: re-grant credit (the broker restarted at zero) and re-publish the current
        parameters (a restarted broker has none). The data socket is kept while the learners port is the
        same, so trajectories already on their way are not lost."""
        link, channel = self.link, self.channel
        if link.generation == channel.generation:
            return
        self.log.warning("re-welcomed by the broker: granting credit and publishing parameters again")
        if link.endpoint("learners") == channel.endpoint and link.data_identity == channel.identity:
            channel.regrant(link.generation)
        else:
            self.pending.extend((t, True) for t in map(self._take, channel.drain()) if t is not None)
            channel.close()
            channel = self.channel = self.open_channel()
        for msg in self.published:
            channel.send(msg)
