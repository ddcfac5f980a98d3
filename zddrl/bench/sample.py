"""`zddrl bench sample`: sampling throughput through the whole pipeline vs plain local loops.

Measured in one run, phases alternating so that machine noise hits both alike:

* **plain**: ``--actors`` processes side by side, each a plain loop of ``--envs`` vectorised
  CartPole envs + the same numpy MLP inference the actors use, no communication at all;
* **pipeline**: a real broker process, ``--actors`` real `zddrl actor` processes and a learner
  that only consumes, decodes and counts (async mode, so actors never wait for parameters);
* **gym+torch** (context only): the loop most people write, gymnasium's SyncVectorEnv with
  torch inference under ``no_grad``.

The figure is pipeline env steps/s divided by the summed plain loops' env steps/s.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
from functools import partial
from typing import Any

import click
import numpy as np
import zmq

from zddrl import protocol as P
from zddrl.actor.host import action_rng, env_seeds
from zddrl.config import Config, ConfigError, load_config
from zddrl.envs import actor_envs, env_factory, probe_spec
from zddrl.proc import free_ports
from zddrl.transport.channel import DataChannel
from zddrl.transport.link import BrokerLink, hello_fields

WARMUP_S = 1.0


def _config(
    env_id: str,
    envs: int,
    rollout_len: int,
    max_in_flight: int = Config().bus.max_in_flight,
    base: Config | None = None,
) -> Config:
    """The bench's run: ``base``'s env and model (a run config: Atari wrappers, a CNN) or CartPole's, sampled in
    async mode so that actors never wait for parameters."""
    return (base or Config(name="bench-sample")).replace(
        {
            **({} if base else {"env.id": env_id}),
            "env.num_envs": envs,
            "env.rollout_len": rollout_len,
            "algo.name": "ppo",
            "algo.schedule": "async",
            "bus.max_staleness": 1_000_000,
            "bus.max_in_flight": max_in_flight,
        }
    )


def _params(config: Config) -> tuple[np.ndarray, list]:
    from zddrl.algos.model import ActorCritic, flatten_params

    return flatten_params(ActorCritic(probe_spec(config.env), config.model))


def _plain_loop(config: Config, actor_id: int, flat: np.ndarray, layout: list, seconds: float, out: mp.Queue) -> None:
    """What an actor does minus the bus: step, infer (the actors' policy: numpy MLP or torch CNN), store nothing."""
    from zddrl.algos.actor_critic import actor_critic_policy

    envs = config.env.num_envs
    vec = actor_envs(config.env, env_seeds(1, actor_id, envs))
    policy = actor_critic_policy(flat, layout, config.model, vec.spec)
    rng = action_rng(1, actor_id)
    steps, start = 0, time.monotonic()
    begin = start + WARMUP_S
    while True:
        now = time.monotonic()
        if now >= begin + seconds:
            break
        vec.step(policy.act(vec.obs, rng).actions)
        if now >= begin:
            steps += envs
    out.put(steps / seconds)


def _gym_torch_loop(env_id: str, envs: int, actor_id: int, seconds: float, out: mp.Queue) -> None:
    import gymnasium as gym
    import torch

    torch.set_num_threads(1)
    vec = gym.vector.SyncVectorEnv([env_factory(env_id)] * envs, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    seeds: list[int | None] = list(env_seeds(1, actor_id, envs))  # reset() takes list[int | None]
    obs, _ = vec.reset(seed=seeds)
    # gymnasium types spaces loosely (shape may be None, a Space has no n): here a Box and a Discrete
    n_in = vec.single_observation_space.shape[0]  # type: ignore[index]
    n_out = vec.single_action_space.n  # type: ignore[attr-defined]
    net = torch.nn.Sequential(
        torch.nn.Linear(n_in, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, n_out)
    )
    steps, start = 0, time.monotonic()
    begin = start + WARMUP_S
    while time.monotonic() < begin + seconds:
        with torch.no_grad():
            logits = net(torch.as_tensor(obs, dtype=torch.float32))
            actions = torch.distributions.Categorical(logits=logits).sample().numpy()
        obs, *_ = vec.step(actions)
        if time.monotonic() >= begin:
            steps += envs
    out.put(steps / seconds)


def _side_by_side(target, args_for, n: int, seconds: float) -> float:
    """Run n loop processes at once; their summed env steps/s."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    workers = [ctx.Process(target=target, args=(*args_for(i), seconds, out), daemon=True) for i in range(n)]
    for w in workers:
        w.start()
    try:
        return sum(out.get(timeout=seconds + 60) for _ in workers)
    finally:
        for w in workers:
            w.join(timeout=5)
            if w.is_alive():
                w.kill()


class CountingLearner:
    """A learner shard that publishes version 0 and then only consumes, decodes and counts."""

    def __init__(self, connect: str, config: Config, flat: np.ndarray, layout: list) -> None:
        self.ctx: zmq.Context = zmq.Context.instance()
        hello = P.Hello(
            role="learner",
            peer_id="bench-learner",
            run_id=f"bench-{time.time_ns()}",
            run=config.to_dict(),
            bus=config.hello_bus(),
            **hello_fields(),
        )
        self.link = BrokerLink(connect, hello, context=self.ctx).start()
        welcome = self.link.wait_welcome(30)
        if welcome is None:
            raise click.ClickException(f"no broker at {connect}")
        self.channel = DataChannel(self.link, "bench-learner", welcome.max_message_bytes)
        self.channel.send(
            P.Parameters(
                run_id=hello.run_id,
                peer_id="bench-learner",
                policy_version=0,
                param_hash=P.param_hash(flat),
                layout=layout,
                arrays={"flat": flat},
            )
        )

    def count(self, seconds: float, actors: int, start_timeout_s: float = 60.0) -> float:
        """Env steps/s received over ``seconds``, counted from a warm-up after every actor has sent data."""
        peer_ids: set[str] = set()
        deadline = time.monotonic() + start_timeout_s
        while len(peer_ids) < actors:
            if time.monotonic() > deadline:
                raise click.ClickException(f"only {len(peer_ids)} of {actors} actors sent data in {start_timeout_s} s")
            msg = self.channel.recv(50)
            if msg is not None:
                self.channel.ack()
                peer_ids.add(getattr(msg, "peer_id", ""))
        begin = time.monotonic() + WARMUP_S
        steps = 0
        while (now := time.monotonic()) < begin + seconds:
            msg = self.channel.recv(50)
            if msg is None:
                continue
            self.channel.ack()
            if isinstance(msg, P.Trajectory) and now >= begin:
                steps += msg.env_steps
        return steps / seconds

    def close(self) -> None:
        self.channel.close()
        self.link.close()


def _pipeline(config: Config, actors: int, seconds: float, flat: np.ndarray, layout: list) -> dict[str, Any]:
    ports = free_ports(4)
    connect = f"tcp://127.0.0.1:{ports[0]}"
    cmd = [sys.executable, "-m", "zddrl", "--log-level", "WARNING"]
    procs = [
        subprocess.Popen(
            [
                *cmd,
                "broker",
                "--bind",
                connect,
                "--insecure",
                "--trajectory-port",
                str(ports[1]),
                "--learner-port",
                str(ports[2]),
                "--params-port",
                str(ports[3]),
            ]
        )
    ]
    learner = None
    try:
        learner = CountingLearner(connect, config, flat, layout)
        procs += [subprocess.Popen([*cmd, "actor", "--connect", connect, "--actor-id", str(i)]) for i in range(actors)]
        sps = learner.count(seconds, actors)
        return {"sps": sps}
    finally:
        if learner is not None:
            learner.close()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def run_sample_bench(
    seconds: float,
    actors: int,
    envs: int,
    rounds: int,
    env_id: str = "CartPole-v1",
    rollout_len: int = 32,
    max_in_flight: int = Config().bus.max_in_flight,
    base: Config | None = None,
    backends: tuple[str, ...] = (),
) -> dict[str, Any]:
    """With ``base`` (a run config, ``--config``): its envs and model, and a single-process loop of all
    ``actors x envs`` envs as a second reference (the loop one would write without zddrl). With ``backends``
    (several ``env.backend`` values of an Atari run), each is measured in every round, side by side, and the
    result holds one entry per backend under ``backends``."""
    config = _config(env_id, envs, rollout_len, max_in_flight, base)
    flat, layout = _params(config)
    names = backends or (config.env.backend,)
    runs = {name: config.replace({"env.backend": name}) for name in names}
    got: dict[str, dict[str, list[float]]] = {name: {"plain": [], "pipe": [], "single": []} for name in names}
    for _ in range(rounds):
        for name, cfg in runs.items():  # alternating: machine noise hits every backend alike
            got[name]["plain"].append(
                _side_by_side(_plain_loop, partial(_loop_args, cfg, flat, layout), actors, seconds)
            )
            got[name]["pipe"].append(_pipeline(cfg, actors, seconds, flat, layout)["sps"])
            if base is not None:
                single_config = cfg.replace({"env.num_envs": actors * envs})
                single = _side_by_side(_plain_loop, partial(_loop_args, single_config, flat, layout), 1, seconds)
                got[name]["single"].append(single)
    gym_torch = []
    if base is None:  # the hand-written gym + torch loop knows vector observations and an MLP only
        gym_torch.append(_side_by_side(_gym_torch_loop, lambda i: (config.env.id, envs, i), actors, seconds))
    figures = {name: _figures(got[name]) for name in names}
    result = {
        "env_id": config.env.id,
        "model": config.model.kind,
        "actors": actors,
        "envs_per_actor": envs,
        "rollout_len": rollout_len,
        "max_in_flight": max_in_flight,
        "seconds": seconds,
        "rounds": rounds,
        "backend": names[0],
        **figures[names[0]],
        "gym_torch_sps": statistics.median(gym_torch) if gym_torch else None,
        "target_ratio": 0.7,
    }
    if len(names) > 1:
        result["backends"] = figures
    return result


def _loop_args(config: Config, flat: np.ndarray, layout: list, actor_id: int) -> tuple:
    """``_plain_loop``'s arguments for one process of the side-by-side loops."""
    return config, actor_id, flat, layout


def _figures(got: dict[str, list[float]]) -> dict[str, Any]:
    """Medians and ratios of one backend's rounds."""
    plain, pipe, single = got["plain"], got["pipe"], got["single"]
    ratios = [p / q for p, q in zip(pipe, plain)]
    return {
        "plain_sps": statistics.median(plain),
        "pipeline_sps": statistics.median(pipe),
        "single_sps": statistics.median(single) if single else None,
        "single_ratio": statistics.median([p / q for p, q in zip(pipe, single)]) if single else None,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
    }


@click.command("sample")
@click.option("--seconds", type=float, default=5.0, show_default=True, help="Measured window per phase.")
@click.option("--actors", type=int, default=2, show_default=True)
@click.option("--envs", type=int, default=4, show_default=True, help="Envs per actor.")
@click.option("--rollout-len", type=int, default=128, show_default=True, help="Steps per env per trajectory message.")
@click.option("--rounds", type=int, default=2, show_default=True, help="Alternating plain/pipeline rounds.")
@click.option("--env-id", default="CartPole-v1", show_default=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A run config (e.g. examples/breakout_impala.toml): its env, wrappers and model instead of --env-id's.",
)
@click.option(
    "--max-in-flight",
    type=int,
    default=Config().bus.max_in_flight,
    show_default=True,
    help="bus.max_in_flight of the run (unread trajectories an actor may have queued).",
)
@click.option(
    "--backends",
    default="",
    help="env.backend values to measure side by side with an Atari --config, comma-separated "
    "(gymnasium,ale_vector); default: the config's.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def sample(seconds, actors, envs, rollout_len, rounds, env_id, config_path, max_in_flight, backends, as_json) -> None:
    """Pipeline env steps/s (broker + actors + counting learner) vs plain loops side by side."""
    base = load_config(config_path) if config_path else None
    names = tuple(b.strip() for b in backends.split(",") if b.strip())
    if names and (base is None or not base.env.atari):
        raise click.UsageError("--backends needs --config of an Atari run (env.atari = true)")
    for name in names:
        try:
            base.replace({"env.backend": name})  # type: ignore[union-attr]  # base is set: checked above
        except ConfigError as exc:
            raise click.UsageError(f"--backends: {exc}") from None
    result = run_sample_bench(seconds, actors, envs, rounds, env_id, rollout_len, max_in_flight, base, names)
    if as_json:
        click.echo(json.dumps(result))
        return
    if "backends" in result:
        _print_backends(result, actors, envs)
        return
    policy = "numpy MLP" if result["model"] == "mlp" else f"torch {result['model']}"
    click.echo(
        f"{actors} actors x {envs} {result['env_id']}, rollouts of {rollout_len}, {seconds:.0f} s windows, "
        f"{rounds} rounds (medians)"
    )
    click.echo(f"  plain loops (VecEnv + {policy}), summed : {result['plain_sps']:>9,.0f} env steps/s")
    click.echo(f"  pipeline actor -> broker -> learner      : {result['pipeline_sps']:>9,.0f} env steps/s")
    if result["single_sps"] is not None:
        click.echo(f"  one process, {actors * envs} envs + {policy}    : {result['single_sps']:>9,.0f} env steps/s")
    if result["gym_torch_sps"] is not None:
        click.echo(f"  gym SyncVectorEnv + torch MLP, summed    : {result['gym_torch_sps']:>9,.0f} env steps/s")
    click.echo(f"  pipeline / plain = {result['ratio']:.2f}  (target >= {result['target_ratio']})")
    if result["single_ratio"] is not None:
        click.echo(f"  pipeline / one process = {result['single_ratio']:.2f}")


def _print_backends(result: dict[str, Any], actors: int, envs: int) -> None:
    policy = f"torch {result['model']}"
    click.echo(
        f"{actors} actors x {envs} {result['env_id']}, rollouts of {result['rollout_len']}, "
        f"{result['seconds']:.0f} s windows, {result['rounds']} rounds (medians), env steps/s"
    )
    click.echo(f"  {'backend':<12} {'plain loops':>12} {'pipeline':>10} {'one process':>12} {'pipeline/plain':>15}")
    for name, f in result["backends"].items():
        click.echo(
            f"  {name:<12} {f['plain_sps']:>12,.0f} {f['pipeline_sps']:>10,.0f} {f['single_sps']:>12,.0f} "
            f"{f['ratio']:>15.2f}"
        )
    click.echo(f"  (plain loops: {actors} processes of {envs} envs + {policy}, no bus; one process: all envs in one)")
