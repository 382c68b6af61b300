"""The composer's encoder LoRA: a low-rank update of the frozen base that only the composer's encoder reads with.

The official composer encodes each experience with the base plus a trainable LoRA (rank 8 on every projection);
ours reads the frozen base's states (composer.py). This is that option, behind `composer.encoder_lora_rank`: its
weights belong to φ (saved, fitted and loaded with it), and they are applied only while the encoder reads, through
forward hooks on the base's projections, so the teacher that reads the latents — the same frozen base — never
sees them. Hooks rather than a PEFT wrapper: the base is shared with the teacher (and, in LoRA student mode, is
the student with its own adapter switched off), so nothing may be injected into it permanently.

Which weights it trains: the cold start and the in-world fit train all of φ, this included. Distillation keeps it
as the fit left it — the encoder's states are cached per experience there (composer.py, ExperienceEncoder), and a
changing encoder would make every cached state stale — and trains the resampler only. Every cache of what the
encoder reads has the LoRA's `fingerprint` in its key all the same, so a cache can never serve states (or latents)
read under other LoRA weights: after a fit, a refit, a loaded checkpoint or a LoRA edited by hand, the next read
misses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from lopd_core.distill.scoring.models import LORA_TARGETS


def _plain_name(name: str) -> str:
    """A projection's name with any PEFT wrapping taken out, so a base and the same base wrapped agree."""
    return name.replace(".base_layer", "").replace("base_model.model.", "")


def projections(lm) -> dict[str, nn.Linear]:
    """The base's projections the LoRA updates, by plain name (the decoder's `lm.model`, the LM head excluded)."""
    found = {}
    for name, module in lm.model.named_modules():
        plain = _plain_name(name)
        if isinstance(module, nn.Linear) and plain.rsplit(".", 1)[-1] in LORA_TARGETS and "lora_" not in name:
            found[plain] = module
    return found


class EncoderLoRA(nn.Module):
    """ΔW = (α / r)·B·A per projection, B zero at the start so a new LoRA reads exactly as the frozen base."""

    def __init__(self, shapes: dict[str, tuple[int, int]], rank: int, alpha: float | None = None):
        super().__init__()
        self.rank, self.scale = rank, (alpha if alpha is not None else 2.0 * rank) / rank
        self.names = sorted(shapes)
        draw = torch.Generator().manual_seed(rank)  # its own stream: building φ leaves the global one as it was
        self.a = nn.ParameterList(
            nn.Parameter(torch.randn(rank, shapes[n][1], generator=draw) / shapes[n][1] ** 0.5) for n in self.names
        )
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(shapes[n][0], rank)) for n in self.names)
        self._fingerprint: tuple[tuple, str] | None = None  # (the weights' versions, their digest)

    @classmethod
    def for_model(cls, lm, rank: int) -> EncoderLoRA:
        """A LoRA of `rank` on every projection of `lm`."""
        shapes = {name: (m.out_features, m.in_features) for name, m in projections(lm).items()}
        if not shapes:
            raise ValueError(f"composer.encoder_lora_rank: the model has none of the projections {LORA_TARGETS}")
        return cls(shapes, rank)

    def fingerprint(self) -> str:
        """A digest of the rank, the scale and every weight's bytes: equal for equal LoRAs, different after any
        change. Hashed again only when a weight changed since the last call: an optimizer step, `load_state_dict`
        and an edit under `torch.no_grad()` each bump a tensor's version counter, and `.to()` gives it new storage
        (an edit through `.data` does neither: nothing in the project edits the LoRA that way)."""
        versions = tuple((p.data_ptr(), p._version) for p in self.parameters())
        if self._fingerprint is None or self._fingerprint[0] != versions:
            digest = hashlib.sha1(f"{self.rank}:{self.scale}:{','.join(self.names)}".encode())
            for p in self.parameters():
                digest.update(str(p.dtype).encode())
                digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            self._fingerprint = (versions, digest.hexdigest())
        return self._fingerprint[1]

    def trains(self) -> bool:
        """Whether reading with it now builds a graph to its weights (training, gradients on)."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())

    @contextmanager
    def applied(self, lm) -> Iterator[None]:
        """While open, `lm`'s projections add this LoRA's update to their output."""
        found = projections(lm)
        missing = [n for n in self.names if n not in found]
        if missing:
            raise ValueError(f"encoder LoRA: the model lacks the projections {missing[:3]} it was built for")
        handles = [found[n].register_forward_hook(self._hook(i)) for i, n in enumerate(self.names)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, i: int):
        def add_update(_module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
            a, b = self.a[i], self.b[i]
            x = inputs[0].to(a.dtype)
            return output + ((x @ a.T) @ b.T * self.scale).to(output.dtype)

        return add_update


def lora_fingerprint(lora: EncoderLoRA | None) -> str:
    """What a cache key carries for the encoder's LoRA: its fingerprint, or "" for the frozen base alone."""
    return "" if lora is None else lora.fingerprint()
