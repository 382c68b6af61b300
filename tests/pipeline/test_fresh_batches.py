"""Fresh tasks for every decision (issue #46 item 4): each cycle's gate plays a batch of held-out tasks of its own
(flows/gate.py), champion, student and root on the same tasks; the report keeps batch 0; test_final is read by no
decision; a split that the cycles outrun stops the cycle with an error before any stage runs.

The evaluate stage is replaced by a stand-in that draws the real tasks of its params (lopd_core/evaluation.py
`shard_requests`) and scores them by a rule of the policy's name, so what is checked is which tasks each decision
played, not how a model plays them."""

from __future__ import annotations

import pytest

from flows import gate as gate_flow
from lopd_core.config import ConfigError, load_params
from lopd_core.drivers.cycle_record import gate_record
from lopd_core.evaluation import EvalShard, batch_tasks, eval_shards, shard_requests
from lopd_core.outcomes import write_outcomes

MODELS = {"champion": "champion-weights", "student": "student-weights", "root": "root-weights"}


def _params(*extra):
    return load_params("params.yaml", ["eval.n_per_split=12", "envs.mix={toolworld: 1.0}", *extra])


@pytest.fixture()
def played(tmp_path, monkeypatch):
    """Every evaluation the gate asks for: (label, model, params); the student wins every task, the others the
    tasks of even index, so the student's gain is clear."""
    calls: list[tuple[str, str, object]] = []

    def evaluate_flow(p, model, *, label, **_common):
        rows = []
        for shard in eval_shards(p):
            for request in shard_requests(p, shard):
                task = request.task
                win = model == MODELS["student"] or int(task.task_id.rsplit("/", 1)[1]) % 2 == 0
                rows.append(
                    {
                        "env": shard.env,
                        "split": shard.variant,
                        "mode": shard.mode,
                        "task_id": task.task_id,
                        "template": task.template,
                        "world": task.world,
                        "success": win,
                        "reward": 1.0 if win else 0.0,
                        "turns": 1,
                        "tokens": 1,
                        "batch": p.eval.batch,
                    }
                )
        path = write_outcomes(rows, tmp_path / f"{label}-{len(calls)}.parquet")
        calls.append((label, model, p))
        return {"outcomes": str(path), "cached": False}

    monkeypatch.setattr(gate_flow.S, "evaluate_flow", evaluate_flow)
    return calls


def _task_ids(p, split="test_id"):
    return {r.task.task_id for r in shard_requests(p, EvalShard("toolworld", split, False, p.eval.modes[0]))}


def _run_cycles(params, cycles: int, calls):
    """`cycles` gates one after the other, as flows/cycle.py runs them: each record's gate goes into history."""
    history, per_cycle = [], []
    for number in range(1, cycles + 1):
        start = gate_flow.gate_start(history, params.eval.n_per_split)
        gate_flow.check_fresh_tasks(params, start)
        before = len(calls)
        decision, _, batches = gate_flow.decide_promotion(params, MODELS, start=start, common={})
        gate = gate_record(decision, (0.0, 0, 0.0), batches=batches, n_per_split=params.eval.n_per_split)
        history.append({"cycle": number, "promoted": decision.promoted, "gate": gate})
        per_cycle.append((batches, calls[before:]))
    return history, per_cycle


def test_each_cycle_plays_its_own_batch_and_champion_student_root_play_the_same_tasks(played):
    params = _params()
    n = params.eval.n_per_split
    history, per_cycle = _run_cycles(params, 3, played)
    assert [batches for batches, _ in per_cycle] == [[1], [2], [3]]  # one look a cycle: cycle c plays batch c
    assert [r["gate"]["tasks"] for r in history] == [[n, 2 * n], [2 * n, 3 * n], [3 * n, 4 * n]]
    report = _task_ids(params)  # the report's tasks: batch 0
    seen: set[str] = set(report)
    for (batches, calls), number in zip(per_cycle, (1, 2, 3)):
        assert sorted(model for _, model, _ in calls) == sorted(MODELS.values())
        assert {p.eval.batch for _, _, p in calls} == set(batches)
        # pairing: the three policies play one set of tasks (the same params: batch, splits, mode, seed)
        ids = [frozenset(_task_ids(p)) for _, _, p in calls]
        assert len(set(ids)) == 1 and len(ids[0]) == n
        assert not ids[0] & seen, f"cycle {number} replays tasks an earlier decision or the report read"
        seen |= ids[0]
        assert history[number - 1]["promoted"]  # the student wins every task: a clear gain, fresh tasks or not


def test_sequential_looks_take_consecutive_batches_and_the_next_cycle_starts_after_the_last_played():
    history = [{"gate": {"batches": [1], "tasks": [10, 20]}}]  # a cycle whose gate settled at its first look
    assert gate_flow.gate_start(history, 10) == 2
    history.append({"gate": {"batches": [2, 3], "tasks": [20, 40]}})
    assert gate_flow.gate_start(history, 10) == 4
    assert gate_flow.gate_start(history, 15) == 3  # n changed: the first whole batch after instance 40
    assert gate_flow.gate_start([], 10) == 1  # batch 0 is the report's
    assert gate_flow.gate_start([{"gate": {"looks": 2}}], 10) == 2  # a record from before: batches 0 and 1


def test_with_looks_each_cycle_uses_the_batches_after_the_last_one_played(played):
    params = _params("eval.sequential=true", "eval.max_n=24")  # two looks of 12
    _, per_cycle = _run_cycles(params, 2, played)
    assert [batches for batches, _ in per_cycle] == [[1], [2]]  # promoted at the first look: the next starts at 2


def test_test_final_is_never_read_by_the_gate(played, monkeypatch):
    """The report plays test_final (eval.splits' default); the gate's evaluations never do, and the settings
    refuse it as a guard or a teacher-in-play split."""
    params = _params()
    assert "test_final" in params.eval.splits
    assert any(s.split == "test_final" for s in eval_shards(params))  # reported
    import lopd_core.evaluation as E

    real = E.make_tasks

    def no_final(env, split, *args, **kwargs):
        assert split != "test_final", "the gate drew test_final tasks"
        return real(env, split, *args, **kwargs)

    monkeypatch.setattr(E, "make_tasks", no_final)
    _run_cycles(params, 2, played)
    assert all("test_final" not in p.eval.splits for _, _, p in played)
    for bad in ("cycle.guards=[test_final]", "cycle.guards=[toolworld:test_final]", "eval.teacher_splits=[test_final]"):
        with pytest.raises(ConfigError):
            _params(bad)
    with pytest.raises(ConfigError):
        _params("cycle.gate_splits=[test_final]")


def test_a_task_file_bounds_the_batches_with_an_error_not_a_wrap():
    """A task file's held-out split holds its tasks (the example plugin: 6 test_id): at n = 3, batch 0 (the
    report's) and one gate batch; the next cycle's gate would need tasks 6..8 and stops before any stage."""
    pytest.importorskip("lopd_example_env", reason="install examples/lopd-example-env (scripts/setup.sh --dev)")
    params = load_params("params.yaml", ["eval.n_per_split=3", "envs.mix={toolworld: 1.0, library: 1.0}"])
    gate_flow.check_fresh_tasks(params, 1)
    first = {t.task_id for t in batch_tasks(gate_flow.batch_params(params, 1), "library", "test_id")}
    assert len(first) == 3 and not first & {t.task_id for t in batch_tasks(params, "library", "test_id")}
    with pytest.raises(ConfigError, match=r"eval.batch 2 needs tasks 6..8 of library's 'test_id' split, which holds 6"):
        gate_flow.check_fresh_tasks(params, 2)
    # the built-ins' streams never run out
    assert len(batch_tasks(gate_flow.batch_params(_params(), 100), "toolworld", "test_id")) == 12
