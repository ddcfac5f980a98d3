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


def test_the_replay_modes_refuse_autocast() -> None:
    from zddrl.algos.checks import spec_refusal

    config = Config().replace({"algo.name": "apex", "learner.autocast": "bf16"})
    assert "actor-critic algorithms only" in spec_refusal(config, EnvSpec((4,), True, 2))
