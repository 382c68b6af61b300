"""The bank grows while the agent learns: every `bank.refresh_every` steps of a distillation stage, the
student's new successes join the bank its teacher retrieves from.

The official bank is static; ours is not, because in a deployment world the bank starts with the base's own few
successes, and a static bank caps what distillation can teach at that coverage. Mechanics:
  * the stage trains on a copy of its input bank in its own output folder (`lopd.out_dir/bank/`), so the input
    (another stage's output, versioned by DVC or by the cycle's content-addressed work folder) never changes,
    and the grown parquet is this stage's output — the next cycle's bank starts from it;
  * a refresh appends the successes (reward >= bank.min_reward) of the steps since the last one, de-duplicated
    and with provenance (`policy_version` = "student@step-N", the cycle) by the bank store; the Chroma index
    re-embeds only the new rows' texts (vectors of unchanged rows are reused);
  * the new rows' rollouts are the training steps' own, already counted in `rollouts`.
One process only: under several ranks each holds a slice of the batch, so the bank stays static there.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from lopd_core import distributed as D
from lopd_core.bank import ExperienceBank
from lopd_core.rollout.table import trajectories_to_frame


def stage_bank_paths(out_dir: str | Path) -> tuple[Path, Path]:
    """(parquet, index folder) of the bank a distillation stage grows."""
    root = Path(out_dir)
    return root / "bank" / "experience.parquet", root / "bank_index"


def copy_input_bank(source_parquet: Path, out_dir: str | Path) -> tuple[Path, Path]:
    """Start the stage's own bank as a copy of its input (kept when resuming: it already holds the rows added
    before the interruption)."""
    parquet, index_dir = stage_bank_paths(out_dir)
    if not parquet.exists():
        parquet.parent.mkdir(parents=True, exist_ok=True)
        if source_parquet.exists():
            shutil.copy2(source_parquet, parquet)
    return parquet, index_dir


class BankGrowth:
    """`run_distill`'s per-step hook: collects the step's trajectories (`UpdateResult.trajectories`), refreshes
    the bank every `every` steps and at the end. `added` counts the rows it added."""

    def __init__(self, bank: ExperienceBank, *, every: int, min_reward: float, cycle: int, total_steps: int, log=print):
        self.bank, self.every, self.min_reward, self.cycle = bank, every, min_reward, cycle
        self.total_steps, self.log = total_steps, log
        self.pending: list = []
        self.added = 0
        self.refreshes: list[dict] = []

    def __call__(self, distiller, result) -> None:
        self.pending.extend(result.trajectories)
        step = distiller.state.step
        if step % self.every == 0 or step >= self.total_steps:
            self.refresh(step)

    def refresh(self, step: int) -> None:
        if not self.pending:
            return
        frame = trajectories_to_frame(self.pending)
        self.pending = []
        before = len(self.bank)
        self.bank.refresh(frame, min_reward=self.min_reward, policy_version=f"student@step-{step}", cycle=self.cycle)
        self.bank.ensure_index()
        added = len(self.bank) - before
        self.added += added
        self.refreshes.append(
            {
                "step": step,
                "successes": int(frame["reward"].ge(self.min_reward).sum()),
                "added": added,
                "rows": len(self.bank),
            }
        )
        self.log(f"distill: step {step}: bank +{added} of the student's successes ({len(self.bank)} rows)")


def growth_enabled(every: int, uses_bank: bool) -> bool:
    return every > 0 and uses_bank and D.world_size() == 1
