"""The processes of tests/distill/test_fsdp.py, started by torchrun (not a test module itself).

    torchrun --nproc_per_node 2 tests/distill/fsdp_worker.py train OUT    # 3 sharded updates (checkpoint after 2),
                                                                       # then the student exported
    torchrun --nproc_per_node 1 tests/distill/fsdp_worker.py resume OUT   # update 3 resumed from that checkpoint, and
                                                                       # from the one-process run's (replicated)

Each rank takes its contiguous slice of the tasks (3 tasks over 2 ranks: 1 and 2, so the ranks run different
numbers of passes). Rank 0 saves, per case, the dashboard rows, β and the whole final θ and φ to OUT/CASE.pt.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.sharded_update import distiller, my_slice  # noqa: E402
from benchmarks.update_fingerprint import setup  # noqa: E402
from lopd_core import distributed as D  # noqa: E402
from lopd_core import sharding as SH  # noqa: E402
from lopd_core.distill.loop.loop import export  # noqa: E402

CASES = {"lopd_full": ("lopd", "full"), "lopd_lora": ("lopd", "lora"), "grpo_full": ("grpo", "full")}


def result(d, rows: list[dict]) -> dict:
    whole = SH.whole_state_dict(d.trainable)
    names = [n for n, _ in d.trainable.named_parameters()]
    return {
        "rows": rows,
        "beta": d.state.beta,
        "step": d.state.step,
        "theta": {n: whole[n].detach().clone() for n in names} if D.is_main() else {},
        "phi": {n: p.detach().clone() for n, p in d.composer.named_parameters()},
    }


def row(r) -> dict:
    return {k: v for k, v in asdict(r.row).items() if k != "step_seconds"}


def main(mode: str, out: Path) -> None:
    torch.set_num_threads(1)
    SH.setup()
    base, tokenizer, tasks, trajs, texts = setup()
    tasks, trajs = my_slice(tasks, trajs)
    for case, (method, student_mode) in CASES.items():
        if mode == "train":
            d = distiller(
                base, tokenizer, texts, sharding="fsdp2", mode=student_mode, method=method, out_dir=str(out / case)
            )
            rows = []
            for k in range(3):
                rows.append(row(d.update(tasks, trajs)))
                if k == 1:
                    d.save_checkpoint()  # sharded, after update 2
            export(d, out / case / "student")  # rank 0 rebuilds the student from every rank's shards
            save(out / f"{case}_train.pt", result(d, rows))
            continue
        # resume: the 2-rank sharded checkpoint, then the one-process replicated one (test_fsdp.py wrote it)
        for source, name in ((out / case, "resume"), (out / "one" / case, "resume_replicated")):
            d = distiller(
                base, tokenizer, texts, sharding="fsdp2", mode=student_mode, method=method, out_dir=str(source)
            )
            assert d.load_checkpoint(), f"no checkpoint to resume in {source}"
            save(out / f"{case}_{name}.pt", result(d, [row(d.update(tasks, trajs))]))


def save(path: Path, res: dict) -> None:
    if D.is_main():
        torch.save(res, path)
    D.barrier()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
