"""`lopd distill`'s loop: steps until lopd.steps, the CSVs rewritten after each, checkpoints, and the two alarms
of a run going wrong (too many skipped updates; a margin met only by divergence). It sits above the trainer: it
drives a `Distiller`, which never calls back into it.

Everything a step needs is derived from (seed, step), so a run resumed from its checkpoint (checkpoints.py)
prints the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import csv
import math
from dataclasses import asdict
from pathlib import Path

from lopd_core import distributed as D
from lopd_core import sharding as SH
from lopd_core.distill.composer.composer import save_composer
from lopd_core.distill.loop.trainer import Distiller
from lopd_core.distill.scoring.models import export_student, replicated_copy
from lopd_core.distill.update.dashboard import CSV_COLUMNS, DIAGNOSTIC_COLUMNS, DashboardRow
from lopd_core.distill.update.state import DistillState
from lopd_core.errors import TrainingDiverged
from lopd_core.outputs import atomic_write

DIVERGENCE_WINDOW = 20  # steps of reverse KL the alert compares against
DIVERGENCE_FACTOR = 10.0  # a KL this many times its recent median is a teacher pushed away, not a learning one


def write_rows(path: Path, columns: list[str], rows: list[dict]) -> None:
    """Rewrite the CSV with `rows` (atomic), so a resumed run never duplicates or loses a step."""
    with atomic_write(path, text=True) as f:  # an OSError is one OutputPathError naming the file
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def margin_by_divergence(recent_kl: list[float], kl: float, delta: float, margin: float) -> bool:
    """Does this step meet δ̄ ≥ m only because the composer pushed the teacher away from the student?

    With most trajectories failing, A(τ) < 0 on most of the batch, and any teacher that differs from the student
    scores the student's own samples lower, so δ̄ rises with the reverse KL alone (README, "The privileged
    margin, β and `lopd.advantage`"). The sign of it: the margin met while the KL jumps to many times its recent
    median. Needs a full window of history, so the first steps (KL still falling from φ0) never alert.
    """
    if len(recent_kl) < DIVERGENCE_WINDOW or margin <= 0 or delta < margin:
        return False
    typical = sorted(recent_kl[-DIVERGENCE_WINDOW:])[DIVERGENCE_WINDOW // 2]
    return math.isfinite(kl) and kl > DIVERGENCE_FACTOR * max(typical, 1e-6)


def check_divergence(distiller: Distiller, total_steps: int) -> None:
    """Fail as soon as the skipped updates exceed the allowed share of the whole run's updates (from then on
    the run cannot end under it), before a diverged model is checkpointed or exported."""
    per_step = 2 if any(spec.composer.trainable for spec in distiller.phases) else 1
    allowed = distiller.cfg.max_skipped_share * total_steps * per_step
    skipped = distiller.state.skipped_updates
    if skipped > allowed:
        raise TrainingDiverged(
            f"distill: {skipped} of {distiller.state.step * per_step} updates so far were skipped as non-finite "
            f"(lopd.max_skipped_share={distiller.cfg.max_skipped_share:g} of {total_steps * per_step}): training "
            f"diverged; lower lopd.lr_student / lopd.lr_composer and rerun with --fresh"
        )


def _report(distiller: Distiller, r: DashboardRow, total: int) -> None:
    """The step's log line, and the warning of a margin met only because the teacher moved away."""
    distiller.log(
        f"distill: step {r.step}/{total} reward {r.reward_mean:.3f} success {r.success_rate:.3f} "
        f"loss {r.distill_loss:.4f} δ̄ {r.delta:+.4f} β {r.beta:.3f} ({r.step_seconds:.1f}s)"
    )
    history = distiller.state.history
    recent = [h["row"]["kl_phi"] for h in history[-DIVERGENCE_WINDOW - 1 : -1] if math.isfinite(h["row"]["kl_phi"])]
    if distiller.method.composer.trainable and margin_by_divergence(recent, r.kl_phi, r.delta, distiller.margin):
        distiller.log(
            f"distill: step {r.step}: warning: δ̄ {r.delta:.3f} ≥ m = {distiller.margin:.4g} only "
            f"because the teacher moved away from the student (reverse KL {r.kl_phi:.3f}, over "
            f"{DIVERGENCE_FACTOR:g}× its median of the last {DIVERGENCE_WINDOW} steps): the student "
            "is being distilled toward a worse teacher; lopd.advantage=group removes this incentive "
            "(DESIGN §3)"
        )


def run_distill(
    distiller: Distiller, *, steps: int | None = None, resume: bool = True, stop_after: int | None = None, on_step=None
) -> DistillState:
    """Train to `steps` (default lopd.steps; more draws further blocks of the task stream, `step_tasks`); resume
    from the last checkpoint when there is one. `stop_after` ends the process early (tests of resumption).
    `on_step(distiller, result)` runs after each step, before its checkpoint (the growing bank's refresh)."""
    cfg = distiller.cfg
    total = steps or cfg.steps
    if resume and distiller.load_checkpoint():
        distiller.check_steps(total)
        distiller.log(
            f"distill: resumed at step {distiller.state.step} (β={distiller.state.beta:.3f}"
            + (f", m={distiller.margin:.4g}" if distiller.margin is not None else "")
            + ")"
        )
    distiller.price_margin()  # `lopd.margin: auto`, before step 1 (a resumed run keeps the checkpoint's m)
    csv_path = Path(cfg.csv)
    diag_path = csv_path.with_name(csv_path.stem + "_diagnostics.csv")
    history = distiller.state.history
    while distiller.state.step < total:
        out = distiller.step()
        if on_step is not None:
            with distiller.sharding.gathered():  # a hook may run the student any number of times per rank
                on_step(distiller, out)
        # checkpointed as plain data, without the per-trajectory lists
        history.append({"row": asdict(out.row), "diagnostics": out.diagnostics})
        if D.is_main():  # rows are already whole-batch figures, equal on every rank
            write_rows(csv_path, CSV_COLUMNS, [h["row"] for h in history])
            write_rows(diag_path, DIAGNOSTIC_COLUMNS, [h["diagnostics"] for h in history])
        _report(distiller, out.row, total)
        check_divergence(distiller, total)
        if distiller.state.step % cfg.checkpoint_every == 0 or distiller.state.step == total:
            distiller.save_checkpoint()
        if stop_after is not None and distiller.state.step >= stop_after:
            break
    return distiller.state


def export(distiller: Distiller, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    trainable, student = distiller.trainable, distiller.student
    if distiller.sharding.active:  # every rank sends its shards; rank 0 rebuilds an unsharded copy
        whole = SH.whole_state_dict(trainable)
        if D.is_main():
            trainable, student = replicated_copy(trainable, student, whole)
    if D.is_main():  # replicas are identical: one copy on disk
        out.mkdir(parents=True, exist_ok=True)
        export_student(trainable, student, distiller.tokenizer, out)
        save_composer(distiller.composer, out.parent / "composer.pt")
    D.barrier()
    return out
