"""A replay service's buffer and its books (``zddrl replay``; the process and its sockets: ``service.py``).

``ReplayStore`` holds one ``PrioritizedReplay`` for the run being served (``adopt``), takes in the trajectories the
broker routes to it (``take_in``: checked like a learner shard checks them, episodes counted from the verified
rewards with ``episodes.Episodes``), answers learners' ``replay_sample`` requests (``serve``) and saves and loads
itself under ``--state-dir`` (``save``, and ``adopt`` loads).

**A learner restart keeps the data.** Every learner start is a new run id; the buffer is kept across runs while
its layout (``PrioritizedReplay.layout``: capacity, observation and action shapes and dtypes, alpha, gamma,
n-step) stays the same. The version floor starts again at 0 (a learner started afresh counts versions from 0).

**Accounting.** Every trajectory taken off the socket is inserted or refused (``invalid``, one aggregated log
line per interval); ``inserted`` counts env steps inserted since this process started (or since the state it
loaded was saved). What the main learner shard has not been told yet (env steps, trajectories, refusals, the
returns of the episodes that ended) waits in ``pending`` for its next request with ``report`` set; at most
``RETURNS_KEPT`` returns wait (older ones are dropped and counted in ``returns_dropped``).

**State files.** ``STATE_NAME.npz`` (the arrays, ``numpy.savez``, read back with ``allow_pickle=False``) and
``STATE_NAME.json`` (layout, counters, the sampling generator's state), both written to a temporary name and
renamed, the arrays first: a crash mid-save leaves the previous pair. The JSON names the arrays file's size, so a
pair from two different saves is refused.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from zddrl import protocol as P
from zddrl.algos.replay_buffer.prioritized import PrioritizedReplay
from zddrl.algos.replay_learner import block_refusal, buffer_for
from zddrl.algos.rollout import mismatch
from zddrl.algos.spec import algorithm_of, sent_arrays
from zddrl.config import Config
from zddrl.envs import EnvSpec
from zddrl.intake.admit import envs_bound, envs_of, refusal
from zddrl.intake.episodes import Episodes
from zddrl.intake.records import record_of
from zddrl.logs import RateLimitedLog

STATE_NAME = "replay_state"
RETURNS_KEPT = 65_536
"""Episode returns waiting for the main learner shard's next report (a learner away for long loses the oldest)."""


class Pending:
    """The intake not yet reported to the main learner shard."""

    def __init__(self) -> None:
        self.env_steps = 0
        self.trajectories = 0
        self.invalid = 0
        self.returns: deque[float] = deque(maxlen=RETURNS_KEPT)
        self.returns_dropped = 0

    def take(self) -> dict[str, Any]:
        """The report's fields (at most ``P.MAX_REPLAY_RETURNS`` returns; the rest wait for the next one)."""
        n = min(len(self.returns), P.MAX_REPLAY_RETURNS)
        returns = [self.returns.popleft() for _ in range(n)]
        report = {"env_steps": self.env_steps, "trajectories": self.trajectories, "invalid": self.invalid}
        self.env_steps = self.trajectories = self.invalid = 0
        return {**report, "ep_returns": returns}


class ReplayStore:
    """``adopt(config, spec)`` per run; ``take_in(msg)`` per trajectory; ``serve(request)`` per learner request."""

    def __init__(self, peer_id: str, state_dir: Path | None, log: Any, seed: int = 0) -> None:
        self.peer_id, self.state_dir, self.log, self.seed = peer_id, state_dir, log, seed
        self.buffer: PrioritizedReplay | None = None
        self.config: Config | None = None
        self.spec: EnvSpec | None = None
        self.declared = P.DeclaredLayout()
        """The run's declared trajectory arrays (docs/protocol.md section 7.1), checked here too."""
        self.priorities = ""
        """The declared array of the actors' TD errors (``ReplayFeed.priorities``), or ""."""
        self.inserted = 0
        self.newest_version = -1
        self.learner_version = 0
        """The newest policy version a learner told us of: what bounds an admitted trajectory's version."""
        self.asked_len = 0
        """The longest per-env rollout length the learner asked for (``admit.refusal``)."""
        self.pending = Pending()
        self.episodes = Episodes()
        self.counters = {"received": 0, "inserted_trajectories": 0, "invalid": 0, "bad_updates": 0, "served": 0}
        self._ratelog = RateLimitedLog()

    # ------------------------------------------------------------------ runs
    def adopt(self, config: Config, spec: EnvSpec) -> str:
        """Serve ``config``'s run: keep the buffer if its layout is the same, else a new one (loaded from the state
        directory when a saved one has this layout). Returns one line saying which."""
        self.config, self.spec = config, spec
        algorithm = algorithm_of(config)
        self.declared = P.declaration_of([a.to_wire() for a in sent_arrays(algorithm, config, spec)])
        self.priorities = algorithm.replay.priorities if algorithm.replay is not None else ""
        self.asked_len = config.env.rollout_len
        self.learner_version = 0
        if self.buffer is not None and self.buffer.layout() == _layout_of(config, spec):
            self.buffer.version_floor = 0  # versions count from 0 again if the learner started afresh
            return f"kept {len(self.buffer)} transitions for run {config.name} (same layout)"
        self.buffer = None  # the old one is freed before the new one is allocated
        self.buffer = buffer_for(config, spec, self.seed)
        mib = self.buffer.nbytes / 2**20
        return self._load() or f"new buffer of {self.buffer.capacity} transitions ({mib:.1f} MiB)"

    def serving(self) -> bool:
        return self.buffer is not None

    # ------------------------------------------------------------------ intake
    def take_in(self, msg: P.Trajectory, fleet: tuple[int, dict] | None) -> None:
        """Insert one trajectory of the run, or refuse it (counted, its actor's episode streams broken where unread)."""
        assert self.buffer is not None and self.config is not None and self.spec is not None
        self.counters["received"] += 1
        envs = envs_of(msg.peer_id, fleet, self.config.env.num_envs, envs_bound(self.config))
        why = refusal(msg.arrays["rewards"].shape, msg.policy_version, self.learner_version, self.asked_len, envs)
        readable = not why
        if not why:
            try:
                bounded = algorithm_of(self.config).bounded_actions
                why = self.declared.refusal_of(msg.arrays) or mismatch(msg.arrays, self.spec, None, bounded)
                why = why or block_refusal(msg.arrays, self.buffer.capacity)
            except Exception as exc:  # noqa: BLE001 - whatever the data, a check that fails refuses it
                why = f"its check failed ({type(exc).__name__}: {exc})"
        record = record_of(msg, True, not why, why, readable=readable)
        finished = self.episodes.add(record.peer_id, record.incarnation, record.seq, record.segments)
        self.pending.returns.extend(ret for ret, _ in finished)
        if why:
            self.counters["invalid"] += 1
            self.pending.invalid += 1
            self._ratelog.warning(
                "invalid", f"refused a trajectory of {msg.peer_id} (seq {msg.seq}): {why} ({self.counters['invalid']})"
            )
            return
        td = msg.arrays.get(self.priorities) if self.priorities else None
        self.buffer.insert_arrays(msg.arrays, msg.policy_version, None if td is None else self.buffer.capped_td(td))
        steps = int(msg.arrays["rewards"].size)
        self.inserted += steps
        self.newest_version = max(self.newest_version, msg.policy_version)
        self.counters["inserted_trajectories"] += 1
        self.pending.env_steps += steps
        self.pending.trajectories += 1

    # ------------------------------------------------------------------ requests
    def serve(self, req: P.ReplaySample, run_id: str) -> P.ReplayBatch:
        """Apply the request's priority updates and version floor, draw its batch, report the buffer's figures."""
        buf = self.buffer
        assert buf is not None
        self.learner_version = max(self.learner_version, req.policy_version)
        self.asked_len = req.rollout_len
        if req.arrays:
            try:
                buf.update_priorities(req.arrays["ids"], req.arrays["td_errors"])
            except ValueError as exc:  # ids this buffer never gave out: the request's updates are skipped
                self.counters["bad_updates"] += 1
                self._ratelog.warning("bad_updates", f"skipped the priority updates of a request: {exc}")
        if req.drop_before >= 0:
            buf.drop_older_than(req.drop_before)
        arrays: dict[str, np.ndarray] = {}
        if req.batch and len(buf):
            b = buf.sample(req.batch)
            arrays = {
                "ids": b.ids,
                "priorities": buf.tree.get(b.ids % buf.capacity).astype(np.float64),
                "obs": b.obs,
                "next_obs": b.next_obs,
                "actions": b.actions,
                "returns": b.returns,
                "discounts": b.discounts,
                "versions": b.versions,
            }
            self.counters["served"] += req.batch
        report = self.pending.take() if req.report else {}
        return P.ReplayBatch(
            run_id=run_id,
            peer_id=self.peer_id,
            request=req.request,
            held=len(buf),
            total=float(buf.tree.total),
            min_priority=float(buf.tree.min) if len(buf) else 0.0,
            max_priority=float(buf.max_priority),
            inserted=self.inserted,
            newest_version=self.newest_version,
            capacity=buf.capacity,
            nbytes=buf.nbytes,
            stale_updates=buf.stale_updates,
            dropped_by_version=buf.dropped_by_version,
            **report,
            arrays=arrays,
        )

    def stats(self) -> dict[str, Any]:
        """For `zddrl status` (the replay's stats message)."""
        buf = self.buffer
        figures: dict[str, Any] = {**self.counters, "inserted": self.inserted}
        if buf is not None:
            figures.update(replay_size=len(buf), replay_fill=round(buf.fill, 4), replay_bytes=buf.nbytes)
        return figures

    # ------------------------------------------------------------------ state
    def save(self) -> Path | None:
        """Write the buffer to the state directory (module docstring); None without one or without a buffer."""
        if self.state_dir is None or self.buffer is None:
            return None
        self.state_dir.mkdir(parents=True, exist_ok=True)
        state = self.buffer.state_dict()
        arrays = {k: np.ascontiguousarray(v) for k, v in state.items() if isinstance(v, np.ndarray)}
        meta = {k: v for k, v in state.items() if not isinstance(v, np.ndarray)}
        npz, js = self.state_dir / f"{STATE_NAME}.npz", self.state_dir / f"{STATE_NAME}.json"
        tmp = self.state_dir / f".{STATE_NAME}.tmp.npz"
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub types the first keyword as allow_pickle
        os.replace(tmp, npz)
        meta.update(inserted=self.inserted, newest_version=self.newest_version, npz_bytes=npz.stat().st_size)
        meta["saved_at"] = time.time()
        tmp_js = self.state_dir / f".{STATE_NAME}.tmp.json"
        tmp_js.write_text(json.dumps(meta))
        os.replace(tmp_js, js)
        return npz

    def _load(self) -> str:
        """Load the saved buffer into ``self.buffer`` if the state directory holds one of its layout; a line to log."""
        if self.state_dir is None or self.buffer is None:
            return ""
        npz, js = self.state_dir / f"{STATE_NAME}.npz", self.state_dir / f"{STATE_NAME}.json"
        if not js.exists() or not npz.exists():
            return ""
        try:
            meta = json.loads(js.read_text())
            if meta.get("npz_bytes") != npz.stat().st_size:
                raise ValueError("its arrays file is not the one its JSON describes (a save was interrupted)")
            if dict(meta["layout"]) != self.buffer.layout():
                return f"new buffer: the saved one in {self.state_dir} has another layout"
            with np.load(npz, allow_pickle=False) as data:
                state = {**meta, **{k: data[k] for k in data.files}}
            self.buffer.load_state_dict(state)
            self.buffer.version_floor = 0
            self.inserted = int(meta.get("inserted", 0))
            self.newest_version = int(meta.get("newest_version", -1))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.log.warning(f"could not load the replay state in {self.state_dir}: {exc}; starting empty")
            self.buffer = buffer_for(self.config, self.spec, self.seed) if self.config and self.spec else None
            return ""
        return f"loaded {len(self.buffer)} transitions from {npz}"


def _layout_of(config: Config, spec: EnvSpec) -> dict[str, Any]:
    """The layout ``buffer_for`` would give ``config``'s run, without allocating it."""
    rc = config.replay
    return {
        "capacity": rc.capacity,
        "obs_shape": list(spec.obs_shape),
        "obs_dtype": np.dtype(spec.obs_dtype).str,
        "action_shape": [] if spec.discrete else [spec.action_dim],
        "action_dtype": np.dtype(np.int64 if spec.discrete else np.float32).str,
        "alpha": float(rc.alpha),
        "gamma": float(config.algo.gamma),
        "n_step": int(rc.n_step),
    }
