"""Every message of the zddrl wire protocol: one frozen dataclass per kind, whose fields are the header's keys
and whose ``arrays`` are the frames (docs/protocol.md section 3 lists each kind's fields). The codec that turns
them into frames and back is ``zddrl.protocol`` (``encode``, ``decode``), which re-exports all of this."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

ROLES = ("actor", "learner", "monitor", "relay", "replay")
"""A hello's ``role``. A relay is a broker that joins another (its upstream) on behalf of its own actors; a replay
is a replay service (``zddrl replay``) that takes a replay run's trajectories in place of the learner shards."""
REFUSED_PREFIX = "hello refused: "
"""Start of a reject's reason when the broker will not take this client at all (no retry)."""
PASSIVE_PREFIX = "passive: "
"""Start of a reject's reason when the broker is the passive one of a standby pair (``broker.peer``): the client
moves on to the next broker of its list at once (docs/protocol.md section 5.2)."""
CRASH_PREFIX = "crashed: "
"""A bye reason that starts with this is a crash report; the broker logs it as an error and lists it among
the departures in the status body."""


@dataclass(frozen=True)
class Message:
    KIND: ClassVar[str] = ""
    HAS_ARRAYS: ClassVar[bool] = False

    def encode(self) -> list[Any]:
        """This message's frames (``zddrl.protocol.encode``)."""
        from zddrl.protocol import encode  # the codec sits above the messages it encodes

        return encode(self)


@dataclass(frozen=True)
class Hello(Message):
    """Client -> broker control socket: join. Learners also announce the run they own."""

    KIND: ClassVar[str] = "hello"
    role: str  # "actor" | "learner" | "monitor" | "relay" | "replay"
    peer_id: str
    host: str = ""
    pid: int = 0
    num_envs: int = 0
    run_id: str = ""
    run: dict | None = None  # learner only: the run spec every actor receives in its welcome
    shard: int = 0
    num_shards: int = 1
    run_signer: str = ""  # learner only: the key name that signed the run (protocol.signing.run_payload)
    run_signature: bytes = b""
    bus: dict | None = None
    """Learners: what the brokers need to know of the run to carry it, ``{"sync": bool, "max_staleness": int >= 0,
    "max_in_flight": int >= 1}`` (protocol.rules.RunBus; nil: its defaults). The run spec is opaque to brokers."""
    auto_id: bool = False
    """Actors: the broker assigns the peer id (the lowest free ``actor-N``; its welcome's ``peer_id`` says which);
    ``peer_id`` is then the id this process held before, which it gets back if it is free, or ""."""


@dataclass(frozen=True)
class Welcome(Message):
    """Broker -> client: the data ports (same host as the control endpoint) and the run spec."""

    KIND: ClassVar[str] = "welcome"
    peer_id: str
    run_id: str
    run: dict | None
    ports: dict  # {"trajectories": int, "learners": int, "params": int}
    heartbeat_interval_s: float
    heartbeat_liveness: int
    max_message_bytes: int
    run_signer: str = ""
    """Who signed ``run`` and the signature, as the run's learner sent them in its hello (empty: unsigned)."""
    run_signature: bytes = b""
    data_identity: bytes = b""
    """Learners on a closed bus: the ZeroMQ identity their data DEALER must use on the learners socket, 16 random
    bytes the broker issues (only the welcomed learner learns it: a peer id is public). Empty: use the peer id."""
    bus: dict | None = None
    """The current run's ``bus`` as the broker carries it (its learner's, defaults filled in); nil without a run.
    A relay reads it; other clients need not."""


@dataclass(frozen=True)
class Heartbeat(Message):
    """Both ways on the control socket. Clients report the policy version they act with; the broker's carry the
    heartbeat interval its members must keep from now on, which grows with the fleet (docs/protocol.md 5.2)."""

    KIND: ClassVar[str] = "heartbeat"
    peer_id: str
    policy_version: int = -1
    interval_s: float = 0.0
    """Broker -> client: seconds between heartbeats (and an actor's stats) from now on; 0: keep the current one.
    Clients send 0."""


@dataclass(frozen=True)
class Reject(Message):
    """Broker -> client: the request was refused; ``reason`` says why. Unknown peers must send hello again."""

    KIND: ClassVar[str] = "reject"
    reason: str
    rehello: bool = False


@dataclass(frozen=True)
class Trajectory(Message):
    """Actor -> broker -> one learner shard: one rollout, time-major ``[T, N, ...]`` arrays."""

    KIND: ClassVar[str] = "trajectory"
    HAS_ARRAYS: ClassVar[bool] = True
    run_id: str
    peer_id: str
    seq: int
    policy_version: int
    param_hash: str
    env_steps: int
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    ep_returns: list[float] = field(default_factory=list)
    """Undiscounted return of each episode that ended in this rollout (small: header, not frames)."""
    ep_lengths: list[int] = field(default_factory=list)
    """Length in steps of each of those episodes."""


@dataclass(frozen=True)
class Parameters(Message):
    """Learner -> broker -> every actor: one policy version, its layout, and its first chunk.

    The version's flat buffer (``numel`` elements of ``param_dtype``) travels in chunks of
    ``chunk_numel`` elements: chunk 0 is ``arrays["flat"]`` here, chunks 1.. are ``ParamChunk``
    messages. ``chunk_hashes[i]`` is ``param_hash`` of chunk i; ``param_hash`` is the hash of the
    whole buffer. With ``chunk_hashes`` empty, ``flat`` is the whole buffer. ``layout`` rows are
    ``[name, dtype, shape, offset]`` with ``offset`` in elements of the whole buffer, as float32
    (what the receiver converts it to). Other arrays (for example observation-normalisation
    statistics) travel beside chunk 0. ``meta`` carries small per-version settings such as the
    sync-mode rollout length. ``signer`` and ``signature`` (Ed25519) cover all of that but the
    buffers, which the hashes they cover bind (docs/protocol.md section 5.7).
    """

    KIND: ClassVar[str] = "params"
    HAS_ARRAYS: ClassVar[bool] = True
    run_id: str
    peer_id: str
    policy_version: int
    param_hash: str
    layout: list
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    param_dtype: str = "float32"
    numel: int = 0
    chunk_numel: int = 0
    chunk_hashes: list = field(default_factory=list)
    signer: str = ""
    """The learner key whose ``signature`` covers this version (protocol.signing.params_payload); "": unsigned."""
    signature: bytes = b""

    @property
    def num_chunks(self) -> int:
        return max(1, len(self.chunk_hashes))


@dataclass(frozen=True)
class ParamChunk(Message):
    """Learner -> broker -> every actor: chunk ``index`` (>= 1) of the version that ``policy_version``
    and ``param_hash`` name; ``arrays["data"]`` holds its elements, ``chunk_hash`` their hash."""

    KIND: ClassVar[str] = "params_chunk"
    HAS_ARRAYS: ClassVar[bool] = True
    run_id: str
    peer_id: str
    policy_version: int
    param_hash: str
    index: int
    chunk_hash: str
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class ParamsRequest(Message):
    """Actor -> broker control: send me the cached parameters if they are newer than ``policy_version``."""

    KIND: ClassVar[str] = "params_request"
    peer_id: str
    policy_version: int = -1


@dataclass(frozen=True)
class Credit(Message):
    """Learner shard -> broker learner socket: I can take ``credit`` more trajectories."""

    KIND: ClassVar[str] = "credit"
    peer_id: str
    credit: int


@dataclass(frozen=True)
class Stats(Message):
    """Any client -> broker control: a flat map of figures for ``zddrl status``."""

    KIND: ClassVar[str] = "stats"
    peer_id: str
    role: str
    stats: dict


@dataclass(frozen=True)
class StatusRequest(Message):
    """Anyone -> broker control: send me the status body with ``page`` (from 1) of its member rows."""

    KIND: ClassVar[str] = "status_request"
    peer_id: str = ""
    page: int = 1


@dataclass(frozen=True)
class Status(Message):
    """Broker -> requester: counters, members and drops (see docs/protocol.md for the keys)."""

    KIND: ClassVar[str] = "status"
    body: dict


@dataclass(frozen=True)
class Fleet(Message):
    """Broker -> learner shard, control: the actors joined now. Two frames: preamble, header.

    ``actors`` maps each joined actor's peer id to ``{"num_envs": int, "host": str}`` (its hello's
    figures; ``num_envs`` 0 means the run's ``env.num_envs``). ``seq`` grows by one with every change
    of that map, per broker process (docs/protocol.md section 5.5). Sent right after a learner's
    welcome and, coalesced, whenever actors join, leave or expire.
    """

    KIND: ClassVar[str] = "fleet"
    run_id: str
    seq: int
    actors: dict


@dataclass(frozen=True)
class Subtree(Message):
    """Relay -> its upstream broker, control: the actors joined to the relay and the relay's counters.

    ``actors`` maps a peer id to ``{"num_envs": int, "host": str, "pid": int}`` (its hello's figures). With
    ``full`` it is the relay's whole subtree (the upstream forgets the relay's actors it does not name);
    without, it names actors that joined since the last report and ``left`` those that left. ``counters`` is
    the relay's trajectory accounting (received, forwarded, in_flight, dropped_<reason>, ...), for status.
    A relay sends a delta naming an actor before it welcomes that actor, and a full report after each welcome
    from upstream and every heartbeat interval (docs/protocol.md section 5.8).
    """

    KIND: ClassVar[str] = "subtree"
    peer_id: str
    seq: int
    full: bool
    actors: dict
    left: list = field(default_factory=list)
    counters: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    """Full reports: each actor's policy version as its last heartbeat to the relay said (for status upstream)."""


@dataclass(frozen=True)
class ReplaySample(Message):
    """Learner shard -> replay service (its own ROUTER, not the broker): sample ``batch`` transitions.

    Also carries what the replay needs of the learner: ``allow_steps`` (the replay takes in trajectories while the
    env steps it has inserted, a count since it started, are below this), the learner's ``policy_version`` and the
    longest per-env ``rollout_len`` it asked for (what bounds an admitted rollout), ``drop_before`` (retire data
    acted by older versions; -1: none), ``report`` (the main shard: hand over the intake figures), and
    ``arrays["ids"]`` (int64 ``[M]``) with ``arrays["td_errors"]`` (float32 ``[M]``): new priorities of transitions
    this replay gave out earlier (both absent when ``M`` = 0). docs/protocol.md section 5.9.
    """

    KIND: ClassVar[str] = "replay_sample"
    HAS_ARRAYS: ClassVar[bool] = True
    run_id: str
    peer_id: str
    request: int
    batch: int
    allow_steps: int
    policy_version: int
    rollout_len: int
    drop_before: int = -1
    report: bool = False
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplayBatch(Message):
    """Replay service -> learner shard: the answer to ``replay_sample`` ``request``.

    ``arrays``: the ``batch`` transitions drawn (``ids`` int64, ``priorities`` float64, ``obs`` and ``next_obs`` of
    the env's dtype, ``actions``, n-step ``returns`` and ``discounts`` float32, ``versions`` int32; none when
    ``batch`` was 0 or nothing is held). The buffer's figures: ``held`` (transitions that can be drawn),
    ``total`` (their priority mass), ``min_priority``, ``max_priority`` (the largest seen), ``inserted`` (env steps
    taken in since the replay started), ``newest_version`` (the newest policy version taken in; -1: none),
    ``capacity``, ``nbytes``, ``stale_updates``, ``dropped_by_version``. For a request with ``report`` set, the
    intake since the last report: ``ep_returns`` of the episodes that ended, ``env_steps``, ``trajectories`` and
    ``invalid`` (trajectories refused). docs/protocol.md section 5.9.
    """

    KIND: ClassVar[str] = "replay_batch"
    HAS_ARRAYS: ClassVar[bool] = True
    run_id: str
    peer_id: str
    request: int
    held: int
    total: float
    min_priority: float
    max_priority: float
    inserted: int
    newest_version: int
    capacity: int
    nbytes: int
    stale_updates: int = 0
    dropped_by_version: int = 0
    env_steps: int = 0
    trajectories: int = 0
    invalid: int = 0
    ep_returns: list[float] = field(default_factory=list)
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class Bye(Message):
    """Client -> broker control: I am leaving on purpose (no expiry needed)."""

    KIND: ClassVar[str] = "bye"
    peer_id: str
    reason: str = ""


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        Hello,
        Welcome,
        Heartbeat,
        Reject,
        Trajectory,
        Parameters,
        ParamChunk,
        ParamsRequest,
        Credit,
        Stats,
        StatusRequest,
        Status,
        Fleet,
        Subtree,
        ReplaySample,
        ReplayBatch,
        Bye,
    )
}
