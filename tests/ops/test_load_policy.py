"""``zddrl.load_policy``: its ``act`` and ``dist_params`` are the two outputs of the file `zddrl export` writes of the
same checkpoint (docs/export.md, docs/extending.md): Box actions clipped to the bounds, the distribution's
parameters as the file gives them, for each network family."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_export import CASES, check, observations, reference, write_checkpoint

import zddrl
from zddrl.algos.model import ActorCritic


@pytest.mark.parametrize("case", list(CASES))
def test_act_and_dist_params_are_the_exported_files_outputs(tmp_path: Path, case: str) -> None:
    path, net, spec, rms = write_checkpoint(tmp_path, case)
    policy = zddrl.load_policy(path)
    obs = observations(policy.config.env.id)
    want = reference(net, spec, obs, rms)
    got = [policy.act(obs), policy.dist_params(obs)]
    check(got, want, spec.discrete)
    one = [policy.act(obs[0])[None], policy.dist_params(obs[0])[None]]  # one observation: one action, one row
    check(one, [w[:1] for w in want], spec.discrete)
    if not spec.discrete:
        low, high = np.asarray(spec.action_low, np.float32), np.asarray(spec.action_high, np.float32)
        sampled = policy.act(obs, deterministic=False)
        assert ((sampled >= low) & (sampled <= high)).all()  # samples too: what the env executes
        if CASES[case][1] is ActorCritic:
            mean = got[1][:, : len(low)]
            assert ((mean < low) | (mean > high)).any()  # the means pass the bounds: the clipping is exercised
