"""FSDP2 sharding of the student and the frozen teacher (`lopd.sharding: fsdp2`), under `accelerate launch` /
`torchrun` as for data parallelism (distributed.py): each rank stores 1/N of every sharded weight, of its gradient
and of the optimizer's state.

How it is applied: `torch.distributed.fsdp.fully_shard` on each decoder block, then on the causal LM (the
embeddings, final norm and head). In LoRA mode on the causal LM inside the PEFT wrapper, after the adapter is
injected, so that the frozen base and the adapter are sharded alike; the teacher is then the same sharded module
with the adapter disabled. In full mode the teacher's separate frozen copy is sharded the same way. The composer
(a small resampler) stays replicated, its gradient summed by distributed.py; its gradient path runs through the
sharded teacher unchanged (the teacher's weights need no gradient, its activations carry one to the latents).

Why the weights are gathered for a whole step rather than per block: FSDP2 all-gathers a block's weights in
every forward and reduce-scatters its gradient in every backward, which are collectives — every rank must run
the same number of passes in the same order. A LOPD step does not: each rank decodes its own trajectories
(generation stops when its own sequences end), and encodes, scores and back-propagates its own number of
micro-batches. So `gathered()` unshards every sharded module once per step (one all-gather each, on every rank),
turns off FSDP's per-backward gradient reduction, and the step runs its passes unshared; `reduce_gradients()` then
reduce-scatters the accumulated gradients once, by a one-token pass that every rank runs identically (FSDP's
own gradient-accumulation path: the accumulated gradient is reduced on the first backward that syncs). The
gradient reduction is a SUM (divide factor 1), as distributed.py's is: every rank's loss is already its share of
the whole batch's token mean. Between steps, and for the optimizer's state, each rank holds 1/N; during a step
it holds the full weights and gradient as a replicated run does. Resharding per block during a step would need
every rank to run the same passes (padding micro-batches and decode steps): not done.

Checkpoints are written with `torch.distributed.checkpoint` (each rank writes its shards) and read back under any
number of processes, sharded or not (checkpoints.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from lopd_core import distributed as D


def setup() -> None:
    """The process group FSDP2 needs, also for one process (a one-rank group, so the same code runs on one GPU)."""
    D.setup()
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def decoder_blocks(lm) -> list[torch.nn.Module]:
    """The causal LM's transformer blocks (`lm.model.layers` in the Hugging Face decoder layout)."""
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"lopd.sharding=fsdp2: {type(lm).__name__} has no .model.layers to shard block by block")
    return list(layers)


def shard_lm(lm) -> list[torch.nn.Module]:
    """`fully_shard` each block, then the LM; returns the sharded modules, the LM last (its root)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if next(lm.parameters()).is_cuda else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    modules = []
    for block in decoder_blocks(lm):
        modules.append(fully_shard(block, mesh=mesh))
    modules.append(fully_shard(lm, mesh=mesh))
    # FSDP takes the first module run as the root of the rest; the scoring code runs `lm.model` and `lm.lm_head`
    # apart (logits at action positions only), so the LM is run once here, every rank alike, to be that root.
    with torch.no_grad():
        lm(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
    modules[-1].reshard()  # FSDP keeps a root's weights whole after its forward; sharded from here on
    for m in modules:
        m.set_gradient_divide_factor(1.0)  # a SUM over ranks: each loss is already its share (module docstring)
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
        m.set_reduce_scatter_unused_params(True)  # every rank reduces the same tensors, used by it or not
    return modules


class Sharding:
    """The sharded modules of a run (empty for `lopd.sharding: none`) and the three things a step asks of them."""

    def __init__(self, student_modules: list, teacher_modules: list = ()):
        self.student_modules = list(student_modules)
        self.teacher_modules = list(teacher_modules)
        self._depth = 0  # nesting of `gathered` blocks

    @property
    def active(self) -> bool:
        return bool(self.student_modules or self.teacher_modules)

    @property
    def modules(self) -> list:
        return self.student_modules + self.teacher_modules

    @contextmanager
    def gathered(self):
        """Every sharded weight whole on every rank for the block's passes, however many each rank runs;
        sharded again on leaving. Re-entrant: an inner block inside an outer one changes nothing."""
        self._depth += 1
        if self._depth == 1:
            for m in self.modules:
                m.set_reshard_after_forward(False)
                m.set_reshard_after_backward(False)
                m.set_requires_gradient_sync(False)
                m.unshard()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for m in self.modules:
                    m.reshard()
                    m.set_requires_gradient_sync(True)
                    m.set_reshard_after_forward(True)
                    m.set_reshard_after_backward(True)

    @contextmanager
    def student_sharded(self):
        """The student's optimizer step inside a gathered block: on the sharded parameters, which hold the
        reduced gradient and the optimizer's state; gathered again afterwards, so that the step's later passes
        read the updated weights, as in a replicated run."""
        gathered = self._depth > 0
        if gathered:
            for m in self.student_modules:
                m.reshard()
        try:
            yield
        finally:
            if gathered:
                for m in self.student_modules:
                    m.unshard()

    def reduce_gradients(self, student_lm) -> None:
        """Reduce-scatter the student's accumulated gradients (a SUM over ranks) by one identical one-token pass
        on every rank, whose loss is zero: it adds nothing but lets FSDP reduce what the step accumulated."""
        if not self.student_modules:
            return
        for m in self.student_modules:
            m.set_requires_gradient_sync(True)
        device = next(student_lm.parameters()).device
        ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        logits = student_lm(input_ids=ids).logits
        (logits.sum() * 0.0).backward()
        for m in self.student_modules:
            m.set_requires_gradient_sync(False)


def local_bytes(tensors) -> int:
    """Bytes this rank stores for `tensors` (a DTensor counts its local shard only)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def state_bytes(module, optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (what sharding divides by N)."""
    params = list(module.parameters())
    opt = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params), "optimizer": local_bytes(opt)}


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a reduction such as a gradient norm), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def whole_state_dict(module) -> dict:
    """A sharded module's whole state dict on rank 0 (on the CPU; empty on the other ranks). Every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
