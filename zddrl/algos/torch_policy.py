"""Actor-side inference in torch, for the CNN policies and custom networks (every ``model.kind`` but ``mlp``).

Same interface as ``zddrl.algos.policy.NumpyPolicy`` (``act``, ``value``, ``outputs``), and the same action
sampling (``policy.sample``, from the actor's numpy generator): only the forward pass differs. Why torch here:
a numpy convolution (im2col and a matmul) of the Nature CNN on 8 frames of 4x84x84 costs several times a torch
forward on one thread (docs/benchmarks.md, actor inference). The MLP actor never imports this module.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from zddrl.algos.flat import normalize_obs
from zddrl.algos.model import load_flat
from zddrl.algos.policy import ActOutput, sample
from zddrl.envs import EnvSpec

INFERENCE_THREADS = 1
"""An actor host is one of many processes on a machine of cores: its forward pass takes one of them."""


class TorchPolicy:
    """``act(obs, rng)`` samples actions; ``value(obs)`` evaluates the critic. Inputs are raw observations
    (uint8 pixels stay uint8 until the network scales them, as on the learner)."""

    def __init__(
        self,
        net: torch.nn.Module,
        flat: np.ndarray,
        layout: list,
        spec: EnvSpec,
        obs_mean: np.ndarray | None = None,
        obs_var: np.ndarray | None = None,
    ) -> None:
        """``net``: the acting network, built afresh; its ``forward(obs)`` gives ``(dist_params, value)``
        (``model.ActorCritic.forward``, ``custom_model``)."""
        torch.set_num_threads(INFERENCE_THREADS)
        self.net = net
        load_flat(self.net, np.asarray(flat, dtype=np.float32), layout)
        self.net.eval()
        self.discrete, self.action_dim = spec.discrete, spec.action_dim
        self.outputs = int(spec.action_dim)
        """load_flat refuses a layout of other sizes: the output is the env's, by construction."""
        self.obs_mean = None if obs_mean is None else np.asarray(obs_mean, dtype=np.float32)
        self.obs_var = None if obs_var is None else np.asarray(obs_var, dtype=np.float32)

    def prepare(self, obs: np.ndarray) -> torch.Tensor:
        """The network's input: normalised as the learner does when the run normalises, else as it came."""
        if self.obs_mean is not None and self.obs_var is not None:
            obs = normalize_obs(obs, self.obs_mean, self.obs_var)
        return torch.from_numpy(np.ascontiguousarray(obs))

    def value(self, obs: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.net(self.prepare(obs))[1].numpy().astype(np.float32)

    def act(self, obs: np.ndarray, rng: np.random.Generator, deterministic: bool = False) -> ActOutput:
        with torch.inference_mode():
            params, values = self.net(self.prepare(obs))
        params = params.float().numpy()
        if self.discrete:
            return sample(params, values.numpy(), np.zeros(0, np.float32), rng, deterministic)
        mean, log_std = params[:, : self.action_dim], params[:, self.action_dim :]
        return sample(mean, values.numpy(), log_std, rng, deterministic)


class TorchForward:
    """A torch network as a numpy function for the actors: ``f(obs)`` is its forward pass on raw observations
    (one thread, no gradient), its tensors returned as float32 arrays; the parameters are a version's."""

    def __init__(self, net: torch.nn.Module, flat: np.ndarray, layout: list) -> None:
        torch.set_num_threads(INFERENCE_THREADS)
        self.net = net
        load_flat(self.net, np.asarray(flat, dtype=np.float32), layout)
        self.net.eval()

    def __call__(self, obs: np.ndarray) -> Any:
        with torch.inference_mode():
            out = self.net(torch.from_numpy(np.ascontiguousarray(obs)))
        if isinstance(out, tuple):
            return tuple(t.float().numpy() for t in out)
        return out.float().numpy()
