"""``learner.autocast``: whether the CNN torso of the training forward pass runs in bfloat16 on this host.

bf16 pays only where the hardware computes it: on a 2-core AMD EPYC without bf16 units (AVX2 only) torch emulates
it and the Pong example's learner ran at 0.12x of float32 (52 against 427 samples/s, `zddrl bench learner --config
examples/pong_appo.toml --autocast off,bf16`); on a host with AMX the same learner ran 1.98x faster in bf16; on one
with avx512_bf16 but no AMX, 1.04x slower. No rule from the CPU's name covers all three, so ``auto`` reads the units
first (none: float32, nothing to measure) and otherwise times the torso's forward and backward pass in both
precisions on a batch of the run's own observation shape, keeping bf16 only when it is clearly faster. On a GPU,
bf16 where the device supports it. The choice is made once per learner, by the main shard for the whole group.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from zddrl.config import Config
from zddrl.envs import EnvSpec
from zddrl.shards.group import ShardGroup

BF16_UNITS = ("avx512_bf16", "amx_bf16")
"""CPU units that compute bfloat16 matrix products natively; without one of them torch emulates bf16."""
TIMING_BATCH = 32
"""Observations per timed pass: big enough that a convolution's cost dominates, small enough to cost ~1 s."""
TIMING_REPEATS = 3
"""Timed passes per precision, alternating; the fastest of each counts (other processes start beside a learner)."""
BF16_MARGIN = 0.9
"""bf16 is chosen only when its pass takes at most this fraction of float32's: a mode within noise of the other
buys nothing and float32 keeps full precision."""


class AutocastChoice(NamedTuple):
    """What the learner runs its torso in, and why (logged once, written to meta.json)."""

    mode: str
    """``off`` (float32) or ``bf16``."""
    reason: str
    ms_off: float | None = None
    """The timed pass in float32, when ``auto`` measured one (milliseconds for ``TIMING_BATCH`` observations)."""
    ms_bf16: float | None = None


def bf16_units() -> list[str]:
    """The units of ``BF16_UNITS`` this CPU has."""
    caps = torch.cpu.get_capabilities()
    return [unit for unit in BF16_UNITS if caps.get(unit)]


def choose_autocast(config: Config, model: torch.nn.Module, env: EnvSpec, device: torch.device) -> AutocastChoice:
    """The mode for ``learner.autocast`` on this host: the configured one, or ``auto``'s choice (module docstring).

    ``model`` is the run's acting network on ``device``; only a built-in CNN (one with a ``torso``) has anything to
    run in bf16."""
    asked = config.learner.autocast
    if asked != "auto":
        return AutocastChoice(asked, "set by learner.autocast")
    if getattr(model, "torso", None) is None:
        return AutocastChoice("off", "no built-in CNN torso (an MLP or a network of your own runs in float32)")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return AutocastChoice("bf16", f"{torch.cuda.get_device_name(device)} computes bf16")
        return AutocastChoice("off", f"{torch.cuda.get_device_name(device)} has no bf16")
    units = bf16_units()
    if not units:
        return AutocastChoice("off", f"this CPU has none of {', '.join(BF16_UNITS)} (torch would emulate bf16)")
    ms_off, ms_bf16 = time_torso(model, env, device)
    faster = ms_bf16 <= BF16_MARGIN * ms_off
    verdict = "faster" if faster else f"not {1 / BF16_MARGIN:.2f}x faster"
    return AutocastChoice(
        "bf16" if faster else "off",
        f"{', '.join(units)}: the torso's pass took {ms_bf16:.1f} ms in bf16, {ms_off:.1f} ms in float32 ({verdict})",
        ms_off,
        ms_bf16,
    )


def time_torso(model: torch.nn.Module, env: EnvSpec, device: torch.device) -> tuple[float, float]:
    """Fastest forward + backward pass of ``model.torso`` over ``TIMING_BATCH`` observations, in float32 and under
    bf16 autocast (ms). Gradients are cleared afterwards: the model is untouched."""
    dtype = torch.uint8 if env.obs_dtype == "uint8" else torch.float32
    obs = torch.zeros((TIMING_BATCH, *env.obs_shape), dtype=dtype, device=device)
    torso: torch.nn.Module = model.torso  # type: ignore[assignment]  # an ActorCritic with a CNN kind

    def one(bf16: bool) -> float:
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = torso(obs)
        out.float().sum().backward()
        return (time.perf_counter() - start) * 1e3

    one(False), one(True)  # warm-up: oneDNN builds its kernels on the first call of each precision
    best = {False: float("inf"), True: float("inf")}
    for _ in range(TIMING_REPEATS):
        for bf16 in (False, True):
            best[bf16] = min(best[bf16], one(bf16))
    model.zero_grad(set_to_none=True)
    return best[False], best[True]


def agreed_autocast(
    config: Config, model: torch.nn.Module, env: EnvSpec, device: torch.device, group: ShardGroup
) -> AutocastChoice:
    """``choose_autocast`` on the main shard, the same answer on every shard (a timing may differ by shard)."""
    if not group.sharded:
        return choose_autocast(config, model, env, device)
    choice = choose_autocast(config, model, env, device) if group.is_main else None
    return AutocastChoice(*group.broadcast(choice))  # through msgpack: a list on the other shards
