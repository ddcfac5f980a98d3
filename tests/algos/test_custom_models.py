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


class Sized(torch.nn.Module):
    def __init__(self, env: EnvSpec, width: int, depth: int) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        size = int(np.prod(env.obs_shape))
        for _ in range(depth):
            layers += [torch.nn.Linear(size, width), torch.nn.Tanh()]
            size = width
        self.torso = torch.nn.Sequential(*layers)
        self.pi, self.v = torch.nn.Linear(width, env.action_dim), torch.nn.Linear(width, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.torso(obs.flatten(1).float())
        return self.pi(x), self.v(x).squeeze(1)


def make_sized(env: EnvSpec, model: object, width: int = 4, depth: int = 1) -> torch.nn.Module:
    """A factory with keyword arguments of its own, given by ``[model.kwargs]``."""
    return Sized(env, width, depth)


def test_model_kwargs_reach_a_factory_of_ones_own() -> None:
    model = {"kind": "test_custom_models:make_sized", "kwargs": {"width": 24, "depth": 2}}  # a [model.kwargs] table
    cfg = Config.from_dict({"model": model, "algo": {"name": "ppo"}})
    net = algorithm_of(cfg).acting_model(cfg, CARTPOLE)
    widths = [m.out_features for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert widths[:2] == [24, 24] and cfg.to_dict()["model"]["kwargs"] == {"width": 24, "depth": 2}
    with pytest.raises(ConfigError, match="model.kwargs are for a model.kind of your own"):
        Config().replace({"model.kwargs": {"width": 24}})
    bad = Config().replace({"model.kind": "test_custom_models:make_sized", "model.kwargs": {"height": 3}})
    with pytest.raises(ConfigError, match=r"kwargs \['height'\]: .* no such keyword \(it takes \['width', 'depth'\]\)"):
        algorithm_of(bad).acting_model(bad, CARTPOLE)


class GRUNet(torch.nn.Module):
    """A recurrent network, as a user would write one: zddrl's cores call forward(obs) and cannot run it yet."""

    def __init__(self, env: EnvSpec) -> None:
        super().__init__()
        self.gru = torch.nn.GRUCell(env.obs_shape[0], 8)
        self.pi, self.v = torch.nn.Linear(8, env.action_dim), torch.nn.Linear(8, 1)

    def initial_state(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, 8)

    def forward(self, obs: torch.Tensor, state: torch.Tensor) -> tuple:
        h = self.gru(obs, state)
        return (self.pi(h), self.v(h).squeeze(1)), h


def make_gru(env: EnvSpec, model: object) -> torch.nn.Module:
    return GRUNet(env)


def test_a_recurrent_network_is_one_line_naming_the_interface_before_anything_starts() -> None:
    """The GRU that crashed the learner with a raw TypeError (issue 38) is refused by the checks `zddrl train` and
    `zddrl learner` run in their own process, and wherever it would be built."""
    from zddrl.algos.checks import spec_refusal

    cfg = Config().replace({"model.kind": "test_custom_models:make_gru"})
    why = spec_refusal(cfg, CARTPOLE)
    assert "looks recurrent (forward(obs, state), initial_state)" in why and "\n" not in why
    assert "initial_state(batch), forward(obs, state, episode_start) -> (outputs, state)" in why
    with pytest.raises(ConfigError, match="looks recurrent"):
        algorithm_of(cfg).acting_model(cfg, CARTPOLE)
    assert spec_refusal(Config().replace({"model.kind": "nets:make"}), CARTPOLE) == ""
