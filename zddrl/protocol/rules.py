"""What ``zddrl.protocol.decode`` checks of a message's fields beyond their types: the rules of each kind.

Part of the protocol's definition (docs/protocol.md sections 2.4 and 6); zddrl.protocol runs these
after the generic header checks and re-exports the constants. Each raises ``ProtocolError`` with the
reason.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import msgpack
import numpy as np

from zddrl.protocol.frames import DTYPE_NAMES, DTYPES, MAX_HEADER_BYTES, MAX_NDIM, Layout, ProtocolError

PARAM_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}
"""Parameter transport precision -> the wire dtype of its buffers (bfloat16: the upper 16 bits of each
IEEE float32, carried as uint16, since the wire has no bfloat16 dtype)."""
MAX_PARAM_CHUNKS = 1 << 20

# --------------------------------------------------------------------------------------------
# Names a client chooses (docs/protocol.md section 3, hello), and the fleet they make up (section 5.5)
# --------------------------------------------------------------------------------------------

MAX_ID_BYTES = 128
"""Longest peer id or run id, in UTF-8 bytes. They are keys of the fleet and status maps, and in every log line."""
MAX_HOST_BYTES = 255
"""Longest ``host`` a hello may carry, in UTF-8 bytes (a DNS name has at most 253)."""
MAX_NUM_ENVS = 1 << 20
"""Most environments one actor host may announce in its hello."""
FLEET_HEADER_RESERVE_BYTES = 1024
"""Room a fleet header keeps for everything but its ``actors`` map (kind, run_id, seq: under 200 bytes)."""
MAX_FLEET_ACTORS_BYTES = MAX_HEADER_BYTES - FLEET_HEADER_RESERVE_BYTES
"""The broker refuses an actor's hello whose fleet entry would take the fleet's ``actors`` map past this many
bytes, so that a fleet message always fits MAX_HEADER_BYTES (docs/protocol.md section 5.5)."""


def hello_refusal(hello: Any) -> str:
    """Why the broker refuses ``hello`` (a decoded Hello) for its names and figures alone (its ``bus`` included),
    or "" if it does not."""
    if not hello.peer_id or len(hello.peer_id.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        return f"peer_id must be 1..{MAX_ID_BYTES} bytes of UTF-8"
    if len(hello.run_id.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        return f"run_id must be at most {MAX_ID_BYTES} bytes of UTF-8"
    if len(hello.host.encode("utf-8", "surrogatepass")) > MAX_HOST_BYTES:
        return f"host must be at most {MAX_HOST_BYTES} bytes of UTF-8"
    if not 0 <= hello.num_envs <= MAX_NUM_ENVS:
        return f"num_envs must be in 0..{MAX_NUM_ENVS}, got {hello.num_envs}"
    return bus_refusal(hello.bus)


# --------------------------------------------------------------------------------------------
# What a broker knows of a run: the ``bus`` of a learner's hello and of every welcome (docs/protocol.md 5.1)
# --------------------------------------------------------------------------------------------

BUS_KEYS = ("sync", "max_staleness", "max_in_flight")
"""The keys of a ``bus`` map, all of them required when the map is there; ``arrays`` (BUS_ARRAYS) may join them."""
BUS_ARRAYS = "arrays"
"""The optional key of a ``bus`` map declaring the run's own trajectory arrays (docs/protocol.md section 7.1)."""
MAX_DECLARED_ARRAYS = 32
"""Most arrays a run may declare."""
MAX_DECLARED_NAME = 64
"""Longest declared array name, in characters."""
ARRAY_PER = ("step", "rollout")
"""A declared array is ``[T, N, *shape]`` (``step``) or ``[N, *shape]`` (``rollout``)."""


class DeclaredLayout:
    """A run's declared arrays (the ``arrays`` of its ``bus``) and the trajectory layouts found to follow them.

    ``refusal(specs)`` says why a checked trajectory's ``[name, dtype, shape]`` specs break the declaration: a
    declared array missing or of another dtype or shape, or an array that is neither one of every trajectory's
    (section 7) nor declared. A forwarder asks per trajectory; the answer is kept per layout object (the layout
    cache hands out one list per distinct layout), so the check costs one dict lookup in the steady state."""

    def __init__(self, declared: tuple[tuple[str, str, tuple[int, ...], str], ...] = ()) -> None:
        self.declared = declared
        self.names = frozenset(name for name, *_ in declared)
        self._seen: dict[int, tuple[Any, str]] = {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeclaredLayout) and self.declared == other.declared

    def __hash__(self) -> int:
        return hash(self.declared)

    def __repr__(self) -> str:
        return f"DeclaredLayout({self.declared!r})"

    def to_wire(self) -> list:
        return [[name, dtype, list(shape), per] for name, dtype, shape, per in self.declared]

    def refusal(self, specs: Any) -> str:
        """Why ``specs`` (``[[name, dtype, shape], ...]`` of a trajectory that passed decode's checks) break the
        declaration, or ""."""
        seen = self._seen.get(id(specs))
        if seen is not None and seen[0] is specs:
            return seen[1]
        why = self._refusal({name: (dtype, tuple(shape)) for name, dtype, shape in specs})
        if len(self._seen) >= 256:  # layouts vary little; a sender that varies them on purpose pays the check
            self._seen.clear()
        self._seen[id(specs)] = (specs, why)  # the list is held, so its id names no other list while kept
        return why

    def refusal_of(self, arrays: Any) -> str:
        """``refusal`` of a decoded trajectory's arrays (name -> ndarray)."""
        if not self.declared and arrays.keys() <= _GENERIC:
            return ""
        return self._refusal({name: (DTYPE_NAMES[a.dtype], a.shape) for name, a in arrays.items()})

    def _refusal(self, arrays: dict[str, tuple[str, tuple]]) -> str:
        undeclared = sorted(arrays.keys() - _GENERIC - self.names)
        if undeclared:
            return f"trajectory: arrays {undeclared} are neither a trajectory's own nor declared by the run"
        T, N = arrays["rewards"][1]
        for name, dtype, shape, per in self.declared:
            want = (T, N, *shape) if per == "step" else (N, *shape)
            got = arrays.get(name)
            if got != (dtype, want):
                have = "missing" if got is None else f"{got[0]} {list(got[1])}"
                return f"trajectory: declared array {name!r} must be {dtype} {list(want)}, got {have}"
        return ""


def declaration_of(arrays: Any) -> DeclaredLayout:
    """The DeclaredLayout of a ``bus`` map's ``arrays`` that passed ``bus_refusal``."""
    return DeclaredLayout(tuple((name, dtype, tuple(shape), per) for name, dtype, shape, per in arrays or ()))


def declaration_refusal(arrays: Any) -> str:
    """Why a ``bus`` map's ``arrays`` breaks its rules: a list of at most MAX_DECLARED_ARRAYS distinct
    ``[name, dtype, shape, per]``, each name an identifier of at most MAX_DECLARED_NAME characters that is none
    of a trajectory's own, a wire dtype, at most MAX_NDIM - 2 sizes >= 1, ``per`` one of ARRAY_PER."""
    if type(arrays) is not list or len(arrays) > MAX_DECLARED_ARRAYS:
        return f"bus: arrays must be a list of at most {MAX_DECLARED_ARRAYS} entries"
    names = set()
    for entry in arrays:
        if type(entry) is not list or len(entry) != 4:
            return "bus: each declared array is [name, dtype, shape, per]"
        name, dtype, shape, per = entry
        if type(name) is not str or not name.isidentifier() or len(name) > MAX_DECLARED_NAME:
            return f"bus: declared array name {name!r} must be an identifier of at most {MAX_DECLARED_NAME} chars"
        if name in _GENERIC or name in names:
            return f"bus: declared array {name!r} is a trajectory's own or declared twice"
        names.add(name)
        if type(dtype) is not str or dtype not in DTYPES:
            return f"bus: declared array {name!r} has dtype {dtype!r}, not one of {sorted(DTYPES)}"
        if type(shape) is not list or len(shape) > MAX_NDIM - 2 or not all(_is_int(d, 1) for d in shape):
            return f"bus: declared array {name!r} must have a shape of at most {MAX_NDIM - 2} sizes >= 1"
        if per not in ARRAY_PER:
            return f"bus: declared array {name!r}: per must be one of {list(ARRAY_PER)}, got {per!r}"
    return ""


class RunBus(NamedTuple):
    """What brokers and relays know of how a run learns, from its learner's hello: nothing else of the run spec is
    read on the bus. A hello without ``bus`` gets these defaults: only the newest version's data is forwarded (what
    the strictest learner accepts), and actors keep the reference client's window of 2."""

    sync: bool = True
    """The run's schedule is sync: only data of the newest published version reaches a learner."""
    max_staleness: int = 0
    """Async: versions a trajectory may lag the newest one and still reach a learner (ignored when ``sync``)."""
    max_in_flight: int = 2
    """Trajectories an actor keeps pushed and not credited at most: the broker returns credit in batches of half
    of it, and a relay sizes its upstream window by it."""
    arrays: DeclaredLayout = DeclaredLayout()
    """The run's declared trajectory arrays (section 7.1), which every forwarder checks."""

    @property
    def staleness(self) -> int:
        """Versions of lag the broker lets through: 0 under sync (docs/protocol.md section 8, ``stale``)."""
        return 0 if self.sync else self.max_staleness

    def to_wire(self) -> dict[str, Any]:
        """The ``bus`` map of hello and welcome (``arrays`` only when the run declares some)."""
        bus: dict[str, Any] = {
            "sync": self.sync,
            "max_staleness": self.max_staleness,
            "max_in_flight": self.max_in_flight,
        }
        if self.arrays.declared:
            bus[BUS_ARRAYS] = self.arrays.to_wire()
        return bus


def bus_refusal(bus: dict[str, Any] | None) -> str:
    """Why a ``bus`` map breaks its rules (exactly the keys BUS_KEYS; ``sync`` a bool, ``max_staleness`` an int
    >= 0, ``max_in_flight`` an int >= 1), or "" (nil is no map: the defaults)."""
    if bus is None:
        return ""
    if set(bus) - {BUS_ARRAYS} != set(BUS_KEYS):
        return f"bus must have exactly the keys {list(BUS_KEYS)} (and {BUS_ARRAYS!r}), got {sorted(bus)}"
    if type(bus["sync"]) is not bool:
        return f"bus: sync must be a bool, got {bus['sync']!r}"
    if not _is_int(bus["max_staleness"], 0):
        return f"bus: max_staleness must be an int >= 0, got {bus['max_staleness']!r}"
    if not _is_int(bus["max_in_flight"], 1):
        return f"bus: max_in_flight must be an int >= 1, got {bus['max_in_flight']!r}"
    return declaration_refusal(bus[BUS_ARRAYS]) if BUS_ARRAYS in bus else ""


def run_bus(bus: dict[str, Any] | None) -> RunBus:
    """The RunBus of a ``bus`` map that passed ``bus_refusal`` (nil: the defaults)."""
    if bus is None:
        return RunBus()
    return RunBus(bus["sync"], bus["max_staleness"], bus["max_in_flight"], declaration_of(bus.get(BUS_ARRAYS)))


def fleet_entry_bytes(peer_id: str, num_envs: int, host: str) -> int:
    """Bytes one actor takes in a fleet's ``actors`` map: its packed key and packed value."""
    return len(msgpack.packb(peer_id, use_bin_type=True)) + len(
        msgpack.packb({"num_envs": num_envs, "host": host}, use_bin_type=True)
    )


def check_fleet(fields: dict[str, Any]) -> None:
    """``seq`` >= 0; every ``actors`` value is exactly ``{"num_envs": int in 0..MAX_NUM_ENVS, "host": str}``."""
    if fields["seq"] < 0:
        raise ProtocolError(f"fleet: seq must be >= 0, got {fields['seq']}")
    for peer_id, entry in fields["actors"].items():
        if type(entry) is not dict or len(entry) != 2:
            raise ProtocolError(f"fleet: actor {peer_id!r} must map to {{num_envs, host}}, got {entry!r}")
        num_envs, host = entry.get("num_envs"), entry.get("host")
        if type(num_envs) is not int or not 0 <= num_envs <= MAX_NUM_ENVS or type(host) is not str:
            raise ProtocolError(
                f"fleet: actor {peer_id!r} must map to {{num_envs: int in 0..{MAX_NUM_ENVS}, host: str}}, got {entry!r}"
            )


MAX_PID = (1 << 31) - 1
"""Largest pid a subtree entry may carry."""


def check_subtree(fields: dict[str, Any]) -> None:
    """``seq`` >= 0; every ``actors`` value is exactly ``{"num_envs", "host", "pid"}`` within the hello's bounds
    (an id of 1..MAX_ID_BYTES, a host of MAX_HOST_BYTES); ``left`` holds peer ids; ``counters`` are ints >= 0."""
    if fields["seq"] < 0:
        raise ProtocolError(f"subtree: seq must be >= 0, got {fields['seq']}")
    for peer_id, entry in fields["actors"].items():
        if not 0 < len(peer_id.encode("utf-8", "surrogatepass")) <= MAX_ID_BYTES:
            raise ProtocolError(f"subtree: peer id {peer_id[:40]!r} must be 1..{MAX_ID_BYTES} bytes of UTF-8")
        if type(entry) is not dict or set(entry) != {"num_envs", "host", "pid"}:
            raise ProtocolError(f"subtree: actor {peer_id!r} must map to {{num_envs, host, pid}}")
        num_envs, host, pid = entry["num_envs"], entry["host"], entry["pid"]
        if not (_is_int(num_envs, 0, MAX_NUM_ENVS) and _is_int(pid, 0, MAX_PID) and type(host) is str):
            raise ProtocolError(f"subtree: actor {peer_id!r}: num_envs, pid must be ints in range, host a str")
        if len(host.encode("utf-8", "surrogatepass")) > MAX_HOST_BYTES:
            raise ProtocolError(f"subtree: actor {peer_id!r}: host must be at most {MAX_HOST_BYTES} bytes")
    if not all(type(p) is str for p in fields["left"]):
        raise ProtocolError("subtree: left must be a list of peer ids")
    if not all(_is_int(v, 0) for v in fields["counters"].values()):
        raise ProtocolError("subtree: counters must be ints >= 0")
    if not all(_is_int(v, -1) for v in fields["versions"].values()):
        raise ProtocolError("subtree: versions must be ints >= -1")


def _is_int(value: Any, lo: int, hi: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)


def _shape_ok(shape: Any) -> bool:
    return isinstance(shape, list) and len(shape) <= MAX_NDIM and all(_is_int(d, 0) for d in shape)


SIGNATURE_BYTES = 64
"""An Ed25519 signature (docs/protocol.md section 5.7)."""
MAX_SIGNER_BYTES = 64
"""Longest signer name: a key name (zddrl.keys.NAME_PATTERN)."""


def check_seal(kind: str, signer: str, signature: bytes) -> None:
    """A signer name and its signature travel together: both empty (unsigned) or a name and 64 bytes."""
    if not signer and not signature:
        return
    if not 1 <= len(signer.encode("utf-8", "surrogatepass")) <= MAX_SIGNER_BYTES or len(signature) != SIGNATURE_BYTES:
        raise ProtocolError(
            f"{kind}: a signer of 1..{MAX_SIGNER_BYTES} bytes and a signature of {SIGNATURE_BYTES} bytes go together, "
            f"got a {len(signer)}-character signer and a {len(signature)}-byte signature"
        )


def check_hello(fields: dict[str, Any]) -> None:
    check_seal("hello", fields["run_signer"], fields["run_signature"])


DATA_IDENTITY_BYTES = 16
"""Length of a data identity the broker issues to a learner on a closed bus (welcome.data_identity)."""


MIN_HEARTBEAT_INTERVAL_S, MAX_HEARTBEAT_INTERVAL_S = 0.01, 3600.0
"""Heartbeat intervals a welcome or a broker's heartbeat may set: a client told less would spin sending beats
and give up on its broker at once; one told more would take an hour or more to notice a dead broker."""


def check_heartbeat(fields: dict[str, Any]) -> None:
    interval = fields["interval_s"]
    if interval != 0.0 and not MIN_HEARTBEAT_INTERVAL_S <= interval <= MAX_HEARTBEAT_INTERVAL_S:
        raise ProtocolError(
            f"heartbeat: interval_s must be 0 or in {MIN_HEARTBEAT_INTERVAL_S:g}..{MAX_HEARTBEAT_INTERVAL_S:g}, "
            f"got {interval}"
        )


def check_welcome(fields: dict[str, Any]) -> None:
    check_seal("welcome", fields["run_signer"], fields["run_signature"])
    if len(fields["data_identity"]) not in (0, DATA_IDENTITY_BYTES):
        raise ProtocolError(
            f"welcome: data_identity must be empty or {DATA_IDENTITY_BYTES} bytes, got {len(fields['data_identity'])}"
        )
    for name, port in fields["ports"].items():
        if not _is_int(port, 1, 65535):
            raise ProtocolError(f"welcome: port {name!r} must be an int in 1..65535, got {port!r}")
    if not MIN_HEARTBEAT_INTERVAL_S <= fields["heartbeat_interval_s"] <= MAX_HEARTBEAT_INTERVAL_S:
        raise ProtocolError(
            f"welcome: heartbeat_interval_s must be in {MIN_HEARTBEAT_INTERVAL_S:g}..{MAX_HEARTBEAT_INTERVAL_S:g}, "
            f"got {fields['heartbeat_interval_s']}"
        )
    if fields["heartbeat_liveness"] < 1:
        raise ProtocolError(f"welcome: heartbeat_liveness must be >= 1, got {fields['heartbeat_liveness']}")
    if fields["max_message_bytes"] < 0:
        raise ProtocolError(f"welcome: max_message_bytes must be >= 0, got {fields['max_message_bytes']}")
    why = bus_refusal(fields["bus"])
    if why:
        raise ProtocolError(f"welcome: {why}")


def check_params(fields: dict[str, Any]) -> None:
    """Chunking fields agree with each other and with chunk 0; layout rows ``[name, "float32", shape,
    offset]`` are well formed and lie within the whole buffer's ``numel`` elements."""
    check_seal("params", fields["signer"], fields["signature"])
    flat = fields["arrays"].get("flat")
    if flat is not None and flat.ndim != 1:
        raise ProtocolError(f"params: array 'flat' must be 1-d, got shape {list(flat.shape)}")
    numel = _check_chunking(fields, flat)
    names: set[str] = set()
    for i, row in enumerate(fields["layout"]):
        if not (isinstance(row, list) and len(row) == 4):
            raise ProtocolError(f"params: layout row {i} must be [name, dtype, shape, offset], got {row!r}")
        name, dtype_name, shape, offset = row
        if not isinstance(name, str) or not name or name in names:
            raise ProtocolError(f"params: layout row {i}: name {name!r} must be a unique non-empty string")
        names.add(name)
        if dtype_name != "float32":  # the rows describe the float32 buffer receivers rebuild, whatever param_dtype
            raise ProtocolError(
                f'params: layout row {name!r}: dtype {dtype_name!r} is not allowed ("float32": '
                "the rows describe the float32 buffer a receiver rebuilds)"
            )
        if not _shape_ok(shape):
            raise ProtocolError(f"params: layout row {name!r}: bad shape {shape!r}")
        if not _is_int(offset, 0):
            raise ProtocolError(f"params: layout row {name!r}: offset {offset!r} must be a non-negative int")
        if numel is not None and offset + math.prod(shape) > numel:
            raise ProtocolError(
                f"params: layout row {name!r} (offset {offset}, shape {shape}) does not fit "
                f"the flat buffer of {numel} elements"
            )


def _hash_ok(value: Any) -> bool:
    return type(value) is str and len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def _check_chunking(fields: dict[str, Any], flat: np.ndarray | None) -> int | None:
    """The whole buffer's element count (None if unknown: no flat buffer, no chunk table)."""
    dtype, hashes, numel, per = (fields["param_dtype"], fields["chunk_hashes"], fields["numel"], fields["chunk_numel"])
    if dtype not in PARAM_DTYPES:
        raise ProtocolError(f"params: param_dtype {dtype!r} is not one of {sorted(PARAM_DTYPES)}")
    if flat is not None and flat.dtype != DTYPES[PARAM_DTYPES[dtype]]:
        raise ProtocolError(f"params: 'flat' must be {PARAM_DTYPES[dtype]} for param_dtype {dtype}, got {flat.dtype}")
    if numel < 0 or per < 0:
        raise ProtocolError(f"params: numel ({numel}) and chunk_numel ({per}) must be >= 0")
    if not hashes:
        if numel and (flat is None or numel != flat.size):
            raise ProtocolError(f"params: numel {numel} without chunk_hashes must be the size of 'flat'")
        return flat.size if flat is not None else None
    if not 1 <= len(hashes) <= MAX_PARAM_CHUNKS or not all(_hash_ok(h) for h in hashes):
        raise ProtocolError(f"params: chunk_hashes must be 1..{MAX_PARAM_CHUNKS} hashes of 16 hex digits")
    if numel < 1 or per < 1 or len(hashes) != -(-numel // per):
        raise ProtocolError(f"params: {len(hashes)} chunk hashes do not fit numel {numel} in chunks of {per}")
    if flat is None or flat.size != min(per, numel):
        raise ProtocolError(f"params: 'flat' must be chunk 0 ({min(per, numel)} elements)")
    if len(hashes) == 1 and fields["param_hash"] != hashes[0]:
        raise ProtocolError("params: with one chunk, param_hash must be chunk_hashes[0] (both hash the whole buffer)")
    return numel


def check_chunk(fields: dict[str, Any]) -> None:
    arrays = fields["arrays"]
    if set(arrays) != {"data"} or arrays["data"].ndim != 1:
        raise ProtocolError("params_chunk: must carry exactly one 1-d array, 'data'")
    if not 1 <= fields["index"] < MAX_PARAM_CHUNKS:
        raise ProtocolError(f"params_chunk: index {fields['index']} must be in 1..{MAX_PARAM_CHUNKS - 1}")
    if not _hash_ok(fields["chunk_hash"]):
        raise ProtocolError("params_chunk: chunk_hash must be 16 hex digits")


# --------------------------------------------------------------------------------------------
# Trajectories (docs/protocol.md section 7)
# --------------------------------------------------------------------------------------------

_F32, _BOOL, _I64 = DTYPES["float32"], DTYPES["bool"], DTYPES["int64"]
STEP_ARRAYS = {"logp": _F32, "values": _F32, "rewards": _F32, "terminated": _BOOL, "truncated": _BOOL}
"""Arrays of shape ``[T, N]`` besides ``obs`` and ``actions``, with their one dtype."""
OBS_DTYPES = (_F32, DTYPES["uint8"])
"""An observation travels as float32, or as uint8 (pixels: 4x fewer bytes; the learner's network scales them)."""
TRAJECTORY_ARRAYS = ("obs", "actions", *STEP_ARRAYS, "next_obs", "next_value")
"""Every trajectory carries these."""
TRUNCATION_ARRAYS = ("trunc_idx", "trunc_obs", "trunc_value")
"""Present together, and only in a rollout where some episode was truncated (``K >= 1``)."""
OPTIONAL_STEP_ARRAYS = {"life_lost": _BOOL}
"""``[T, N]`` arrays a run may add: ``life_lost`` (``env.episodic_life``), true where a life was lost and the game
went on: a terminal for the returns, not the end of an episode."""


_GENERIC = frozenset(TRAJECTORY_ARRAYS + TRUNCATION_ARRAYS + tuple(OPTIONAL_STEP_ARRAYS))
"""Every trajectory array the protocol itself defines: no run may declare one of these names."""


def check_trajectory_layout(layout: Layout) -> None:
    """The array rules of a trajectory: which arrays, their dtypes, and shapes that agree on ``T``, ``N``
    and the observation shape. Depends on the layout alone, so decode runs it once per distinct layout."""
    arrays = dict(zip(layout.names, zip(layout.dtypes, layout.shapes)))
    missing = [name for name in TRAJECTORY_ARRAYS if name not in arrays]
    if missing:
        raise ProtocolError(f"trajectory: missing arrays {missing}")
    # Other arrays are the run's declared ones (section 7.1): a forwarder checks them against the run's declaration
    # (DeclaredLayout), which decode does not know.
    obs_dtype, obs_shape = arrays["obs"]
    if obs_dtype not in OBS_DTYPES or len(obs_shape) < 2 or 0 in obs_shape[:2]:
        raise ProtocolError(
            "trajectory: 'obs' must be float32 or uint8 [T, N, *obs_shape] with T, N >= 1, "
            f"got {DTYPE_NAMES.get(obs_dtype, obs_dtype)} {list(obs_shape)}"
        )
    steps, observation = obs_shape[:2], obs_shape[2:]

    def need(name: str, dtype: np.dtype, shape: tuple) -> None:
        if arrays[name] != (dtype, shape):
            got_dtype, got_shape = arrays[name]
            raise ProtocolError(
                f"trajectory: {name!r} must be {DTYPE_NAMES[dtype]} {list(shape)}, "
                f"got {DTYPE_NAMES[got_dtype]} {list(got_shape)}"
            )

    actions_dtype, actions_shape = arrays["actions"]
    if not (
        actions_dtype == _I64
        and actions_shape == steps
        or actions_dtype == _F32
        and len(actions_shape) == 3
        and actions_shape[:2] == steps
    ):
        raise ProtocolError(
            f"trajectory: 'actions' must be int64 {list(steps)} or float32 {list(steps)} + [A], "
            f"got {DTYPE_NAMES[actions_dtype]} {list(actions_shape)}"
        )
    for name, dtype in STEP_ARRAYS.items():
        need(name, dtype, steps)
    for name, dtype in OPTIONAL_STEP_ARRAYS.items():
        if name in arrays:
            need(name, dtype, steps)
    need("next_obs", obs_dtype, steps[1:] + observation)  # every observation array shares obs's dtype
    need("next_value", _F32, steps[1:])
    present = [name for name in TRUNCATION_ARRAYS if name in arrays]
    if present:
        if len(present) != len(TRUNCATION_ARRAYS):
            raise ProtocolError(f"trajectory: {present} without the rest of {list(TRUNCATION_ARRAYS)}")
        k = arrays["trunc_idx"][1]
        if len(k) == 1 and k[0] == 0:
            raise ProtocolError("trajectory: truncation arrays of no truncation (K = 0): leave them out")
        k = k if len(k) == 1 else (1,)  # a trunc_idx of another rank is refused by need() below
        need("trunc_idx", _I64, k)
        need("trunc_obs", obs_dtype, k + observation)
        need("trunc_value", _F32, k)


def _steps_of(arrays: Any) -> int:
    """``T * N`` of a trajectory's checked arrays: views by name, or ``[name, dtype, shape]`` specs."""
    if type(arrays) is dict:
        return arrays["rewards"].size
    return next(math.prod(shape) for name, _, shape in arrays if name == "rewards")


def check_trajectory(fields: dict[str, Any]) -> None:
    """Per message (the layout was checked by check_trajectory_layout): env_steps and episode figures."""
    env_steps, returns, lengths = fields["env_steps"], fields["ep_returns"], fields["ep_lengths"]
    if env_steps != _steps_of(fields["arrays"]):
        raise ProtocolError(f"trajectory: env_steps {env_steps} must be T * N = {_steps_of(fields['arrays'])}")
    if len(returns) != len(lengths) or len(lengths) > env_steps:
        raise ProtocolError(
            f"trajectory: {len(returns)} episode returns and {len(lengths)} lengths must pair up, "
            f"at most one per env step"
        )
    if lengths and min(lengths) < 1:
        raise ProtocolError("trajectory: episode lengths must be >= 1")


# --------------------------------------------------------------------------------------------
# The replay service's own socket (docs/protocol.md section 5.9)
# --------------------------------------------------------------------------------------------

MAX_REPLAY_BATCH = 1 << 16
"""Most transitions one replay_sample may ask for (and one replay_batch carry)."""
MAX_REPLAY_RETURNS = 4096
"""Most episode returns one replay_batch carries (a replay keeps the rest for its next report)."""
REPLAY_SAMPLE_ARRAYS = {"ids": _I64, "td_errors": _F32}
REPLAY_BATCH_COUNTS: tuple[str, ...] = ("request", "held", "inserted", "capacity", "nbytes", "stale_updates")
REPLAY_BATCH_COUNTS += ("dropped_by_version", "env_steps", "trajectories", "invalid")
REPLAY_BATCH_ARRAYS = ("ids", "priorities", "obs", "next_obs", "actions", "returns", "discounts", "versions")


def check_replay_sample(fields: dict[str, Any]) -> None:
    """Counts in range; the priority updates are both arrays or neither, 1-d, of one length, finite."""
    if not (_is_int(fields["request"], 0) and _is_int(fields["batch"], 0, MAX_REPLAY_BATCH)):
        raise ProtocolError(f"replay_sample: request must be >= 0 and batch in 0..{MAX_REPLAY_BATCH}")
    if not (_is_int(fields["allow_steps"], 0) and _is_int(fields["policy_version"], 0)):
        raise ProtocolError("replay_sample: allow_steps and policy_version must be >= 0")
    if not (_is_int(fields["rollout_len"], 1) and _is_int(fields["drop_before"], -1)):
        raise ProtocolError("replay_sample: rollout_len must be >= 1 and drop_before >= -1")
    arrays = fields["arrays"]
    if not arrays:
        return
    if set(arrays) != set(REPLAY_SAMPLE_ARRAYS) or any(
        arrays[k].dtype != dt or arrays[k].ndim != 1 for k, dt in REPLAY_SAMPLE_ARRAYS.items()
    ):
        raise ProtocolError("replay_sample: priority updates are 'ids' int64 [M] and 'td_errors' float32 [M]")
    if arrays["ids"].shape != arrays["td_errors"].shape or not np.isfinite(arrays["td_errors"]).all():
        raise ProtocolError("replay_sample: 'ids' and 'td_errors' must have one length, the TD errors be finite")


def check_replay_batch(fields: dict[str, Any]) -> None:
    """Counts >= 0, a priority mass and minimum >= 0, at most MAX_REPLAY_RETURNS returns; the arrays are all of
    REPLAY_BATCH_ARRAYS or none, with one batch size B (the learner checks the observations against its env)."""
    counts = REPLAY_BATCH_COUNTS
    if not all(_is_int(fields[k], 0) for k in counts):
        raise ProtocolError(f"replay_batch: {', '.join(counts)} must be ints >= 0")
    if fields["total"] < 0 or fields["min_priority"] < 0 or fields["max_priority"] < 0:
        raise ProtocolError("replay_batch: total, min_priority and max_priority must be >= 0")
    if not _is_int(fields["newest_version"], -1):
        raise ProtocolError("replay_batch: newest_version must be >= -1")
    if len(fields["ep_returns"]) > MAX_REPLAY_RETURNS:
        raise ProtocolError(f"replay_batch: at most {MAX_REPLAY_RETURNS} episode returns")
    arrays = fields["arrays"]
    if not arrays:
        return
    if set(arrays) != set(REPLAY_BATCH_ARRAYS):
        raise ProtocolError(f"replay_batch: arrays must be all of {list(REPLAY_BATCH_ARRAYS)} or none")
    B = arrays["ids"].shape[0] if arrays["ids"].ndim == 1 else -1
    if not 1 <= B <= MAX_REPLAY_BATCH or any(a.ndim < 1 or a.shape[0] != B for a in arrays.values()):
        raise ProtocolError(f"replay_batch: every array must have one first dimension B in 1..{MAX_REPLAY_BATCH}")
    want = {"ids": _I64, "priorities": DTYPES["float64"], "returns": _F32, "discounts": _F32}
    want["versions"] = DTYPES["int32"]
    for name, dtype in want.items():
        if arrays[name].dtype != dtype or arrays[name].ndim != 1:
            raise ProtocolError(f"replay_batch: {name!r} must be {DTYPE_NAMES[dtype]} [B]")
    if arrays["obs"].dtype not in OBS_DTYPES or arrays["next_obs"].dtype != arrays["obs"].dtype:
        raise ProtocolError("replay_batch: 'obs' and 'next_obs' must share one dtype, float32 or uint8")
    if arrays["next_obs"].shape != arrays["obs"].shape:
        raise ProtocolError("replay_batch: 'obs' and 'next_obs' must have one shape")
    if arrays["actions"].dtype not in (_I64, _F32):
        raise ProtocolError("replay_batch: 'actions' must be int64 or float32")
    if not (np.isfinite(arrays["priorities"]).all() and (arrays["priorities"] > 0).all()):
        raise ProtocolError("replay_batch: priorities must be finite and > 0")
