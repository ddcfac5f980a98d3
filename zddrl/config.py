"""Typed configuration: frozen dataclasses, loaded from TOML, overridden from the CLI.

This module is the one source of defaults. A run config has seven sections::

    [env]    what the actors step          [algo]    how the learner learns (the algorithm's keys)
    [model]  the policy/value network      [replay]  the buffer of the replay algorithms
    [train]  limits of `zddrl train`       [learner] its shards, threads, rounds and parameter transport
    [bus]    what the brokers read of the run: the actors' window, the staleness bound

``load_config(path, overrides)`` reads a TOML file, applies dotted ``section.key=value`` overrides
and validates everything (``zddrl.tomlconf``); an unknown key or a bad value is a :class:`ConfigError` whose
text names the key. The run spec that actors receive from the broker is ``config.to_dict()`` and is rebuilt
on their side with ``Config.from_dict`` (same validation).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zddrl import plugin
from zddrl.algoconf import MOVED_KEYS, algo_from_table, reset_for
from zddrl.algoconf import SCHEDULES as SCHEDULES
from zddrl.algoconf import SHARED_ALGO_KEYS as SHARED_ALGO_KEYS
from zddrl.algoconf import AlgoConfig as AlgoConfig
from zddrl.algoconf import algorithm_spec as algorithm_spec
from zddrl.algoconf import kind_label as kind_label
from zddrl.algoconf import run_kind as run_kind
from zddrl.algoconf import run_kind_args as run_kind_args
from zddrl.brokerconf import BrokerConfig as BrokerConfig  # re-exported, as ConfigError below
from zddrl.brokerconf import ipc_endpoint as ipc_endpoint
from zddrl.brokerconf import is_ipc as is_ipc
from zddrl.brokerconf import load_broker_config as load_broker_config
from zddrl.brokerconf import private_bus_dir as private_bus_dir
from zddrl.brokerconf import socket_endpoint as socket_endpoint
from zddrl.brokerconf import split_endpoint as split_endpoint
from zddrl.brokerconf import split_endpoints as split_endpoints
from zddrl.protocol import PARAM_DTYPES as WIRE_PARAM_DTYPES
from zddrl.tomlconf import ConfigError as ConfigError  # re-exported: callers read every config name from here
from zddrl.tomlconf import build as _build
from zddrl.tomlconf import parse_override as parse_override
from zddrl.tomlconf import require as _require
from zddrl.tomlconf import to_toml as to_toml
from zddrl.tomlconf import unknown_section

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TARGET_KINDS = ("train", "eval")
PLACEMENTS = ("learner", "service")
ACTIVATIONS = ("tanh", "relu", "silu", "gelu", "elu", "leaky_relu")
MODEL_KINDS = ("mlp", "nature_cnn", "impala_cnn", "small_cnn")
AUTOCASTS = ("auto", "off", "bf16")
WANDB_MODES = ("online", "offline", "disabled")
ENV_BACKENDS = ("gymnasium", "ale_vector")


@dataclass(frozen=True)
class EnvConfig:
    id: str = "CartPole-v1"
    """A registered gymnasium id, or ``package.module:callable`` returning a gymnasium.Env."""
    num_envs: int = 4
    """Envs per actor host (an actor's ``--envs`` overrides it)."""
    rollout_len: int = 32
    """Steps per env per trajectory message. In sync mode the learner adapts it to keep batch_size fixed."""
    seed: int = 1
    """Base seed: env ``i`` of actor ``a`` uses ``seed + a * 1000 + i``."""
    max_episode_steps: int = 0
    """Time limit override; 0 keeps the env's registered limit."""
    atari: bool = False
    """Atari from pixels (an ALE id such as ``ALE/Breakout-v5``; needs ``gymnasium[atari]``): gymnasium's
    AtariPreprocessing (``noop_max`` no-op starts, 4 frames per step, ``screen_size`` grayscale uint8), FIRE at reset
    in the games that need it, and the last ``frame_stack`` frames stacked (zddrl.envs.atari_wrappers)."""
    frame_stack: int = 4
    """Frames stacked into one observation with ``atari`` (1: no stacking)."""
    noop_max: int = 30
    """With ``atari``: at most this many random no-op steps after each reset (0: none)."""
    screen_size: int = 84
    """With ``atari``: frames are resized to ``screen_size`` x ``screen_size`` (84: Mnih et al. 2015; 42: the
    cheaper input RLlib's and PARL's fast Pong/IMPALA examples use, a quarter of the pixels)."""
    repeat_action_probability: float = 0.25
    """With ``atari``: ALE's sticky actions, the chance that the emulator repeats the previous action on each frame
    instead of the chosen one (0.25: ALE v5's default after Machado et al. 2018; 0: the deterministic
    ``NoFrameskip-v4`` games most published Atari curves were measured on)."""
    clip_rewards: bool = False
    """The learner trains on the sign of each reward (Mnih et al. 2015); trajectories carry the env's own
    rewards, so the episode returns every metric reports are the true ones."""
    episodic_life: bool = False
    """With ``atari``: a lost life is a terminal for the learner's returns (no bootstrap across it) and FIRE is
    pressed after it in the games that wait for it, while the game goes on and metrics report whole games (the
    DQN/IMPALA/SB3/CleanRL Atari setting; Machado et al. 2018 advise against it when evaluating)."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the env's constructor (``gymnasium.make(id, **kwargs)`` or the ``module:callable``),
    an inline TOML table such as ``kwargs = { size = 8 }``."""
    backend: str = "gymnasium"
    """How an actor steps its envs: ``gymnasium`` (each env a gymnasium env with zddrl's wrappers, one after the
    other: the reference) or, for ALE v5 ids with ``atari``, ``ale_vector`` (ALE's own C++ vector env, its
    preprocessing matched to the reference: docs/configuration.md)."""

    def __post_init__(self) -> None:
        _require(bool(self.id), "env.id must name a gymnasium env or a 'module:callable'")
        _require(self.num_envs >= 1, f"env.num_envs must be >= 1, got {self.num_envs}")
        _require(self.rollout_len >= 1, f"env.rollout_len must be >= 1, got {self.rollout_len}")
        _require(self.max_episode_steps >= 0, "env.max_episode_steps must be >= 0")
        _require(1 <= self.frame_stack <= 16, f"env.frame_stack must be in 1..16, got {self.frame_stack}")
        _require(self.noop_max >= 0, f"env.noop_max must be >= 0, got {self.noop_max}")
        _require(16 <= self.screen_size <= 210, f"env.screen_size must be in 16..210, got {self.screen_size}")
        _require(
            0.0 <= self.repeat_action_probability < 1.0,
            f"env.repeat_action_probability must be in [0, 1), got {self.repeat_action_probability}",
        )
        _require(self.atari or not self.episodic_life, "env.episodic_life needs env.atari (ALE reports the lives)")
        _require(self.backend in ENV_BACKENDS, f"env.backend must be one of {ENV_BACKENDS}, got {self.backend!r}")
        _require(self.backend != "ale_vector" or self.atari, "env.backend 'ale_vector' needs env.atari (ALE ids)")
        _require(
            self.backend != "ale_vector" or not self.episodic_life,
            "env.episodic_life needs env.backend 'gymnasium' (ALE's vector env ends an episode at each lost life)",
        )


@dataclass(frozen=True)
class ModelConfig:
    kind: str = "mlp"
    """mlp (separate policy and value MLPs, vector observations) | nature_cnn (Mnih et al. 2015) | impala_cnn
    (Espeholt et al. 2018's ResNet torso) | small_cnn (RLlib's network for 42x42 frames: zddrl.algos.cnn) |
    ``package.module:make``, a network of your own for the actor-critic algorithms (docs/extending.md). The
    CNNs share one torso between the policy and value heads and take ``[C, H, W]`` observations (uint8 pixels
    scaled to [0, 1] inside the network)."""
    hidden: tuple[int, ...] = (64, 64)
    """Hidden layer sizes of the policy and of the (separate) value network; the CNNs use ``hidden[0]`` as the
    width of the fully connected layer after the torso (the papers: 512 for nature_cnn, 256 for impala_cnn and
    small_cnn)."""
    activation: str = "tanh"
    """tanh | relu | silu | gelu | elu | leaky_relu (torch's, with its default parameters: the MLP's; the CNNs use
    ReLU, as the papers do)."""
    log_std_init: float = 0.0
    """Initial log standard deviation of the Gaussian policy (Box action spaces)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for a ``model.kind`` of your own: ``make(env, model, **kwargs)``, an inline TOML table such
    as ``kwargs = { width = 128 }`` or a ``[model.kwargs]`` table."""

    @property
    def is_custom(self) -> bool:
        """A network of the user's own (``module:callable``)."""
        return self.kind not in MODEL_KINDS

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", tuple(self.hidden))
        _require(
            self.kind in MODEL_KINDS or plugin.is_reference(self.kind),
            f"model.kind must be one of {MODEL_KINDS} or a 'package.module:make' of your own, got {self.kind!r}",
        )
        _require(len(self.hidden) >= 1 and all(h >= 1 for h in self.hidden), "model.hidden must be positive sizes")
        _require(self.activation in ACTIVATIONS, f"model.activation must be one of {ACTIVATIONS}")
        _require(
            not self.kwargs or self.is_custom,
            f"model.kwargs are for a model.kind of your own ('package.module:make'), not the built-in {self.kind!r}",
        )


@dataclass(frozen=True)
class ReplayConfig:
    """The replay buffer of apex and sac (algos/replay_buffer/prioritized.py), one per learner shard."""

    capacity: int = 100_000
    """Transitions held (per learner shard, or per replay service); a capacity that would not fit in memory is an
    error at start."""
    batch_size: int = 256
    """Transitions per gradient step."""
    learning_starts: int = 1000
    """Transitions in the buffer (all shards) before the first gradient step."""
    replay_ratio: float = 0.25
    """Gradient steps per env step taken in. Enforced by throttling intake: an update takes in ``algo.batch_size``
    env steps, then takes its gradient steps before it reads more, so the actors wait on credit meanwhile."""
    alpha: float = 0.6
    """Priority exponent (0: uniform sampling)."""
    beta: float = 0.4
    """Initial importance-sampling exponent, annealed to 1 over ``beta_steps`` gradient steps."""
    beta_steps: int = 100_000
    """Gradient steps over which beta reaches 1."""
    n_step: int = 3
    """Rewards summed per stored transition (n-step returns)."""
    max_version_age: int = 0
    """Retire transitions acted by a policy more than this many versions older than the newest data (0: keep)."""
    memory_fraction: float = 0.8
    """Share of the memory available at start the buffer may take."""
    placement: str = "learner"
    """Where the buffer lives: ``learner`` (a ring inside each learner shard) or ``service`` (``zddrl replay``
    processes on the bus take the run's trajectories and serve sampled batches; `zddrl train` starts one)."""

    def __post_init__(self) -> None:
        _require(self.capacity >= 1 and self.batch_size >= 1, "replay.capacity and replay.batch_size must be >= 1")
        _require(self.learning_starts >= 0, "replay.learning_starts must be >= 0")
        _require(0.0 < self.replay_ratio <= 1024, "replay.replay_ratio must be in (0, 1024]")
        _require(self.alpha >= 0 and 0.0 <= self.beta <= 1.0, "replay.alpha >= 0 and replay.beta in [0, 1]")
        _require(self.beta_steps >= 1 and self.n_step >= 1, "replay.beta_steps and replay.n_step must be >= 1")
        _require(self.max_version_age >= 0, "replay.max_version_age must be >= 0")
        _require(0.0 < self.memory_fraction <= 1.0, "replay.memory_fraction must be in (0, 1]")
        _require(self.placement in PLACEMENTS, f"replay.placement must be one of {PLACEMENTS}")


@dataclass(frozen=True)
class TrainConfig:
    actors: int = 2
    """Actor processes `zddrl train` starts."""
    until_return: float = math.inf
    """Stop once the target return (``target_kind``) reaches this."""
    target_kind: str = "train"
    """What ``until_return`` is compared with: ``train`` (mean of the last 20 training episodes) or ``eval`` (mean
    of ``eval_episodes`` deterministic episodes the learner runs every ``eval_every`` env steps)."""
    eval_every: int = 0
    """Env steps between the learner's deterministic evaluations (0: none)."""
    eval_episodes: int = 10
    """Episodes per evaluation, one per env, each env seeded from ``env.seed + 1_000_000`` on."""
    confirm_target: bool = True
    """With ``target_kind = "train"``: a training return that reaches ``until_return`` ends the run only once the
    learner's own evaluation (``eval_episodes`` deterministic episodes with the current network) reaches it too, so
    that no actor's rewards alone can end a run; retried while the training return stays there, at most 10 % of
    the learner's time. false: the training return alone (a fleet you fully trust)."""
    max_actor_envs: int = 0
    """Most envs the learner counts one actor with, whatever its hello claims (never fewer than ``env.num_envs``;
    0: 16 x ``env.num_envs``): a rollout of more than 2 x the asked length times this many steps is refused. Sync
    rollouts are sized from the env columns actors have actually delivered, never from claims."""
    checkpoint_replay: bool = False
    """apex/sac: checkpoints hold the replay buffer too (``--resume`` restores it)."""
    max_steps: int = 1_000_000
    """Stop after this many env steps (summed over actors)."""
    max_seconds: float = 600.0
    """Stop after this many seconds since the command started."""
    run_dir: str = "runs"
    """Parent folder of run directories (each run gets its own sub-folder)."""
    checkpoint_every: int = 0
    """Checkpoint every this many updates (0: only by time and at the end)."""
    checkpoint_every_s: float = 60.0
    """Checkpoint at least this often (seconds); the first follows the first update, a final one always."""
    keep_checkpoints: int = 3
    """Periodic checkpoints kept (the newest ones)."""
    video_every: int = 0
    """`zddrl train` films one greedy episode of the policy every this many updates and the final policy's at the end
    (0: never), into ``RUN_DIR/videos/version-NNNNNNNN/episode-000.mp4`` (ops/filming.py: at the lowest priority; the
    learner checkpoints at each such update; needs the ``video`` extra)."""
    video_max_steps: int = 4500
    """Agent steps a filmed episode is cut at (4,500: five minutes of an Atari game)."""
    slowdowns: tuple[float, ...] = ()
    """Testing/benchmark knob: ``--slowdown`` of actor 0, 1, ...: its envs that many times slower per step
    (``envs.SlowEnvs``; missing ones run at full speed)."""
    actor_nice: int = 5
    """Niceness `zddrl train` adds to its actor processes, so that on a host with fewer cores than processes the
    learner, the critical path (its start-up, every update), is served first (0: equal shares; no effect while cores
    are free)."""
    env_latency_ms: float = 0.0
    """Benchmark knob: every actor's env steps each sleep this long first (``zddrl actor --env-latency-ms``,
    ``envs.SlowEnvs``), as a remote or slow simulator would; the scaling curve (``python -m benchmarks scale``) is
    measured with it."""
    max_restarts: int = 3
    """`zddrl train` restarts a learner (or shard group) that dies unexpectedly at most this many times, with
    back-off, from the newest checkpoint (afresh if there is none yet); then the run fails (0: never restart)."""
    wandb_project: str = ""
    """Weights & Biases project the learner logs the run to (the metrics.csv figures, under TensorBoard's names, and
    the config); "" for none. Needs the ``wandb`` extra and, online, ``wandb login`` or ``WANDB_API_KEY``."""
    wandb_run_name: str = ""
    """The W&B run's display name ("": the run directory's name)."""
    wandb_mode: str = "online"
    """online | offline (files under RUN_DIR/wandb, for ``wandb sync`` later) | disabled. ``WANDB_MODE`` in the
    learner's environment takes precedence, as wandb documents."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "slowdowns", tuple(self.slowdowns))
        _require(self.actors >= 1, "train.actors must be >= 1")
        _require(self.max_restarts >= 0, "train.max_restarts must be >= 0 (0: a learner that dies ends the run)")
        _require(self.wandb_mode in WANDB_MODES, f"train.wandb_mode must be one of {WANDB_MODES}")
        _require(all(f >= 1.0 for f in self.slowdowns), "train.slowdowns must be factors >= 1")
        _require(0 <= self.actor_nice <= 19, "train.actor_nice must be in 0..19 (a niceness added to the actors)")
        _require(self.env_latency_ms >= 0, "train.env_latency_ms must be >= 0 (0: envs run at their own speed)")
        _require(
            self.checkpoint_every >= 0 and self.checkpoint_every_s > 0 and self.keep_checkpoints >= 1,
            "train.checkpoint_every >= 0, train.checkpoint_every_s > 0, train.keep_checkpoints >= 1",
        )
        _require(self.max_steps >= 1 and self.max_seconds > 0, "train.max_steps and train.max_seconds must be > 0")
        _require(
            self.video_every >= 0 and self.video_max_steps >= 1, "train.video_every >= 0, train.video_max_steps >= 1"
        )
        _require(self.target_kind in TARGET_KINDS, f"train.target_kind must be one of {TARGET_KINDS}")
        _require(self.eval_every >= 0 and self.eval_episodes >= 1, "train.eval_every >= 0, train.eval_episodes >= 1")
        _require(self.max_actor_envs >= 0, "train.max_actor_envs must be >= 0 (0: 16 x env.num_envs)")
        _require(
            self.target_kind != "eval" or self.eval_every > 0,
            "train.target_kind = 'eval' needs train.eval_every > 0 (the evaluations are the target)",
        )


PARAM_DTYPES = tuple(WIRE_PARAM_DTYPES)
NONE_IS_INF = frozenset({"train.until_return"})
"""Keys whose infinite default travels as null (``Config.to_dict``)."""


def parse_gpus(gpus: str) -> tuple[str, tuple[int, ...]]:
    """``--gpus`` syntax -> ``("auto", ())``, ``("cpu", (N,))`` or ``("cuda", ids)``; ValueError if malformed.

    Needs no device: the config checks it, so that a typo is a usage error before anything starts."""
    spec = gpus.strip().lower()
    if spec in ("", "auto"):
        return "auto", ()
    if spec == "cpu" or spec.startswith("cpu:"):
        count = spec.partition(":")[2] or "1"
        if not count.isdigit() or not 1 <= int(count) <= 64:
            raise ValueError(f"--gpus {gpus!r}: cpu:N needs N in 1..64")
        return "cpu", (int(count),)
    try:
        ids = tuple(int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"--gpus {gpus!r}: expected 'auto', GPU indices like '0,1', or 'cpu:N'") from None
    if len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(f"--gpus {gpus!r}: GPU indices must be distinct and >= 0")
    return "cuda", ids


@dataclass(frozen=True)
class BusConfig:
    """What the brokers and relays read of a run: the learner's hello carries these (its ``bus``, with ``sync`` from
    ``algo.schedule``; docs/protocol.md 5.1), and every welcome passes them on to the actors. The framework's, not
    the algorithm's: whatever the algorithm, they bound the queues between actors and learner."""

    max_in_flight: int = 2
    """Trajectories an actor may have pushed that the broker has not read yet (it returns their credit in batches
    of half this, at least 1, and what is left at each heartbeat). Bounds the queues between actors and learner,
    hence the data's staleness."""
    max_staleness: int = 4
    """Async schedule: trajectories older than this many versions are dropped (counted), by the brokers and by the
    learner."""

    def __post_init__(self) -> None:
        _require(self.max_in_flight >= 1, "bus.max_in_flight must be >= 1")
        _require(self.max_staleness >= 0, "bus.max_staleness must be >= 0")


@dataclass(frozen=True)
class LearnerConfig:
    gpus: str = "auto"
    """Learner shards: ``auto`` (one, on GPU 0 if any, else the CPU), GPU indices ``0,1`` (one shard each), or
    ``cpu:N``."""
    collective_timeout_s: float = 120.0
    """A collective (all-reduce, exchange) that waits longer than this fails the shard group instead of hanging."""
    param_chunk_bytes: int = 4 << 20
    """Parameters travel to the actors in chunks of at most this many bytes, each with its own hash."""
    param_dtype: str = "float32"
    """Parameter transport precision: ``float32``, ``float16`` or ``bfloat16`` (actors compute in float32)."""
    autocast: str = "auto"
    """``bf16``: with ppo and impala and a built-in CNN ``model.kind``, the torso of the training forward pass (the
    CNN: nearly all of its compute) runs under torch's autocast in bfloat16; heads, log-probs, values, losses,
    weights and Adam stay float32. ``off``: float32 throughout. ``auto``: bf16 on a GPU that supports it; on a CPU
    without bf16 units (avx512_bf16, amx_bf16) float32, since torch emulates bf16 there (8x slower measured); on one
    with them, whichever of the two a timed pass of the torso at start-up finds clearly faster (zddrl.algos.autocast).
    The learner logs its choice and why, and meta.json records it; `zddrl bench learner --config FILE --autocast
    off,bf16,auto` measures a host."""
    torch_threads: int = 1
    """Intra-op threads of each learner shard (small MLPs run fastest on one)."""
    publish_every: int = 1
    """Async schedule: publish parameters every k updates (at most ``bus.max_staleness`` + 1)."""
    straggler_factor: float = 3.0
    """Sync schedule: a round closes without the actors slower than this times the normal round (when the slowest
    actor it waits for usually reports; each actor judged by its own median, learner/rounds.py)."""
    min_round_timeout_s: float = 0.05
    """Sync schedule: never close a round on the straggler rule sooner than this."""

    def __post_init__(self) -> None:
        _require(self.autocast in AUTOCASTS, f"learner.autocast must be one of {AUTOCASTS}, got {self.autocast!r}")
        try:
            parse_gpus(self.gpus)
        except ValueError as exc:
            raise ConfigError(f"learner.gpus: {exc}") from None
        _require(self.collective_timeout_s > 0, "learner.collective_timeout_s must be > 0")
        _require(1024 <= self.param_chunk_bytes <= 1 << 28, "learner.param_chunk_bytes must be in 1 KiB..256 MiB")
        _require(self.param_dtype in PARAM_DTYPES, f"learner.param_dtype must be one of {PARAM_DTYPES}")
        _require(self.torch_threads >= 1, "learner.torch_threads must be >= 1")
        _require(self.publish_every >= 1, "learner.publish_every must be >= 1")
        _require(self.straggler_factor > 1.0, "learner.straggler_factor must be > 1")
        _require(self.min_round_timeout_s >= 0, "learner.min_round_timeout_s must be >= 0")


@dataclass(frozen=True)
class Config:
    name: str = "run"
    """Run name: prefix of the run id and of the default run directory."""
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    bus: BusConfig = field(default_factory=BusConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)

    def __post_init__(self) -> None:
        _require(
            self.algo.schedule == "sync" or self.learner.publish_every <= self.bus.max_staleness + 1,
            f"learner.publish_every ({self.learner.publish_every}) must be <= bus.max_staleness + 1 "
            f"({self.bus.max_staleness + 1}): actors only act with published versions, so data would all be "
            "too stale to train on before the next version is published",
        )

    def hello_bus(self) -> dict[str, Any]:
        """What brokers and relays need of the run: the ``bus`` field of its learner's hello (docs/protocol.md),
        which they read instead of the run spec."""
        return {
            "sync": self.algo.schedule == "sync",
            "max_staleness": self.bus.max_staleness,
            "max_in_flight": self.bus.max_in_flight,
        }

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["algo"] = self.algo.table()
        d["model"]["hidden"] = list(self.model.hidden)
        d["train"]["slowdowns"] = list(self.train.slowdowns)
        if math.isinf(self.train.until_return):
            d["train"]["until_return"] = None  # TOML and msgpack-friendly
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], allowed: frozenset[str] | None = None, stored: bool = False) -> Config:
        """Build and check a config. ``allowed``: the ``module:attr`` references this process may import (None:
        all, a config of the user's own; a run spec from the network, or a checkpoint's config, is read with the
        host's ``--allow-code``); the env id's is checked where the env is built (``envs.env_refusal``).
        ``stored``: a config zddrl wrote, perhaps an older zddrl (``algoconf.stored_table``)."""
        _require(isinstance(data, dict), "config must be a table")
        if allowed is not None and plugin.is_reference(str(data.get("model", {}).get("kind", ""))):
            why = plugin.refusal(data["model"]["kind"], allowed)  # before the table is built: that imports nothing
            if why:
                raise plugin.PluginError(f"model.kind: {why}")
        if stored:
            data = stored_sections(data)
        algo = algo_from_table(data.get("algo", {}), allowed, stored)
        config = _build(cls, {k: v for k, v in data.items() if k != "algo"}, "", NONE_IS_INF)
        return dataclasses.replace(config, algo=algo)  # checked again whole (Config.__post_init__) with its algo

    def references(self) -> tuple[str, ...]:
        """The code of the user's own this config names for import (``module:attr``): env, algorithm, model."""
        names = (self.env.id if ":" in self.env.id else "", self.algo.name, self.model.kind)
        return tuple(n for n in names if plugin.is_reference(n) or (n and n == self.env.id))

    def replace(self, overrides: dict[str, Any]) -> Config:
        """A copy with dotted-key overrides applied (``{"algo.lr": 1e-3}``), validated. Naming another algorithm
        keeps the keys the two share and takes the new one's default schedule unless one is given too."""
        data = self.to_dict()
        name = overrides.get("algo.name", self.algo.name)
        if name != self.algo.name and isinstance(name, str):
            data["algo"] = reset_for(name, data["algo"])
        return Config.from_dict(with_overrides(data, overrides))


_SECTIONS = {f.name: f for f in dataclasses.fields(Config)}


def stored_sections(data: dict[str, Any]) -> dict[str, Any]:
    """A stored config (a run directory's, a checkpoint's) as this version reads it: the keys ``[algo]`` held
    before they moved (``algoconf.MOVED_KEYS``) go to their sections, where a key already set there wins."""
    algo = data.get("algo")
    if not isinstance(algo, dict) or not MOVED_KEYS.keys() & algo.keys():
        return data
    data = {**data, "algo": {k: v for k, v in algo.items() if k not in MOVED_KEYS}}
    for key, section in MOVED_KEYS.items():
        if key in algo and isinstance(data.get(section, {}), dict):
            data[section] = {key: algo[key], **data.get(section, {})}
    return data


def with_overrides(data: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``data`` (a config table) with dotted-key overrides set in it."""
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    return data


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    _require(len(parts) in (1, 2), f"override {key!r} must be 'section.key' or a top-level key")
    if len(parts) == 2:
        sections = [name for name in _SECTIONS if name != "name"]
        _require(parts[0] in sections, unknown_section(parts[0], sections))
        data.setdefault(parts[0], {})[parts[1]] = value
    else:
        data[parts[0]] = value


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None, stored: bool = False) -> Config:
    """Read a TOML config (or the defaults when ``path`` is None) with dotted overrides set in it before it is
    checked (``--algorithm impala`` on a file of IMPALA keys); ``stored``: a run directory's config.toml."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        _require(p.is_file(), f"config file {str(p)!r} does not exist")
        plugin.importable(p.parent)  # code the config names may sit next to it (docs/extending.md)
        text = p.read_text()
        plugin.import_recorded(text)  # a run directory's config.toml: where its run's code came from (--resume)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    return Config.from_dict(with_overrides(data, overrides), stored=stored)
