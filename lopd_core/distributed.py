"""Data-parallel plumbing for `accelerate launch` / `torchrun`: rank, shards, token-weighted reductions.

Why our own reductions instead of wrapping the student in DDP: one LOPD step runs several backwards per
micro-batch (student, then the composer through the teacher, whose weights are the student's with the adapter
disabled in LoRA mode) and one more through the resampler, and every loss is a *token mean over the whole
batch*. A rank therefore divides its sums by the global token count (`global_sum` of the local counts, known
before any chunk runs), and a plain SUM all-reduce of the gradients then gives exactly the 1-process
whole-batch gradient — no matter how unevenly tokens fall on the ranks. A plain average over ranks would
weight a rank with short trajectories as much as one with long ones. DDP's averaging hooks would get this
wrong and would fire once per backward; the explicit reduction below happens once per optimizer step.

Every rank holds full replicas (weights and optimizer states) and steps identically on identical gradients,
so parameters, β and the state stay equal across ranks without broadcasting them; a checkpoint written by
rank 0 is the whole state and resumes under any number of processes. (`lopd.sharding: fsdp2` shards the student
and teacher instead: sharding.py, which keeps the same SUM semantics for their gradients.)

The process group comes from accelerate's `PartialState` (gloo on CPU, NCCL on CUDA) when WORLD_SIZE > 1, i.e.
under `accelerate launch --multi_gpu --num_processes N` or `torchrun --nproc_per_node N`. In a single process
every function here is a no-op or the identity, so library code calls them unconditionally.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist


def launched_world_size() -> int:
    """Processes the launcher started (WORLD_SIZE), before or without a process group."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def setup() -> None:
    """Join the launcher's process group (idempotent). On CUDA, pins this rank to its local GPU first, so that
    the `cuda` device of `model.device: auto` means this rank's GPU and not GPU 0 for everyone."""
    if launched_world_size() <= 1 or dist.is_initialized():
        return
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from accelerate import PartialState

    PartialState(cpu=not use_cuda)  # gloo on CPU, NCCL on CUDA; reads MASTER_ADDR/PORT, RANK, WORLD_SIZE
    if not dist.is_initialized():  # accelerate declined (an unusual launcher): initialise from the env ourselves
        dist.init_process_group("nccl" if use_cuda else "gloo")


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def shard_range(n: int) -> range:
    """This rank's contiguous slice of n items: ranks in order cover 0..n-1 exactly once (sizes differ by at
    most one). Contiguous, so that concatenating per-rank results in rank order restores the original order."""
    r, w = rank(), world_size()
    return range(r * n // w, (r + 1) * n // w)


def _device_for_collectives() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo takes CPU tensors."""
    if active() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_sum(values: Sequence[float]) -> list[float]:
    """Element-wise sum over ranks of a few numbers, in float64 so that counts and sums stay exact."""
    if not active():
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_device_for_collectives())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().tolist()


def sum_dict(values: dict[str, float]) -> dict[str, float]:
    """`global_sum` over a dict's values (one collective for all of them)."""
    keys = list(values)
    return dict(zip(keys, global_sum([values[k] for k in keys])))


def sum_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Replace each gradient by its sum over ranks (one flat buffer, one collective).

    Callers make every rank's loss a share of the global loss (its sums divided by the global normaliser), so
    the SUM is the 1-process whole-batch gradient. A parameter with no gradient on any rank keeps `None`
    (an optimizer skips it, as in one process); one with a gradient on some ranks only gets zeros elsewhere.
    """
    if not active():
        return
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    device = _device_for_collectives()
    has = torch.tensor([float(p.grad is not None) for p in params], device=device)
    dist.all_reduce(has, op=dist.ReduceOp.SUM)
    live = [p for p, h in zip(params, has.tolist()) if h > 0]
    if not live:
        return
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(device, torch.float32) for p in live]
    )
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p in live:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.device, p.dtype).clone()
        offset += n


def gather_lists(values: list) -> list:
    """Concatenate every rank's list in rank order (picklable items; for dashboard figures, not gradients)."""
    if not active():
        return list(values)
    out: list = [None] * world_size()
    dist.all_gather_object(out, list(values))
    return [v for part in out for v in part]


def barrier() -> None:
    if active():
        dist.barrier()
