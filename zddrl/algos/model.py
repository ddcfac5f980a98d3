"""The policy/value network (torch, learner side) and its flat-buffer form for the wire.

The learner trains ``ActorCritic`` (an MLP, or a CNN of zddrl.algos.cnn for pixels); parameters travel as one
contiguous float32 buffer plus a layout (``[name, dtype, shape, offset]`` rows, offsets in elements), from which
actors rebuild the weights (``zddrl.algos.flat``; actors use ``zddrl.algos.policy``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from zddrl.algos.cnn import PixelTorso
from zddrl.algos.flat import unflatten
from zddrl.config import ModelConfig
from zddrl.envs import EnvSpec


class Tanh(nn.Module):
    """tanh computed as ``2 * sigmoid(2x) - 1`` (the same function).

    Why: in the CPU builds of torch measured here, ``torch.tanh`` runs a scalar kernel while ``sigmoid`` is
    vectorised (about 8x faster on a 256x64 batch: docs/benchmarks.md); PPO on small MLPs spends most of its
    update time in activations, so this halves the learner's step time.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(2.0 * x).mul(2.0).sub(1.0)


ACTIVATIONS: dict[str, type[nn.Module]] = {
    "tanh": Tanh,
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "gelu": nn.GELU,
    "elu": nn.ELU,
    "leaky_relu": nn.LeakyReLU,
}
"""``model.activation`` -> its torch module (default parameters); zddrl.algos.policy mirrors each in numpy."""


def _mlp(sizes: list[int], activation: str, out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        linear = nn.Linear(sizes[i], sizes[i + 1])
        last = i == len(sizes) - 2
        nn.init.orthogonal_(linear.weight, out_gain if last else math.sqrt(2))
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if not last:
            layers.append(ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """The policy and value networks of ``config.kind``.

    ``mlp``: separate policy and value MLPs on the flattened observation (the SB3/CleanRL default for PPO on
    vector observations). ``nature_cnn`` / ``impala_cnn``: one convolutional torso (zddrl.algos.cnn) shared by a
    linear policy head and a linear value head, as the Atari literature does.

    Discrete actions: categorical over ``pi`` logits. Box actions: Gaussian with mean ``pi(x)`` and a
    state-independent ``log_std``.
    """

    def __init__(self, spec: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        self.discrete = spec.discrete
        self.torso: PixelTorso | None = None
        if config.kind == "mlp":
            obs_dim = int(np.prod(spec.obs_shape))
            hidden = list(config.hidden)
            self.pi = _mlp([obs_dim, *hidden, spec.action_dim], config.activation, 0.01)
            self.v = _mlp([obs_dim, *hidden, 1], config.activation, 1.0)
        else:
            self.torso = PixelTorso(config.kind, spec.obs_shape, config.hidden[0])
            self.pi = _mlp([config.hidden[0], spec.action_dim], "relu", 0.01)
            self.v = _mlp([config.hidden[0], 1], "relu", 1.0)
        if not spec.discrete:
            self.log_std = nn.Parameter(torch.full((spec.action_dim,), float(config.log_std_init)))

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        """What the heads read: the CNN torso's output, or the flattened observation (as float) for the MLPs."""
        if self.torso is not None:
            return self.torso(obs)
        return obs.flatten(1).float()

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.v(self.features(obs)).squeeze(-1)

    def heads(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pi output [B, A], value [B])`` with one pass through the torso."""
        x = self.features(obs)
        return self.pi(x), self.v(x).squeeze(-1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(distribution parameters, value [B])``: the logits ``[B, A]`` (Discrete), or the Gaussian's mean and
        ``log_std`` (broadcast to the batch) side by side, ``[B, 2A]`` (Box). Tensors only, so that
        ``torch.jit.trace`` and the ONNX exporter can follow it (``zddrl.ops.export``); training uses
        ``evaluate``, actors ``heads``."""
        out, value = self.heads(obs)
        if self.discrete:
            return out, value
        return torch.cat([out, self.log_std.expand_as(out)], dim=1), value

    def distribution_of(self, out: torch.Tensor) -> torch.distributions.Distribution:
        if self.discrete:
            return torch.distributions.Categorical(logits=out, validate_args=False)
        return torch.distributions.Normal(out, self.log_std.exp().expand_as(out), validate_args=False)

    def distribution(self, obs: torch.Tensor) -> torch.distributions.Distribution:
        return self.distribution_of(self.pi(self.features(obs)))

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log-prob of ``actions``, entropy, value), each ``[B]``."""
        return self.evaluate_features(self.features(obs), actions)

    def evaluate_features(
        self, x: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``evaluate`` from the torso's output ``x`` (``features``)."""
        out, value = self.pi(x), self.v(x).squeeze(-1)
        dist = self.distribution_of(out)
        if self.discrete:
            return dist.log_prob(actions.long()), dist.entropy(), value
        return dist.log_prob(actions).sum(-1), dist.entropy().sum(-1), value


def flatten_params(module: nn.Module) -> tuple[np.ndarray, list]:
    """All parameters as one float32 buffer and the layout to rebuild them."""
    layout, chunks, offset = [], [], 0
    for name, tensor in module.state_dict().items():
        flat = tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        layout.append([name, "float32", list(tensor.shape), offset])
        chunks.append(flat)
        offset += flat.numel()
    return torch.cat(chunks).numpy(), layout


def load_flat(module: nn.Module, flat: np.ndarray, layout: list) -> None:
    module.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in unflatten(flat, layout).items()})
