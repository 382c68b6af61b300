"""The student's weights and optimizer state in a distill checkpoint written by a sharded run (`lopd.sharding:
fsdp2`): a `torch.distributed.checkpoint` folder beside checkpoint.pt, each rank writing its own shards.

Why a folder per step (`theta/step_000003/`): checkpoint.pt names the folder it goes with and is replaced
atomically after the folder is complete, so a crash while the shards are written leaves the previous pair intact;
older folders are removed only after that. The folder is read back under any number of processes, sharded or
not (the reader reshards; in one unsharded process it fills plain tensors), and a replicated run's checkpoint
(θ inside checkpoint.pt) loads into a sharded run, so a run may change `lopd.sharding` or its process count
between a stop and a resume. What DCP reads is tensors and plain metadata: nothing is unpickled as an object.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from lopd_core import distributed as D

FOLDER = "theta"


def folder_name(step: int) -> str:
    return f"{FOLDER}/step_{step:06d}"


def save_theta(trainable: torch.nn.Module, optimizer: torch.optim.Optimizer, out_dir: Path, step: int) -> str:
    """Every rank writes its shards of θ and of its optimizer state; returns the folder, relative to out_dir."""
    name = folder_name(step)
    target = out_dir / name
    if D.is_main() and target.exists():  # a previous attempt at this step, never named by checkpoint.pt
        shutil.rmtree(target)
    D.barrier()
    model_sd, optim_sd = get_state_dict(trainable, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(target))
    return name


def load_theta(trainable: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """θ and its optimizer state from a DCP folder, resharded to this run's layout (any process count)."""
    model_sd, optim_sd = get_state_dict(trainable, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(trainable, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_replicated_theta(
    trainable: torch.nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict
) -> None:
    """A replicated run's θ (a plain state dict) and optimizer state (keyed by parameter index, in the order the
    optimizer was built: the trainable parameters that need a gradient) into a sharded run."""
    names = [n for n, p in trainable.named_parameters() if p.requires_grad]
    by_index = dict(enumerate(names))
    groups = [{**g, "params": [by_index[i] for i in g["params"]]} for g in optim_sd["param_groups"]]
    fqn_optim = {"state": {by_index[i]: s for i, s in optim_sd["state"].items()}, "param_groups": groups}
    set_state_dict(
        trainable,
        optimizer,
        model_state_dict=model_sd,
        optim_state_dict=fqn_optim,
        options=StateDictOptions(full_state_dict=True),
    )


def prune(out_dir: Path, keep: str) -> None:
    """Remove the folders of earlier checkpoints once checkpoint.pt names `keep` (rank 0 only)."""
    root = out_dir / FOLDER
    if not D.is_main() or not root.exists():
        return
    for old in root.iterdir():
        if old.is_dir() and old != out_dir / keep:
            shutil.rmtree(old, ignore_errors=True)
