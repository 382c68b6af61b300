"""Muon with the Newton–Schulz orthogonalisation batched over matrices of one shape.

Why not `torch.optim.Muon` as it is: it orthogonalises one matrix at a time. The embedded base has fourteen
small layer matrices (128 × 128, 64 × 128, 384 × 128, ...), so on a small CPU its step spends most of its time
in the overhead of some two hundred tiny products. Stacking the matrices that share a shape (after turning tall
ones wide) makes that 3–4 batched products per iteration, and the overhead goes with them
(`probes/warmstart_optimizer.py` measures both; the figures:
docs/experiments/2026-12-05-base-design-figures.md).

The arithmetic is torch's: Nesterov momentum as a lerp, the same quintic Newton–Schulz iteration, decoupled
weight decay, and the `match_rms_adamw` learning-rate scale (0.2·sqrt(max(rows, cols))), so the same learning
rate and weight decay mean the same thing in both (`tests/model/test_warmstart.py` checks it).

One difference: on the CPU the iteration runs in float32, where torch runs it in bfloat16. bfloat16 is what an
accelerator multiplies fastest; the machine the default base was first built on ran it at full speed too; but
on a CPU without bf16 instructions (AVX2 only, as some small machines) each bfloat16 product takes a slow path
many times slower than float32, so a time-budgeted warm start there runs a fraction of its steps and builds a
base that solves nothing (the figures: same note). float32 is also the more exact of the two.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's (Keller Jordan's) quintic


def iteration_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on an accelerator (torch's choice), float32 on the CPU (see the module's docstring)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def orthogonalise(
    stack: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Approximate U Vᵀ of each (rows ≤ cols) matrix in a (n, rows, cols) stack, computed in `dtype`
    (default: `iteration_dtype` of the stack's device)."""
    a, b, c = NS_COEFFICIENTS
    x = stack.to(dtype or iteration_dtype(stack.device))
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


class StackedMuon(torch.optim.Optimizer):
    """Muon for 2-D parameters, orthogonalising same-shaped updates together."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: torch.dtype | None = None,
    ):
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "ns_dtype": ns_dtype,
        }  # ns_dtype None: iteration_dtype
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes matrices only; got a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            by_shape: dict[tuple[int, int], list[tuple[torch.nn.Parameter, bool, torch.Tensor]]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                tall = p.shape[0] > p.shape[1]
                update = update.mT if tall else update
                by_shape[tuple(update.shape)].append((p, tall, update))
            for members in by_shape.values():
                ortho = orthogonalise(
                    torch.stack([u for _, _, u in members]), group["ns_steps"], dtype=group["ns_dtype"]
                )
                for (p, tall, _), o in zip(members, ortho):
                    scale = 0.2 * math.sqrt(max(p.shape))  # match_rms_adamw
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_((o.mT if tall else o).to(p.dtype), alpha=-group["lr"] * scale)
        return loss
