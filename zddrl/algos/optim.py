"""Adam with torch.optim.Adam's update rule, in torch's fused Adam kernel (foreach kernels where there is none).

Why not ``torch.optim.Adam``: constructing any ``torch.optim`` optimizer imports ``torch._dynamo``,
which takes ~0.9 s on this kind of machine: a third of `zddrl train`'s start-up on CartPole. The
update below is the same arithmetic (tests compare it with torch's, step by step). Fused: one pass over the
parameters and both moments instead of six foreach passes; on the Pong example's 1M-parameter network a step
takes a quarter of the foreach form's time on a CPU core (``zddrl bench learner --profile`` shows the
optimizer's share of an update).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

FUSED = hasattr(torch, "_fused_adam_")
"""torch's fused Adam kernel (CPU and CUDA since torch 2.4); the foreach form otherwise."""


class Adam:
    """Adam (Kingma & Ba, 2015) without weight decay or amsgrad; ``param_groups[0]["lr"]`` is live."""

    def __init__(
        self, params: Iterable[torch.Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.param_groups: list[dict[str, Any]] = [{"lr": lr, "betas": betas, "eps": eps}]
        self.steps = 0
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self._step_of = [torch.zeros((), dtype=torch.float32, device=p.device) for p in self.params]
        """Each parameter's step count (its bias corrections), as torch's Adam keeps it: equal to ``steps`` for a
        parameter that had a gradient at every step."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        self.steps += 1
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for p in self.params:
            if p.grad is not None:
                params.append(p)
                grads.append(p.grad)
        if not params:
            return
        index = {id(p): i for i, p in enumerate(self.params)}
        m = [self.exp_avg[index[id(p)]] for p in params]
        v = [self.exp_avg_sq[index[id(p)]] for p in params]
        steps = [self._step_of[index[id(p)]] for p in params]
        torch._foreach_add_(steps, 1.0)  # per parameter, as torch's Adam: one without a gradient takes no step
        if FUSED:
            torch._fused_adam_(
                params, grads, m, v, [], steps, lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=0.0,
                eps=group["eps"], amsgrad=False, maximize=False,
            )  # fmt: skip
            return
        counts = [float(t) for t in steps]
        torch._foreach_lerp_(m, grads, 1 - beta1)  # m = beta1 * m + (1 - beta1) * g
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, [(1 - beta2**n) ** 0.5 for n in counts])
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(params, m, denom, [-group["lr"] / (1 - beta1**n) for n in counts])

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "step_of": [float(t) for t in self._step_of],
            "exp_avg": [t.clone() for t in self.exp_avg],
            "exp_avg_sq": [t.clone() for t in self.exp_avg_sq],
            "lr": self.param_groups[0]["lr"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        counts = state.get("step_of") or [self.steps] * len(self._step_of)  # checkpoints before per-parameter counts
        for step, n in zip(self._step_of, counts):
            step.fill_(float(n))
        for dst, src in zip(self.exp_avg + self.exp_avg_sq, list(state["exp_avg"]) + list(state["exp_avg_sq"])):
            dst.copy_(src)
        self.param_groups[0]["lr"] = float(state["lr"])
