"""Networks of the user's own (examples/plugins/nets.py) for each algorithm family: the learner trains them, the
actors act with the same network in torch, `zddrl export` writes them, and a factory that breaks the interface is one
clear line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from test_apex_sac import BOX, DISCRETE, rollout

from zddrl.actor.host import build_policy
from zddrl.algos.custom_model import CustomActorCritic, CustomGaussian, CustomQ, CustomTwinQ
from zddrl.algos.offpolicy_nets import TwinQ
from zddrl.algos.spec import algorithm_of
from zddrl.cli.export import export
from zddrl.config import Config, ConfigError
from zddrl.envs import EnvSpec
from zddrl.plugin import importable

PLUGINS = Path(__file__).resolve().parents[2] / "examples" / "plugins"
importable(PLUGINS)  # as a config file next to nets.py would make it
CARTPOLE = EnvSpec((4,), True, 2)
REPLAY = {"replay.capacity": 256, "replay.batch_size": 8, "replay.learning_starts": 0, "replay.replay_ratio": 0.5}


def config(name: str, kind: str) -> Config:
    return Config().replace({"algo.name": name, "model.kind": kind, "model.hidden": [16, 16], **REPLAY})


def test_a_q_network_of_ones_own_trains_and_the_actor_acts_with_it() -> None:
    cfg = config("apex", "nets:make_q")
    core = algorithm_of(cfg).learner(cfg, DISCRETE, None)
    assert isinstance(core.model, CustomQ)
    figures = core.update([rollout(DISCRETE, seed=1), rollout(DISCRETE, seed=2)])
    assert np.isfinite(figures["loss"]) and figures["grad_steps"] > 0
    flat, layout, extras = core.params()
    policy = build_policy(flat, layout, extras, cfg, DISCRETE)
    obs = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    with torch.no_grad():
        q = core.model(torch.as_tensor(obs)).numpy()
    np.testing.assert_allclose(policy.q(obs), q, atol=1e-6)  # the actor's network is the learner's
    assert "finish_rollout" in dir(policy)  # Ape-X's actors still send their initial priorities (actor_td)


def test_a_sac_network_of_ones_own_with_its_critics_trains_and_acts() -> None:
    cfg = config("sac", "nets:make_sac")
    core = algorithm_of(cfg).learner(cfg, BOX, None)
    assert isinstance(core.model, CustomGaussian) and isinstance(core.critic, CustomTwinQ)
    figures = core.update([rollout(BOX, seed=1), rollout(BOX, seed=2)])
    assert np.isfinite(figures["critic_loss"]) and np.isfinite(figures["actor_loss"])
    flat, layout, extras = core.params()
    policy = build_policy(flat, layout, extras, cfg, BOX)
    obs = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    greedy = policy.act(obs, np.random.default_rng(0), deterministic=True).actions
    np.testing.assert_allclose(greedy, core.greedy(obs), atol=1e-5)


def test_sac_keeps_its_own_critics_when_the_factory_builds_none(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "policy_only.py").write_text(
        "from nets import GaussianNet\n\ndef make(env, model):\n    return GaussianNet(env, model)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config("sac", "policy_only:make")
    core = algorithm_of(cfg).learner(cfg, BOX, None)
    assert isinstance(core.model, CustomGaussian) and isinstance(core.critic, TwinQ)


def test_a_factory_that_breaks_the_interface_is_one_line(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "broken.py").write_text(
        "import torch\n\ndef make(env, model):\n    return torch.nn.Linear(4, 3)\n\ndef nothing(env, model):\n"
        "    return 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"\(actor-critic\): forward on a batch of 2 must return shapes"):
        CustomActorCritic(CARTPOLE, config("ppo", "broken:make").model)
    with pytest.raises(ConfigError, match="not a torch.nn.Module"):
        CustomActorCritic(CARTPOLE, config("ppo", "broken:nothing").model)
    with pytest.raises(ConfigError, match="or a 'package.module:make' of your own, got 'apex'"):
        Config().replace({"model.kind": "apex"})


@pytest.mark.parametrize("name, kind, env", [("apex", "nets:make_q", CARTPOLE), ("sac", "nets:make_sac", BOX)])
def test_export_writes_the_networks_of_ones_own(name: str, kind: str, env: EnvSpec, tmp_path: Path) -> None:
    cfg = config(name, kind).replace({"env.id": "CartPole-v1" if env is CARTPOLE else "Pendulum-v1"})
    net = algorithm_of(cfg).acting_model(cfg, env)
    path = tmp_path / "ckpt.pt"
    torch.save({"config": cfg.to_dict(), "model": net.state_dict(), "policy_version": 3}, path)
    args = [str(path), "--format", "torchscript", "-o", str(tmp_path / "p.pt")]
    refused = CliRunner().invoke(export, args)  # a checkpoint may come from anywhere: its code must be allowed
    assert refused.exit_code == 1 and f"--allow-code {kind}" in refused.output and not (tmp_path / "p.pt").exists()
    done = CliRunner().invoke(export, [*args, "--allow-code", kind])
    assert done.exit_code == 0, done.output
    loaded = torch.jit.load(str(tmp_path / "p.pt"))
    obs = torch.randn(10, *env.obs_shape)
    action, _ = loaded(obs)
    with torch.no_grad():
        expected = net(obs).argmax(1) if env is CARTPOLE else 2.0 * torch.tanh(net(obs)[0])
    torch.testing.assert_close(action.to(expected.dtype), expected, atol=1e-5, rtol=1e-5)
