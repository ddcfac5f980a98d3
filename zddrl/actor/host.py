"""Actor host: steps N gymnasium envs with the newest policy and pushes one trajectory per rollout.

An actor needs only the broker address. It learns the run spec (env, model, algorithm, schedule,
rollout length, seed) from the welcome and the weights from parameter broadcasts, which its ``BrokerLink`` thread
receives, verifies and decodes off the stepping path. Every trajectory is stamped with the policy
version and parameter hash it was produced with. Under the sync schedule the actor waits for a new version
after each rollout; under the async schedule it never waits and swaps versions between rollouts.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import zmq
from loguru import logger

from zddrl import keys
from zddrl import protocol as P
from zddrl.actor.rollout import Collected, collect
from zddrl.actor.versions import Verdict, VersionState
from zddrl.algos.policy import Policy
from zddrl.algos.spec import ActingVersion, algorithm_of, declared_arrays
from zddrl.config import Config
from zddrl.envs import ActorEnvs, ActorEnvsFactory, EnvSpec, actor_envs
from zddrl.logs import RateLimitedLog
from zddrl.proc import rss_mb
from zddrl.protocol.rules import run_bus
from zddrl.transport.link import BrokerLink, Refused, hello_fields
from zddrl.transport.trust import joinable

WELCOME_TIMEOUT_S = 3600.0
"""An actor may be started long before any learner; it waits (heartbeating) for a run."""
STATS_EVERY_S = 1.0
"""Stats go to the broker at most this often, and at its heartbeat interval once that is longer (it grows with
the fleet: broker/cadence.py)."""
SEND_POLL_MS = 100
TRAJECTORY_SNDHWM = 4
"""ZMQ_SNDHWM of the trajectories PUSH: what may wait in ZeroMQ's queue (the run's ``bus.max_in_flight``, from the
welcome, bounds what the broker has not credited yet). Not max_in_flight itself: libzmq's lagged view of what its
I/O thread has taken would refuse sends that the credit allows."""
REFUSED_RUN_WAIT_S = 1.0
"""After refusing a run, how often the actor looks for another welcome (it waits, never spins)."""


def env_seeds(base_seed: int, actor_id: int, num_envs: int) -> list[int]:
    """Seed stream of each env: ``base_seed + actor_id * 1000 + env_index``."""
    return [base_seed + actor_id * 1000 + i for i in range(num_envs)]


def action_rng(base_seed: int, actor_id: int) -> np.random.Generator:
    """The actor's own generator for action sampling, independent of the env streams."""
    return np.random.default_rng([base_seed + actor_id * 1000, 0xAC7])


def first_obs_hash(obs: np.ndarray) -> str:
    """Short hash of env 0's first observation after the first reset (stats key ``first_obs_hash``), or "".

    The broker warns when two actors report the same one: their seeds are not split. Env 0 only,
    so that two actors given the same --actor-id but different --envs still collide. "" (no claim) when the
    actor's own envs, seeded apart, all start from the same observation: such a first frame says nothing about
    seeds (Pong's is the same whatever the seed), and every actor would report it."""
    if len(obs) > 1 and all(np.array_equal(obs[0], other) for other in obs[1:]):
        return ""
    return hashlib.sha1(np.ascontiguousarray(obs[0], dtype=np.float32).tobytes()).hexdigest()[:16]


@dataclass
class ActorTimers:
    """Where an actor's wall time goes; the basis of its comm-share and waiting figures."""

    started: float = field(default_factory=time.monotonic)
    env_steps: int = 0
    step_s: float = 0.0
    wait_params_s: float = 0.0
    send_s: float = 0.0
    """Encoding and handing trajectories to the socket: communication proper."""
    backpressure_s: float = 0.0
    """Waiting for the broker to read earlier trajectories (the learner is the bottleneck)."""
    rollouts: int = 0
    nonfinite_episodes: int = 0
    refused_versions: int = 0
    """Parameter versions this actor could not act with (unusable_params), kept out of use."""
    refused_runs: int = 0
    """Runs this actor would not join: a spec not signed by a pinned key, or an env it does not allow."""
    _mark: tuple[float, int, float, float] | None = field(default=None, repr=False)
    """(time, env_steps, send seconds, waiting seconds) at the previous report."""

    def stats(self) -> dict[str, float]:
        """Totals since start; ``sps`` and ``comm_share`` over the interval since the previous call.

        Rates are per interval, not since start: a lifetime average hides a collapse or a stall
        for ever longer as a run goes on, and the broker's health checks (sps_collapse, comm_share)
        and `zddrl status --watch` need what the actor does now."""
        now = time.monotonic()
        waiting = self.wait_params_s + self.backpressure_s
        since, steps0, send0, waiting0 = self._mark or (self.started, 0, 0.0, 0.0)
        self._mark = (now, self.env_steps, self.send_s, waiting)
        window = max(now - since, 1e-9)
        return {
            "env_steps": self.env_steps,
            "sps": (self.env_steps - steps0) / window,
            "rollouts": self.rollouts,
            "nonfinite_episodes": self.nonfinite_episodes,
            "refused_versions": self.refused_versions,
            "refused_runs": self.refused_runs,
            "wait_params_s": self.wait_params_s,
            "backpressure_s": self.backpressure_s,
            "send_s": self.send_s,
            "comm_share": min(max((self.send_s - send0) / window, 0.0), 1.0),
            "wait_share": min(max((waiting - waiting0) / window, 0.0), 1.0),
        }


MAX_ROLLOUT_LEN = 1 << 16
"""Most steps per env a parameter version may ask of a rollout (``meta.rollout_len``); a rollout must also fit the
broker's message limit. A version that asks for more is refused, not obeyed: one bogus number must not make every
actor allocate gigabytes."""


def rollout_len(params: P.Parameters, config: Config) -> int:
    """Steps per env of the next rollout: the version's ``meta.rollout_len`` (sync mode sizes it from the fleet)."""
    return int(params.meta.get("rollout_len", config.env.rollout_len))


def build_policy(
    flat: np.ndarray,
    layout: list,
    extras: Mapping[str, np.ndarray],
    config: Config,
    spec: EnvSpec,
    actor_id: int = 0,
    num_envs: int = 0,
) -> Policy:
    """The run's acting policy from a version's buffer, layout and extra arrays (the algorithm's spec builds it);
    raises on a layout that does not build it. ``actor_id`` and this host's ``num_envs`` (0: the config's) place
    its envs in the fleet (Ape-X's epsilon schedule)."""
    version = ActingVersion(flat, layout, extras, config, spec, actor_id, num_envs or config.env.num_envs)
    return algorithm_of(config).acting_policy(version)


def policy_of(
    params: P.Parameters, config: Config, vec: ActorEnvs, max_message_bytes: int, actor_id: int = 0
) -> tuple[Policy | None, str]:
    """``(policy, "")`` for a version this actor can act with, or ``(None, why)``: its layout must build a
    network for this env (observation and action sizes), its numbers must be finite, and the rollout it asks for
    must be a size the actor can hold and the broker would take."""
    T = params.meta.get("rollout_len", config.env.rollout_len)
    if not isinstance(T, int) or isinstance(T, bool) or not 1 <= T <= MAX_ROLLOUT_LEN:
        return None, f"meta.rollout_len {T!r} is not an int in 1..{MAX_ROLLOUT_LEN}"
    obs_bytes = vec.dtype.itemsize * int(np.prod(vec.spec.obs_shape))
    step_bytes = vec.num_envs * (obs_bytes + 4 * max(vec.spec.action_dim, 2) + 4 * 4 + 2)
    if T * step_bytes > max_message_bytes:
        return (
            None,
            f"a rollout of {T} steps (~{T * step_bytes} bytes) would exceed max_message_bytes {max_message_bytes}",
        )
    try:
        arrays = params.arrays
        policy = build_policy(arrays["flat"], params.layout, arrays, config, vec.spec, actor_id, vec.num_envs)
        if not policy.outputs:
            return None, "its layout does not build this run's network (no policy or no value layers)"
        values = policy.value(vec.obs)
        outputs = policy.outputs
    except Exception as exc:  # noqa: BLE001 - a version that does not build is refused, whatever the defect
        return None, f"its layout does not build this run's network ({type(exc).__name__}: {exc})"
    if outputs != vec.spec.action_dim:
        return None, f"its policy has {outputs} outputs, the env has {vec.spec.action_dim} actions"
    if values.shape != (vec.num_envs,) or not np.isfinite(values).all():
        return None, "its value network gives non-finite or misshapen values"
    return policy, ""


def encode_rollout(msg: P.Trajectory, limit: int = 0) -> list:
    """``msg``'s frames, checked as the broker will check them: what it would drop as malformed (a rollout
    over its ``max_message_bytes`` limit, or arrays that break the trajectory rules) is this actor's own
    defect, so it fails here, loudly, instead of being dropped and counted one message at a time."""
    frames = P.encode(msg)
    if limit and P.message_nbytes(frames) > limit:
        raise ValueError(
            f"a rollout of {P.message_nbytes(frames)} bytes exceeds the broker's "
            f"max_message_bytes {limit}: lower env.rollout_len or --envs"
        )
    P.validate_trajectory(frames, limit or P.DEFAULT_MAX_MESSAGE_BYTES)  # a few us: layouts are checked once
    return frames


class ActorHost:
    """``ActorHost(connect, actor_id).run(stop)``: serve until ``stop`` is set or ``max_steps`` are done.
    ``actor_id`` None: the broker assigns it (``--actor-id auto``), in the welcome, before any env is made."""

    def __init__(
        self,
        connect: str,
        actor_id: int | None,
        num_envs: int | None = None,
        *,
        peer_id: str | None = None,
        make_envs: ActorEnvsFactory = actor_envs,
        max_steps: int | None = None,
        context: zmq.Context | None = None,
        allowed_code: frozenset[str] = frozenset(),
        credentials: keys.Credentials | None = None,
    ) -> None:
        self.connect = connect
        self.allowed_code = frozenset(allowed_code)
        """The ``module:callable`` env ids this host may import and call (envs.env_refusal); ids of the local
        gymnasium registry need no allowing."""
        self.credentials = credentials
        """With keys: only runs and versions signed by one of ``credentials.pins`` are used."""
        self.auto_id = actor_id is None
        """The broker assigns this host's id: ``actor_id`` and ``peer_id`` are its welcome's (``_adopt_id``)."""
        self.actor_id = actor_id or 0
        self.num_envs = num_envs
        self.peer_id = "" if actor_id is None else peer_id or f"actor-{actor_id}"
        self.make_envs = make_envs
        """Builds the envs of each run it serves (``actor_envs``; ``envs.SlowEnvs`` for slow ones)."""
        self.max_steps = max_steps
        self.ctx = context or zmq.Context.instance()
        self.log = logger.bind(role="actor", peer=self.peer_id)
        self.timers = ActorTimers()
        self._ratelog = RateLimitedLog()
        self.incarnation = uuid.uuid4().hex[:12]
        """This process's name in its trajectories: totals of one incarnation form one stream (progress.py)."""
        self.seq = 0

    def run(self, stop: threading.Event) -> None:
        hello = P.Hello(
            role="actor", peer_id=self.peer_id, num_envs=self.num_envs or 0, auto_id=self.auto_id, **hello_fields()
        )
        link = BrokerLink(
            self.connect, hello, subscribe_params=True, context=self.ctx, credentials=self.credentials
        ).start()
        refused_generation = -1  # the link generation whose run this host refused: judged once, then waited out
        try:
            while not stop.is_set() and not self._done():
                link.wait_welcome(timeout_s=1.0, need_run=True)
                # The generation first: a welcome that lands in between is judged now and again next time,
                # never skipped.
                generation, welcome = link.generation, link.welcome
                if link.refused:
                    raise Refused(link.refused)
                self._adopt_id(link)
                if welcome is None or welcome.run is None:
                    continue
                if generation == refused_generation:  # the refused run is still the broker's: wait for another welcome
                    stop.wait(REFUSED_RUN_WAIT_S)
                    continue
                config, why = joinable(welcome, self.credentials, self.allowed_code)
                if config is None:
                    refused_generation = generation
                    self._refuse_run(link, welcome.run_id, why)
                    continue
                self._serve_run(link, config, welcome.run_id, stop)
        except (KeyboardInterrupt, SystemExit):
            raise  # asked to stop: an ordinary bye
        except BaseException as exc:
            # The traceback would otherwise be only in this host's own log; the broker keeps it in
            # `zddrl status` (departures). Re-raised: the process still dies with it, as before.
            link.report_crash(exc)
            raise
        finally:
            link.close(reason="actor stopping")

    def _adopt_id(self, link: BrokerLink) -> None:
        """``--actor-id auto``: take the id the broker's welcome assigned (ids place the seed streams: envs made from
        now on follow it). Raises Refused for an id that is not ``actor-N``."""
        peer_id = link.peer_id
        if not self.auto_id or not peer_id or peer_id == self.peer_id:
            return
        digits = peer_id.removeprefix("actor-")
        if digits == peer_id or not (digits.isascii() and digits.isdigit()):
            raise Refused(f"the broker assigned the peer id {peer_id!r}, which is not actor-N")
        if self.peer_id:  # a reconnection found our id taken: this run's envs keep the seeds of the old one
            self.log.warning(f"the broker assigned {peer_id} after a reconnection (we were {self.peer_id})")
        self.actor_id, self.peer_id = int(digits), peer_id
        self.log = logger.bind(role="actor", peer=peer_id)
        self.log.info(f"the broker assigned actor id {self.actor_id} ({peer_id})")

    def _refuse_run(self, link: BrokerLink, run_id: str, why: str) -> None:
        self.timers.refused_runs += 1
        self.log.warning(f"refused run {run_id!r}: {why}; waiting for another run")
        stats = {"refused_runs": self.timers.refused_runs, "refused_versions": self._refused_versions(link)}
        link.send(P.Stats(peer_id=self.peer_id, role="actor", stats=stats))

    def _refused_versions(self, link: BrokerLink) -> int:
        """Versions refused as unusable here, and (with keys) by the link for their signature."""
        return self.timers.refused_versions + link.assembler.rejected["signature"]

    def _done(self) -> bool:
        return self.max_steps is not None and self.timers.env_steps >= self.max_steps

    def _serve_run(self, link: BrokerLink, config: Config, run_id: str, stop: threading.Event) -> None:
        """Sample for one run until it changes, the actor is stopped, or its step budget is spent."""
        num_envs = self.num_envs or config.env.num_envs
        seeds = env_seeds(config.env.seed, self.actor_id, num_envs)
        vec = self.make_envs(config.env, seeds, self.allowed_code)
        first_obs = first_obs_hash(vec.obs)
        rng = action_rng(config.env.seed, self.actor_id)
        self.log.info(
            f"run {run_id}: {num_envs} x {config.env.id}, seeds {seeds[0]}..{seeds[-1]}, {config.algo.name} "
            f"({config.algo.schedule})"
        )
        generation, push = link.generation, self._push(link)
        versions = VersionState(sync=config.algo.schedule == "sync")
        limit = link.welcome.max_message_bytes if link.welcome is not None else P.DEFAULT_MAX_MESSAGE_BYTES

        def judge(version: P.Parameters) -> tuple[Policy | None, str]:
            return policy_of(version, config, vec, limit, self.actor_id)  # the id a re-welcome assigned, if any

        next_stats = 0.0
        try:
            while not stop.is_set() and not self._done():
                if link.refused:  # a re-hello was refused (another process holds our peer id): the link has stopped
                    raise Refused(link.refused)
                welcome = link.welcome
                if welcome is None or (welcome.run_id and welcome.run_id != run_id):
                    return  # another run (a "" run id is a restarted broker: same run, keep going)
                if link.generation != generation:  # re-welcomed: ports may have moved
                    push.close(linger=0)
                    generation, push = link.generation, self._push(link)
                    self._adopt_id(link)
                    versions.relinked()
                held = versions.wanted()
                newest = held if held is not None else self._next_params(link, versions)
                if newest is None or newest.run_id != run_id:
                    continue
                if versions.offer(newest, judge) is Verdict.REFUSED:
                    self.timers.refused_versions += 1
                    why = f"refused version {newest.policy_version}: {versions.why}"
                    self._ratelog.warning("refused_params", why)
                acting = versions.acting
                if acting is None:
                    continue  # nothing usable yet; a sync run samples only with the newest version (wait for one)
                params, policy = acting
                T = rollout_len(params, config)
                rollout = self._collect(vec, policy, rng, T, config)
                window = run_bus(welcome.bus).max_in_flight  # the broker returns credit by this one, not the spec's
                self._send(link, push, run_id, params, rollout, T * num_envs, stop, window)
                if time.monotonic() >= next_stats:
                    self._report(link, run_id, params, num_envs, first_obs)
                    next_stats = time.monotonic() + max(STATS_EVERY_S, link.interval_s)
        finally:
            push.close(linger=0)
            vec.close()

    def _collect(self, vec: ActorEnvs, policy: Policy, rng: np.random.Generator, T: int, config: Config) -> Collected:
        """One rollout (``collect``, with the algorithm's declared arrays), timed; an env's non-finite episode return
        is said once per interval."""
        env_id = config.env.id
        t0 = time.monotonic()
        rollout = collect(vec, policy, rng, T, declared_arrays(algorithm_of(config), config, vec.spec))
        self.timers.step_s += time.monotonic() - t0
        if rollout.nonfinite_episodes:
            self.timers.nonfinite_episodes += rollout.nonfinite_episodes
            self._ratelog.warning(
                "nonfinite_return",
                f"{env_id} ended an episode with a non-finite return (a NaN or infinite reward): the learner drops "
                "the rollouts that carry one",
            )
        return rollout

    def _report(self, link: BrokerLink, run_id: str, params: P.Parameters, num_envs: int, first_obs: str) -> None:
        """Stats for `zddrl status` and the broker's health checks; repeated warnings held back so far go out too."""
        stats = {
            **self.timers.stats(),
            "refused_versions": self._refused_versions(link),
            "num_envs": num_envs,
            "run_id": run_id,
            "policy_version": params.policy_version,
            "param_hash": params.param_hash,
            "reconnects": link.reconnects,
            "rss_mb": round(rss_mb(), 1),
            "first_obs_hash": first_obs,
        }
        link.send(P.Stats(peer_id=self.peer_id, role="actor", stats=stats))
        self._ratelog.flush()

    def _next_params(self, link: BrokerLink, versions: VersionState) -> P.Parameters | None:
        """Sync, or none usable yet: wait for a version newer than every one judged (used or refused). Async: the
        newest the link holds, no waiting."""
        if not versions.sync and versions.params is not None:
            return link.latest_params()
        t0 = time.monotonic()
        newest = link.wait_params(newer_than=versions.judged, timeout_s=0.5)
        self.timers.wait_params_s += time.monotonic() - t0
        return newest

    def _push(self, link: BrokerLink) -> zmq.Socket:
        push = link.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, TRAJECTORY_SNDHWM)
        push.connect(link.endpoint("trajectories"))
        return push

    def _send(
        self,
        link: BrokerLink,
        push: zmq.Socket,
        run_id: str,
        params: P.Parameters,
        rollout: Collected,
        env_steps: int,
        stop: threading.Event,
        max_in_flight: int,
    ) -> None:
        self.timers.env_steps += env_steps
        self.timers.rollouts += 1
        msg = P.Trajectory(
            run_id=run_id,
            peer_id=self.peer_id,
            seq=self.seq,
            policy_version=params.policy_version,
            param_hash=params.param_hash,
            env_steps=env_steps,
            arrays=rollout.arrays,
            info={
                "actor_id": self.actor_id,
                "num_envs": int(rollout.arrays["rewards"].shape[1]),
                "total_env_steps": self.timers.env_steps,
                "incarnation": self.incarnation,
            },
            ep_returns=rollout.ep_returns,
            ep_lengths=rollout.ep_lengths,
        )
        self.seq += 1
        t0 = time.monotonic()
        frames = encode_rollout(msg, link.welcome.max_message_bytes if link.welcome is not None else 0)
        generation = link.generation
        t_wait = time.monotonic()
        # Backpressure, stoppable: wait for the broker to read enough of what this actor sent (ZeroMQ's
        # queues and the kernel's would otherwise hold many rollouts, each older by the time it is used).
        while not stop.is_set() and link.generation == generation:
            if link.wait_in_flight_below(max_in_flight, SEND_POLL_MS / 1000):
                break
        waited = time.monotonic() - t_wait
        self.timers.backpressure_s += waited
        while not stop.is_set():
            if push.poll(SEND_POLL_MS, zmq.POLLOUT):
                push.send_multipart(frames, copy=False)
                link.note_sent(generation)
                break
            if link.generation != generation:  # welcomed anew (maybe by another broker of the list): this push
                break  # may lead to a broker gone for good, whose full queue never drains; the caller rebuilds it
        self.timers.send_s += time.monotonic() - t0 - waited
