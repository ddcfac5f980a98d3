"""The modules `zddrl export` writes: an acting network behind the run's observation normalisation, with the
deterministic action of its kind (zddrl.ops.export writes and checks the file). An algorithm's spec names its wrapper
(``AlgorithmSpec.export``); an algorithm of the user's own may subclass ``ExportedPolicy``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from zddrl.algos.flat import OBS_CLIP
from zddrl.envs import EnvSpec

VAR_EPS = 1e-8
"""Added to the variance before its square root, as ``zddrl.algos.flat.normalize_obs`` does."""


class ExportedPolicy(nn.Module):
    """``net`` behind the run's observation normalisation (when it had one); subclasses choose the action."""

    obs_mean: torch.Tensor
    obs_var: torch.Tensor
    action_low: torch.Tensor
    action_high: torch.Tensor
    """Buffers: the statistics when the run normalised observations, the bounds for Box actions."""

    def __init__(self, net: nn.Module, spec: EnvSpec, obs_rms: Mapping[str, Any] | None) -> None:
        super().__init__()
        self.net = net
        self.discrete = spec.discrete
        self.normalized = obs_rms is not None
        if obs_rms is not None:  # float32, as the actors cast them (algos/policy.py): the same numbers
            self.register_buffer("obs_mean", torch.as_tensor(obs_rms["mean"]).to(torch.float32).clone())
            self.register_buffer("obs_var", torch.as_tensor(obs_rms["var"]).to(torch.float32).clone())
        if not spec.discrete:
            self.register_buffer("action_low", torch.tensor(spec.action_low, dtype=torch.float32))
            self.register_buffer("action_high", torch.tensor(spec.action_high, dtype=torch.float32))

    def prepare(self, obs: torch.Tensor) -> torch.Tensor:
        """The network's input: ``flat.normalize_obs`` in torch when the run normalised, else ``obs`` as it came."""
        if not self.normalized:
            return obs
        return ((obs.float() - self.obs_mean) / torch.sqrt(self.obs_var + VAR_EPS)).clamp(-OBS_CLIP, OBS_CLIP)

    def outputs(self) -> dict[str, str]:
        """What ``action`` and ``dist_params`` hold (the file's description says it)."""
        raise NotImplementedError


class ActorCriticPolicy(ExportedPolicy):
    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        params, _ = self.net(self.prepare(obs))
        if self.discrete:
            return params.argmax(dim=1), params
        mean = params[:, : self.action_low.shape[0]]
        return torch.maximum(torch.minimum(mean, self.action_high), self.action_low), params

    def outputs(self) -> dict[str, str]:
        if self.discrete:
            return {"action": "argmax of the logits, int64 [B]", "dist_params": "logits [B, n]"}
        return {"action": "mean clipped to the bounds [B, A]", "dist_params": "concat(mean, log_std) [B, 2A]"}


class GreedyQPolicy(ExportedPolicy):
    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.net(self.prepare(obs))
        return q.argmax(dim=1), q

    def outputs(self) -> dict[str, str]:
        return {"action": "argmax of Q, int64 [B]", "dist_params": "Q values [B, n]"}


class SquashedGaussianPolicy(ExportedPolicy):
    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_std = self.net(self.prepare(obs))
        # mid + half * tanh(mu), mid and half in float32 as NumpySACPolicy computes them: the actors' greedy action
        mid, half = (self.action_high + self.action_low) / 2, (self.action_high - self.action_low) / 2
        return mid + half * torch.tanh(mu), torch.cat([mu, log_std], dim=1)

    def outputs(self) -> dict[str, str]:
        return {"action": "tanh(mean) scaled to the bounds [B, A]", "dist_params": "concat(mean, log_std) [B, 2A]"}
