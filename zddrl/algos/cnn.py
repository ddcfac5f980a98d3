"""Convolutional torsos for observations from pixels: ``[C, H, W]``, uint8 on the wire, scaled here.

* ``nature_cnn``: Mnih et al. 2015, "Human-level control through deep reinforcement learning" (Nature 518):
  conv 32x8x8/4, 64x4x4/2, 64x3x3/1, then a fully connected layer (512).
* ``impala_cnn``: Espeholt et al. 2018, "IMPALA" (arXiv:1802.01561), the deep ResNet torso of its Figure 3:
  three sections of conv 3x3 (16, 32, 32 channels), max-pool 3x3/2 and two residual blocks, then a fully
  connected layer (256).
* ``small_cnn``: the vision network RLlib's and PARL's fast IMPALA/APPO Pong examples use on 42x42 frames: conv
  16x4x4/2 and 32x4x4/2 (padded: 42 -> 21 -> 11), then a layer of 256 over the whole 11x11x32 map (RLlib writes it
  as an 11x11 convolution, the same function as the fully connected layer here). About 2.4M multiply-adds per
  frame, a quarter of the Nature CNN's on 84x84, while its strides of 2 keep a one-pixel ball visible (the Nature
  CNN's 8x8/4 first layer on 42x42 frames keeps only a 1x1 map at the end).

The policy and value heads share the torso, as both papers (and CleanRL's and SB3's Atari agents) do. Weights
start orthogonal with gain sqrt(2) (CleanRL's ``layer_init``); the model's heads choose their own gains.
"""

from __future__ import annotations

import math
from typing import TypeVar

import torch
from torch import nn

PIXEL_SCALE = 1.0 / 255.0
"""uint8 pixels enter the network in [0, 1]: scaled inside the forward pass, never on the wire."""


def scaled(obs: torch.Tensor) -> torch.Tensor:
    """Pixels (uint8) as float32 in [0, 1]; float observations as they are."""
    if obs.dtype == torch.uint8:
        return obs.float().mul_(PIXEL_SCALE)
    return obs.float()


_Layer = TypeVar("_Layer", nn.Conv2d, nn.Linear)


def _init(layer: _Layer) -> _Layer:
    nn.init.orthogonal_(layer.weight, math.sqrt(2))
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)
    return layer


def nature_torso(channels: int) -> nn.Sequential:
    """The convolutions of Mnih et al. 2015 (an 84x84 input leaves 64 x 7 x 7), flattened."""
    return nn.Sequential(
        _init(nn.Conv2d(channels, 32, 8, stride=4)),
        nn.ReLU(),
        _init(nn.Conv2d(32, 64, 4, stride=2)),
        nn.ReLU(),
        _init(nn.Conv2d(64, 64, 3, stride=1)),
        nn.ReLU(),
        nn.Flatten(),
    )


class Residual(nn.Module):
    """``x + conv(relu(conv(relu(x))))``: IMPALA's residual block (same channels, same size)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = _init(nn.Conv2d(channels, channels, 3, padding=1))
        self.conv1 = _init(nn.Conv2d(channels, channels, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


def impala_torso(channels: int, depths: tuple[int, ...] = (16, 32, 32)) -> nn.Sequential:
    """IMPALA's ResNet torso (Espeholt et al. 2018, Figure 3, right), flattened after a final ReLU."""
    layers: list[nn.Module] = []
    for depth in depths:
        layers += [
            _init(nn.Conv2d(channels, depth, 3, padding=1)),
            nn.MaxPool2d(3, stride=2, padding=1),
            Residual(depth),
            Residual(depth),
        ]
        channels = depth
    return nn.Sequential(*layers, nn.ReLU(), nn.Flatten())


def small_torso(channels: int) -> nn.Sequential:
    """RLlib's 42x42 vision network's convolutions (42 -> 21 -> 11), flattened."""
    return nn.Sequential(
        _init(nn.Conv2d(channels, 16, 4, stride=2, padding=1)),
        nn.ReLU(),
        _init(nn.Conv2d(16, 32, 4, stride=2, padding=2)),
        nn.ReLU(),
        nn.Flatten(),
    )


TORSOS = {"nature_cnn": nature_torso, "impala_cnn": impala_torso, "small_cnn": small_torso}


class PixelTorso(nn.Module):
    """Scale, convolve, flatten, then one fully connected ReLU layer of ``width``: ``[B, C, H, W] -> [B, width]``."""

    def __init__(self, kind: str, obs_shape: tuple[int, ...], width: int) -> None:
        super().__init__()
        if len(obs_shape) != 3:
            raise ValueError(f"model.kind {kind!r} needs [C, H, W] observations, the env has {list(obs_shape)}")
        self.conv = TORSOS[kind](obs_shape[0])
        with torch.no_grad():  # the flattened size follows from the input size: ask the torso once
            flat = self.conv(torch.zeros(1, *obs_shape)).shape[1]
        self.fc = _init(nn.Linear(flat, width))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(self.conv(scaled(obs))))
