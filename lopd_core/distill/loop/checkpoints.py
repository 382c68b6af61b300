"""The distill checkpoint: what it holds, how it is written, and when a resume is refused.

A checkpoint holds tensors and plain data only and is read with `weights_only=True` (nothing in it is unpickled
as an object). It records the settings it was made under (`resume_settings`), and a resume under other ones is
refused, each differing key listed, as is one whose checkpoint is past the steps asked for: either would
silently mix two runs in one set of curves (`lopd.resume_mismatch: warn` resumes anyway, saying so).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lopd_core import distributed as D
from lopd_core.config import Params
from lopd_core.distill.loop import sharded_checkpoint as SC
from lopd_core.distill.loop.resume import RESUME_FREE, RESUME_SETTINGS
from lopd_core.distill.update.inputs import StepModels
from lopd_core.distill.update.state import DistillState
from lopd_core.errors import StateError
from lopd_core.outputs import OutputPathError, atomic_write
from lopd_core.outputs import _reason as output_reason

CHECKPOINT_KEYS = ("state", "trainable", "composer", "opt_theta", "opt_phi", "rng_torch")
START_OVER = "rerun with --fresh to start over (`lopd distill --fresh`, or delete the file)"
NOT_RECORDED = "(not recorded)"


class CheckpointError(StateError):
    """A checkpoint that cannot be resumed as it is: unreadable, made under other settings, or past the steps
    asked for. The message names the file and how to go on."""


def resume_settings(params: Params) -> dict[str, Any]:
    """The settings a checkpoint records, flat: dotted key -> plain value (a list or mapping is one value)."""
    out: dict[str, Any] = {}
    for dotted in RESUME_SETTINGS:
        node = params
        for part in dotted.split("."):
            node = getattr(node, part)
        _flatten_settings(node, dotted, out)
    return out


def _flatten_settings(value, dotted: str, out: dict[str, Any]) -> None:
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _flatten_settings(getattr(value, f.name), f"{dotted}.{f.name}", out)
    elif dotted not in RESUME_FREE:
        out[dotted] = plain_data(value, dotted)


def settings_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One `key: old → new` line per setting that differs between a checkpoint and this run."""
    keys = sorted(set(recorded) | set(current))
    return [
        f"{k}: {recorded.get(k, NOT_RECORDED)!r} → {current.get(k, NOT_RECORDED)!r}"
        for k in keys
        if recorded.get(k, NOT_RECORDED) != current.get(k, NOT_RECORDED)
    ]


def plain_data(value, where: str = "checkpoint"):
    """`value` as `torch.load(weights_only=True)` reads it back: tensors, str, int, float, bool, None, and lists,
    tuples and dicts of them; numpy scalars become Python numbers. Anything else is refused, naming where it sits,
    so a checkpoint that could only be read by unpickling objects is never written."""
    if value is None or isinstance(value, (torch.Tensor, str, bool, int, float)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: plain_data(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain_data(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise TypeError(
        f"{where}: a {type(value).__name__} cannot go into a checkpoint read with weights_only=True; "
        "store it as tensors or plain data (dict, list, str, int, float, bool, None)"
    )


def load_failure(exc: Exception) -> str:
    """What torch.load found wrong with the file, in one line (without its advice on weights_only)."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1].split("Check the documentation", 1)[0]
    reason = " ".join(text.split())
    return f"{type(exc).__name__}: {reason[:160]}"


def read_checkpoint(path: Path) -> dict:
    """A checkpoint's contents as tensors and plain data (weights_only: no object is unpickled), or a
    CheckpointError naming the file when it is truncated, overwritten or not a checkpoint of this trainer."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001  damaged bytes fail in torch's zip reader or unpickler with any of
        # RuntimeError, UnpicklingError, EOFError, IndexError, KeyError, UnicodeDecodeError, struct.error ...
        raise CheckpointError(f"{path}: unreadable checkpoint ({load_failure(exc)}); {START_OVER}") from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(payload, dict) or k not in payload]
    if missing:
        raise CheckpointError(f"{path}: not a `lopd distill` checkpoint (no {', '.join(missing)}); {START_OVER}")
    return payload


def checkpoint_payload(models: StepModels, state: DistillState, params: Params, theta_dir: str | None = None) -> dict:
    """Everything a resume restores, as plain data (`plain_data` refuses anything else). `theta_dir`: θ and its
    optimizer state are in that sharded folder (sharded_checkpoint.py), not in the payload."""
    sharded = theta_dir is not None
    return plain_data(
        {
            "state": asdict(state),
            "settings": resume_settings(params),  # what a resume must agree with (`load_checkpoint`)
            "trainable": None if sharded else {k: v for k, v in models.trainable.state_dict().items()},
            "theta_dir": theta_dir,
            "composer": models.composer.state_dict(),
            "opt_theta": None if sharded else models.opt_theta.state_dict(),
            "opt_phi": models.opt_phi.state_dict(),
            "rng_torch": torch.get_rng_state(),
            "data_position": state.step * params.lopd.tasks_per_step,
            "ema": models.ema.state_dict() if models.ema is not None else None,  # SDPO's EMA teacher
            "teacher": refreshed_teacher_weights(models, state),  # lopd_gated_refresh: a separate θ̄ once refreshed
        }
    )


def save_checkpoint(models: StepModels, state: DistillState, params: Params, path: Path) -> Path:
    """Rank 0 writes the one checkpoint (every rank holds the same full state); the others wait for it. A
    sharded run's θ goes first into its own folder, every rank writing its shards (sharded_checkpoint.py)."""
    theta_dir = None
    if models.sharding.active:
        path.parent.mkdir(parents=True, exist_ok=True)
        theta_dir = SC.save_theta(models.trainable, models.opt_theta, path.parent, state.step)
    if not D.is_main():
        D.barrier()
        return path
    payload = checkpoint_payload(models, state, params, theta_dir)
    try:  # into a file object: a full disk is then an OSError naming its cause, not torch's "unexpected pos"
        with atomic_write(path) as f:  # a crash mid-write leaves the previous checkpoint intact
            torch.save(payload, f)
    except OutputPathError as exc:
        raise OutputPathError(
            f"cannot write the checkpoint {path}: {output_reason(exc.__cause__)}; the previous "
            "checkpoint (if any) is intact: free space and rerun to resume"
        ) from None
    if theta_dir is not None:
        SC.prune(path.parent, theta_dir)
    D.barrier()
    return path


def load_checkpoint(models: StepModels, params: Params, path: Path, log) -> DistillState | None:
    """The state to resume from, the models restored, when there is a checkpoint (None: none); refuse
    (CheckpointError) one that is unreadable or was made under other settings (`lopd.resume_mismatch: warn`
    resumes the latter anyway, saying so)."""
    if not path.exists():
        return None
    payload = read_checkpoint(path)
    recorded, mode = payload.get("settings"), params.lopd.resume_mismatch
    if recorded is None:
        refuse_or_warn(
            mode,
            log,
            f"{path}: the checkpoint records no settings (written before checkpoints recorded "
            "them), so a resume under other ones cannot be ruled out",
        )
    else:
        differences = settings_differences(recorded, resume_settings(params))
        if differences:
            message = f"{path}: the checkpoint was made under other settings (checkpoint → this run):"
            refuse_or_warn(mode, log, message, differences)
    try:
        return restore(models, payload, path.parent)
    except (KeyError, RuntimeError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: the checkpoint does not fit this run's models ({load_failure(exc)}); {START_OVER}"
        ) from None


def restore(models: StepModels, payload: dict, folder: Path) -> DistillState:
    theta_dir = payload.get("theta_dir")
    if theta_dir is not None:  # written sharded: read back resharded to this run, sharded or not
        if not isinstance(theta_dir, str) or not re.fullmatch(r"theta/step_\d+", theta_dir):
            raise ValueError(f"theta_dir {theta_dir!r} is not a folder this trainer writes")
        SC.load_theta(models.trainable, models.opt_theta, folder / theta_dir)
    elif models.sharding.active:  # written by a replicated run, resumed sharded
        SC.load_replicated_theta(models.trainable, models.opt_theta, payload["trainable"], payload["opt_theta"])
    else:
        models.trainable.load_state_dict(payload["trainable"])
        models.opt_theta.load_state_dict(payload["opt_theta"])
    # φ's configuration is not in its state (composer.PhiConfig): the resume's settings check holds it equal (the
    # composer section is among RESUME_SETTINGS); a checkpoint from before kept query_conditioned as a buffer there
    models.composer.load_state_dict({k: v for k, v in payload["composer"].items() if k != "query_conditioned"})
    models.opt_phi.load_state_dict(payload["opt_phi"])
    if models.ema is not None and payload.get("ema") is not None:
        models.ema.load_state_dict(payload["ema"])
    if payload.get("teacher") is not None:  # a refreshed separate θ̄ (LoRA with one copy: in `trainable`)
        models.teacher.lm.load_state_dict(payload["teacher"])
    torch.set_rng_state(payload["rng_torch"])
    return DistillState(**payload["state"])


def refreshed_teacher_weights(models: StepModels, state: DistillState) -> dict | None:
    """The teacher's weights for the checkpoint where they are a separate copy that a refresh changed (None
    otherwise: the start's θ̄ is rebuilt from the base, and LoRA's one copy is in the trainable state)."""
    if state.teacher_refreshes == 0 or models.teacher.adapter_owner is not None:
        return None
    return models.teacher.lm.state_dict()


def check_steps(state: DistillState, total: int, path: Path, mode: str, log) -> None:
    """A resumed checkpoint past the `total` steps asked for would pass its student off as a shorter run's."""
    if state.step > total:
        refuse_or_warn(
            mode,
            log,
            f"{path}: the checkpoint is at step {state.step}, past the {total} steps asked for (lopd.steps)",
            fix=f"set lopd.steps to {state.step} or more to keep it",
        )


def refuse_or_warn(mode: str, log, message: str, details: list[str] = (), fix: str = "") -> None:
    """Refuse a resume that would mix two runs (`lopd.resume_mismatch: error`), or (warn) say so and go on."""
    text = message + "".join(f"\n  {x}" for x in details) + ("\n" if details else "; ")
    if mode == "error":
        fixes = [f for f in (fix, START_OVER) if f]
        raise CheckpointError(f"{text}{', '.join(fixes)}, or set lopd.resume_mismatch=warn to resume anyway")
    log(f"distill: warning: {text}resuming anyway (lopd.resume_mismatch=warn)")
