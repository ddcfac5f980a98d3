"""`learner.autocast = "bf16"`: the training forward pass in bfloat16 under autocast, everything else float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from samples import pixel_trajectory
from zddrl.algos.impala.learner import ImpalaLearner
from zddrl.algos.ppo.learner import PPOLearner
from zddrl.config import Config, ConfigError, run_kind
from zddrl.envs import EnvSpec

PIXELS = EnvSpec((2, 36, 36), True, 3, obs_dtype="uint8")


def config(mode: str, autocast: str) -> Config:
    return Config().replace(
        {**run_kind(mode), "model.kind": "nature_cnn", "model.hidden": [32], "learner.autocast": autocast}
    )


def test_autocast_evaluates_in_bf16_and_returns_float32_close_to_the_float32_pass() -> None:
    exact, cast = PPOLearner(config("sync", "off"), PIXELS), PPOLearner(config("sync", "bf16"), PIXELS)
    cast.model.load_state_dict(exact.model.state_dict())
    obs = torch.as_tensor(np.random.default_rng(0).integers(0, 256, (8, *PIXELS.obs_shape), dtype=np.uint8))
    actions = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    want, got = exact.evaluate(obs, actions), cast.evaluate(obs, actions)
    assert all(x.dtype == torch.float32 for x in got)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0.05, atol=0.05)  # bfloat16 keeps 8 bits of mantissa
    assert not all(torch.equal(w, g) for w, g in zip(want, got)), "the bf16 pass must differ in its last bits"


@pytest.mark.parametrize("mode", ["sync", "impala"])
def test_an_update_under_autocast_trains_float32_weights(mode: str) -> None:
    core = (ImpalaLearner if mode == "impala" else PPOLearner)(config(mode, "bf16"), PIXELS)
    before = [p.detach().clone() for p in core.model.parameters()]
    figures = core.update([pixel_trajectory(PIXELS, 8, 2)])
    assert all(np.isfinite(v) for v in figures.values() if isinstance(v, float))
    params = list(core.model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    assert all(s.dtype == torch.float32 for s in core.optimizer.exp_avg)
    assert any(not torch.equal(b, p) for b, p in zip(before, params)), "the update moved no weight"


def test_an_unknown_autocast_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="learner.autocast"):
        Config().replace({"learner.autocast": "fp8"})


def test_the_replay_modes_refuse_bf16_and_take_auto() -> None:
    from zddrl.algos.checks import spec_refusal

    config = Config().replace({"algo.name": "apex", "learner.autocast": "bf16"})
    assert "actor-critic algorithms only" in spec_refusal(config, EnvSpec((4,), True, 2))
    assert spec_refusal(config.replace({"learner.autocast": "auto"}), EnvSpec((4,), True, 2)) == ""


# ------------------------------------------------------------------------------------------------ learner.autocast auto


def test_auto_is_the_default_and_runs_an_mlp_in_float32() -> None:
    assert Config().learner.autocast == "auto"
    core = PPOLearner(Config(), EnvSpec((4,), True, 2))
    assert core.autocast.mode == "off" and "no built-in CNN torso" in core.autocast.reason


def test_auto_on_a_cpu_without_bf16_units_keeps_float32_without_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch emulates bf16 there (the Pong learner at 0.12x of float32 on an AVX2-only EPYC): nothing to measure."""
    from zddrl.algos import autocast

    monkeypatch.setattr(autocast, "bf16_units", lambda: [])
    monkeypatch.setattr(autocast, "time_torso", lambda *a: pytest.fail("timed although the CPU has no bf16 units"))
    core = PPOLearner(config("sync", "auto"), PIXELS)
    assert core.autocast.mode == "off" and "none of avx512_bf16, amx_bf16" in core.autocast.reason


@pytest.mark.parametrize(("ms_bf16", "mode"), [(50.0, "bf16"), (89.0, "bf16"), (95.0, "off"), (400.0, "off")])
def test_auto_with_bf16_units_keeps_bf16_only_when_its_timed_pass_is_clearly_faster(
    ms_bf16: float, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zddrl.algos import autocast

    monkeypatch.setattr(autocast, "bf16_units", lambda: ["amx_bf16"])
    monkeypatch.setattr(autocast, "time_torso", lambda *a: (100.0, ms_bf16))
    core = PPOLearner(config("sync", "auto"), PIXELS)
    assert core.autocast.mode == mode and (core.autocast.ms_off, core.autocast.ms_bf16) == (100.0, ms_bf16)
    assert "amx_bf16" in core.autocast.reason and f"{ms_bf16:.1f} ms in bf16" in core.autocast.reason


def test_the_torso_timing_measures_both_precisions_and_leaves_the_model_as_it_was() -> None:
    from zddrl.algos.autocast import time_torso

    core = PPOLearner(config("sync", "off"), PIXELS)
    before = [p.detach().clone() for p in core.model.parameters()]
    ms_off, ms_bf16 = time_torso(core.model, PIXELS, torch.device("cpu"))
    assert ms_off > 0 and ms_bf16 > 0
    assert all(p.grad is None for p in core.model.parameters())
    assert all(torch.equal(b, p) for b, p in zip(before, core.model.parameters()))


def test_a_set_mode_is_taken_as_it_is_and_a_network_of_your_own_refuses_only_bf16() -> None:
    from zddrl.algos.actor_critic import check_actor_critic

    assert PPOLearner(config("sync", "bf16"), PIXELS).autocast.mode == "bf16"
    custom = Config().replace({"model.kind": "tests.test_plugins:nothing"})
    assert check_actor_critic(custom, PIXELS) == ""
    assert "needs a built-in model.kind" in check_actor_critic(custom.replace({"learner.autocast": "bf16"}), PIXELS)
