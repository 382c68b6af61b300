"""The bank grows during a distillation stage (lopd_core/distill/loop/growing_bank.py): the student's new successes join
it every `bank.refresh_every` steps, de-duplicated, with provenance, and retrieval sees them at once."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd

from lopd_core.bank import ExperienceBank
from lopd_core.distill.composer.coldstart_data import oracle_trajectory
from lopd_core.distill.loop.growing_bank import BankGrowth, copy_input_bank, stage_bank_paths
from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec


def _successes(tiny_tokenizer, n, seed):
    """Successful trajectories standing in for the student's (oracle episodes: every one succeeds)."""
    codec = ChatCodec(tiny_tokenizer)
    return [oracle_trajectory(codec, task) for task in make_tasks("toolworld", "train", n, seed=seed)]


def test_student_successes_join_the_bank_every_n_steps(tmp_path, tiny_tokenizer):
    trajs = _successes(tiny_tokenizer, 12, seed=3)
    bank = ExperienceBank(tmp_path / "bank" / "experience.parquet", index_dir=tmp_path / "index")
    growth = BankGrowth(bank, every=2, min_reward=1.0, cycle=4, total_steps=3, log=lambda *_: None)
    distiller = SimpleNamespace(state=SimpleNamespace(step=0))
    for step, batch in enumerate((trajs[:4], trajs[4:8], trajs[8:] + trajs[:2]), start=1):
        distiller.state.step = step
        growth(distiller, SimpleNamespace(trajectories=batch))
        if step == 1:
            assert len(bank) == 0  # not yet: every 2 steps
    assert [r["step"] for r in growth.refreshes] == [2, 3]  # every 2 steps, and at the stage's end
    frame = pd.read_parquet(tmp_path / "bank" / "experience.parquet")
    assert len(frame) == len({t.task.task_id for t in trajs}) == growth.added  # the repeats were not added twice
    assert set(frame["policy_version"]) == {"student@step-2", "student@step-3"} and set(frame["cycle"]) == {4}
    hits = bank.retrieve([trajs[9].task], 1, allow_self_retrieval=True, same_world=True)
    assert hits[0][0].task_id == trajs[9].task.task_id  # the index saw the last refresh's rows
    bank.close()


def test_the_stage_grows_a_copy_and_keeps_it_when_resuming(tmp_path):
    source = tmp_path / "in" / "experience.parquet"
    source.parent.mkdir()
    source.write_bytes(b"input bank")
    parquet, index_dir = copy_input_bank(source, tmp_path / "out")
    assert (parquet, index_dir) == stage_bank_paths(tmp_path / "out") and parquet.read_bytes() == b"input bank"
    parquet.write_bytes(b"grown")
    copy_input_bank(source, tmp_path / "out")  # a resumed stage keeps what it grew
    assert parquet.read_bytes() == b"grown" and source.read_bytes() == b"input bank"
