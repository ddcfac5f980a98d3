"""A learner as a group of shards: torch.distributed process group, collectives, device plan.

One shard per device. Every shard receives its own share of the trajectory stream from the broker,
trains on it, and keeps identical parameters to the others by averaging gradients with one
all-reduce per optimizer step (gloo on CPU, NCCL on CUDA; the usual ``env://`` rendezvous, so
``torchrun`` works as well as ``zddrl learner --gpus``). Shard 0 owns every side effect.

``ShardGroup`` with ``world_size == 1`` does no communication at all: a single learner runs the
same code with every collective a no-op, so the sharded path is the tested path.

Small Python values travel between shards as msgpack (never pickle), in two all-gathers: the
lengths, then the padded payloads.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import torch

from zddrl.shards.launch import DevicePlan, launched_as_shard

EXCHANGE_SLOT = 4096
"""Bytes per shard of an exchange's first all-gather: a poll's records fit, so one collective suffices."""


class ShardError(RuntimeError):
    """The group cannot go on: a shard died, timed out or diverged."""


class ShardGroup:
    """This shard's view of its group. ``rank == 0`` is the main shard."""

    def __init__(self, rank: int = 0, world_size: int = 1, device: str = "cpu") -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.comm_s = 0.0
        """Seconds spent in collectives (for the all-reduce share of step time)."""
        self._dist: Any = None  # torch.distributed, once a group of more than one shard is up

    @classmethod
    def from_env(cls, plan: DevicePlan, timeout_s: float) -> ShardGroup:
        """Join the group that the environment describes (torchrun's variables), or a group of one."""
        if not launched_as_shard():
            return cls(device=plan.devices[0])
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        if local >= len(plan.devices):
            raise ShardError(f"LOCAL_RANK {local} but --gpus lists only {len(plan.devices)} device(s) on this node")
        group = cls(rank, world, plan.devices[local])
        if world > 1:
            import torch.distributed as dist

            if group.device.type == "cuda":
                torch.cuda.set_device(group.device)
            dist.init_process_group(
                plan.backend,
                init_method="env://",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
            group._dist = dist
        return group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self._dist is not None

    def close(self) -> None:
        if self._dist is not None and self._dist.is_initialized():
            self._dist.destroy_process_group()
        self._dist = None

    # ---------------------------------------------------------------- collectives
    def _comm_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        # NCCL reduces device tensors only; gloo takes the CPU ones as they are.
        return tensor.to(self.device) if self.device.type == "cuda" else tensor

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the shards, in place (on the tensor's own device). Returns it."""
        if self._dist is None:
            return tensor
        t0 = time.perf_counter()
        comm = self._comm_tensor(tensor)
        try:
            self._dist.all_reduce(comm)
        except RuntimeError as exc:
            raise ShardError(f"all-reduce failed (a shard died or timed out): {exc}") from None
        if comm is not tensor:
            tensor.copy_(comm)
        self.comm_s += time.perf_counter() - t0
        return tensor

    def sum(self, *values: float | torch.Tensor) -> list[float]:
        """Element-wise float64 sums of ``values`` over the shards (one small all-reduce)."""
        floats = [float(v) for v in values]
        if self._dist is None:
            return floats
        return self.all_reduce_(torch.tensor(floats, dtype=torch.float64)).tolist()

    def exchange(self, obj: Any) -> list[Any]:
        """Every shard's ``obj``, in rank order (msgpack-serialisable values only).

        One all-gather of EXCHANGE_SLOT bytes per shard (length + payload) carries the usual exchange
        (a poll's trajectory records); when any payload is longer, a second all-gather of the longest
        one follows, on every shard alike (each saw every length in the first)."""
        if self._dist is None:
            return [obj]
        payload = msgpack.packb(obj, use_bin_type=True)
        t0 = time.perf_counter()
        try:
            slot = torch.zeros(EXCHANGE_SLOT, dtype=torch.uint8)
            slot[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
            if len(payload) <= EXCHANGE_SLOT - 8:
                slot[8 : 8 + len(payload)] = (
                    torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else slot[:0]
                )
            parts = self._all_gather(slot)
            sizes = [int(p[:8].view(torch.int64).item()) for p in parts]
            if max(sizes) > EXCHANGE_SLOT - 8:
                mine = torch.zeros(max(sizes), dtype=torch.uint8)
                mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else mine[:0]
                parts = [p[8:] if n <= EXCHANGE_SLOT - 8 else p for p, n in zip(parts, sizes)]
                long_parts = self._all_gather(mine)
                parts = [long_parts[i] if n > EXCHANGE_SLOT - 8 else parts[i] for i, n in enumerate(sizes)]
            else:
                parts = [p[8:] for p in parts]
        except RuntimeError as exc:
            raise ShardError(f"exchange between shards failed (a shard died or timed out): {exc}") from None
        self.comm_s += time.perf_counter() - t0
        return [msgpack.unpackb(p[:n].numpy().tobytes(), raw=False) for p, n in zip(parts, sizes)]

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [self._comm_tensor(torch.empty_like(tensor)) for _ in range(self.world_size)]
        self._dist.all_gather(parts, self._comm_tensor(tensor))
        return [p.cpu() for p in parts]

    def broadcast(self, obj: Any) -> Any:
        """The main shard's ``obj`` on every shard."""
        return self.exchange(obj if self.is_main else None)[0]

    def sync_module(self, params: Iterable[torch.Tensor]) -> None:
        """Copy the main shard's tensors into every shard's (identical start, whatever the seeds)."""
        if self._dist is None:
            return
        for p in params:
            comm = self._comm_tensor(p.data)
            self._dist.broadcast(comm, src=0)
            if comm is not p.data:
                p.data.copy_(comm)

    def average_gradients(self, params: Sequence[torch.Tensor], weight: float) -> float:
        """Make every shard's gradients the ``weight``-weighted mean of all shards' gradients.

        ``weight`` is the number of samples this shard's loss averaged over (0: it had none this
        step; its gradients, zero, still take part). One flat all-reduce carries the gradients and
        the weights together. Returns the total weight over all shards.
        """
        if self._dist is None:
            return weight
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [grads[0].new_tensor([1.0])])
        flat.mul_(weight)
        self.all_reduce_(flat)
        total = float(flat[-1])
        if total > 0:
            flat.div_(total)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p)
            offset += n
        return total
