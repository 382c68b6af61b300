"""Logits from the LM head in float32, for the log-probs that training reads.

A bf16 model's own head rounds every logit to bf16: 8 significant bits, so a logit near 16 moves by up to 1/32,
and the log-softmax over a large vocabulary inherits that error in every log-prob, every KL term and every
importance weight. Here a model whose head or hidden states are not float32 gets the head's matmul in float32
from its final hidden states (the bf16 values are exact in float32; only the products' rounding changes). A
float32 model runs its own head exactly as before, bit for bit. Callers pass only the hidden states of the
positions they score, so the float32 copy of the head weight, (V, D), is the one extra tensor this costs.
"""

from __future__ import annotations

import torch
from torch import Tensor


def head_logits(model, hidden: Tensor) -> Tensor:
    """(..., D) final hidden states -> (..., V) float32 logits of `model.lm_head`."""
    head = model.lm_head
    if not isinstance(head, torch.nn.Linear) or (hidden.dtype == torch.float32 and head.weight.dtype == torch.float32):
        return head(hidden).float()
    logits = hidden.float() @ head.weight.float().T
    return logits if head.bias is None else logits + head.bias.float()


def uses_float32_head(model) -> bool:
    """Whether `model`'s own forward already yields float32-head logits (then nothing needs recomputing)."""
    head = getattr(model, "lm_head", None)
    return head is None or not isinstance(head, torch.nn.Linear) or head.weight.dtype == torch.float32
