"""The cycle learns from served traffic (issue #32 item 4): traces read as rollout rows with their world and
episode, the bank adds exactly the labeled successes, a distillation step scores the recorded tokens of the traces
its (seed, step) picks, resumes to the same order, charges traces as rollouts, and the stage keys move with the
store's content."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pandas as pd
import pytest
import torch

from lopd_core.config import ConfigError, Params
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.loop import trainer as trainer_mod
from lopd_core.distill.loop.trace_source import TraceStream, trace_count
from lopd_core.traces import read_traces, trace_table, traces_as_trajectories
from lopd_core.traces.schema import episode_records, trace_world
from tests._batches import loop_params
from tests.traces._traffic import TOOLS, write_store

LABELS = {0: (1.0, True), 1: (0.5, False), 2: (1.0, True), 4: (0.0, False), 5: (1.0, True)}  # 3, 6, 7 unlabeled


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_model, tiny_tokenizer):
    folder = tmp_path_factory.mktemp("traffic") / "traces"
    write_store(folder, tiny_model, tiny_tokenizer, n=8, labels=LABELS)
    return folder


def test_a_trace_reads_as_a_rollout_row_of_its_world(store):
    frame = traces_as_trajectories(read_traces(store), labeled_only=False)
    assert len(frame) == 8
    row = frame.iloc[0]
    assert json.loads(row["task"])["world"] == row["world"]
    assert row["world"] and not row["world"].startswith("tools:")  # toolworld instructions name their world
    assert json.loads(row["episode"]) == [
        {"call": {"name": "bank_pay", "arguments": {"to": "Noah"}}, "observation": "paid"},
        {"action": "done 0"},
    ]
    # an unlabeled conversation is never a success; only reward-1 labeled ones are
    assert sorted(frame.index[frame["success"]]) == [0, 2, 5]


def test_world_falls_back_to_the_declared_tool_set():
    tools = json.dumps(TOOLS)
    assert trace_world("[cobalt] pay Noah", tools) == "cobalt"
    assert trace_world("pay Noah", tools) == trace_world("send money", tools)  # one tool set, one world
    assert trace_world("pay Noah", tools).startswith("tools:") and trace_world("pay Noah", "[]") != trace_world(
        "pay Noah", tools
    )
    assert episode_records([{"role": "assistant", "content": "hi"}]) == [{"action": "hi"}]


def test_the_stream_is_a_function_of_seed_and_step(store):
    labeled = trace_table(store)
    assert len(labeled) == 5  # labeled only: 0, 1, 2, 4, 5
    a, b = TraceStream(str(store), seed=3, max_tokens=10**6), TraceStream(str(store), seed=3, max_tokens=10**6)
    steps = [a.rows(s, 2) for s in range(5)]
    assert steps == [b.rows(s, 2) for s in reversed(range(5))][::-1]  # any order of asking: a resume
    first_pass = [i for rows in steps for i in rows][:5]
    assert sorted(first_pass) == list(range(5))  # each trace once per pass before any repeats
    other = TraceStream(str(store), seed=4, max_tokens=10**6)
    assert [other.rows(s, 2) for s in range(5)] != steps
    assert trace_count(4, 2, "traces") == 8 and trace_count(4, 2, "both") == 4 and trace_count(3, 2, "both") == 2


def _params(tmp_path, store, **lopd):
    return loop_params(tmp_path, max_new_tokens=16, traces=str(store), **lopd)


def _distiller(params, tiny_model, tiny_tokenizer):
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    composer = Composer(
        model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(model)
    )
    return trainer_mod.Distiller(
        params,
        model,
        tiny_tokenizer,
        lambda tasks: [["[x] a success"] for _ in tasks],
        composer=composer,
        initial_rollouts=10,
        log=lambda m: None,
    )


def test_a_traces_step_scores_the_recorded_tokens_of_its_rows(tmp_path, store, tiny_model, tiny_tokenizer, monkeypatch):
    params = _params(tmp_path, store, trajectories="traces")
    d = _distiller(params, tiny_model, tiny_tokenizer)
    monkeypatch.setattr(trainer_mod, "rollout", lambda *a, **k: pytest.fail("a traces step rolled out"))
    seen = []
    update = trainer_mod.U.update
    monkeypatch.setattr(
        trainer_mod.U,
        "update",
        lambda setup, models, state, tasks, trajs, **k: (
            seen.append((setup.samples_per_task, [t.task_id for t in tasks], trajs))
            or update(setup, models, state, tasks, trajs, **k)
        ),
    )
    theta0 = {n: p.detach().clone() for n, p in d.trainable.named_parameters()}
    out = d.step()
    expected = d.traces.frame.iloc[d.traces.rows(0, 4)]
    group, task_ids, trajs = seen[0]
    assert group == 1 and d.cfg.samples_per_task == 2  # groups of one inside the step, restored after
    assert task_ids == list(expected["task_id"]) == [t.task.task_id for t in trajs]
    assert [t.token_ids for t in trajs] == [list(i) for i in expected["token_ids"]]
    assert [t.sample_logprobs for t in trajs] == [list(v) for v in expected["sample_logprobs"]]
    assert d.state.rollouts == 10 + 4  # traces are charged as rollouts
    assert out.row.rollouts == 14
    assert any(not torch.equal(theta0[n], p) for n, p in d.trainable.named_parameters())
    # a resumed run at step 1 takes what an uninterrupted one does
    d.step()
    again = _distiller(params, tiny_model, tiny_tokenizer)
    again.state.step = 1
    again.step()
    assert [t.token_ids for t in seen[2][2]] == [t.token_ids for t in seen[1][2]]


def test_both_rolls_out_half_and_reads_half_from_traces(tmp_path, store, tiny_model, tiny_tokenizer, monkeypatch):
    params = _params(tmp_path, store, trajectories="both")
    d = _distiller(params, tiny_model, tiny_tokenizer)
    seen = []
    update = trainer_mod.U.update
    monkeypatch.setattr(
        trainer_mod.U,
        "update",
        lambda setup, models, state, tasks, trajs, **k: (
            seen.append(trajs) or update(setup, models, state, tasks, trajs, **k)
        ),
    )
    d.step()
    trajs = seen[0]
    assert [t.task.env for t in trajs] == ["toolworld", "toolworld", "serve", "serve"]
    assert trajs[0].task == trajs[1].task == d.step_tasks(0)[0]  # the first half of the step's tasks, G each
    assert d.state.rollouts == 10 + 4


def test_settings_refuse_traces_without_a_store_or_with_group_advantages(tmp_path, store):
    with pytest.raises(ConfigError, match=r"lopd\.traces"):
        replace(Params().lopd, trajectories="traces").check()
    with pytest.raises(ConfigError, match="group"):
        replace(Params().lopd, trajectories="traces", traces=str(store), method="grpo").check()
    with pytest.raises(ConfigError, match="group"):
        replace(Params().lopd, trajectories="both", traces=str(store), advantage="group").check()
    replace(Params().lopd, trajectories="both", traces=str(store)).check()


def test_bank_from_traces_adds_exactly_the_labeled_successes(tmp_path, store):
    from lopd_core.drivers.bank import bank_paths, run_bank
    from lopd_core.drivers.distill import seed_rollouts
    from lopd_core.rollout.table import read_trajectories

    p = Params()
    p.bank = replace(p.bank, dir=str(tmp_path / "bank"), index_dir=str(tmp_path / "index"), min_reward=0.0)
    p.lopd = replace(p.lopd, bank_source="traces", traces=str(store))
    summary = run_bank(p, restart=True, log=lambda *_: None)  # bank.min_reward 0 admits no partial trace
    parquet, seed_path = bank_paths(p)
    bank = pd.read_parquet(parquet)
    successes = trace_table(store)
    successes = successes[successes["success"]]
    assert sorted(bank["task_id"]) == sorted(successes["task_id"]) and len(bank) == 3
    assert set(bank["world"]) == set(successes["world"])
    assert all(c.startswith('bank_pay {"to": "Noah"} -> paid') for c in bank["chain"])
    # every trace read, labeled or not, is charged to the budget as a rollout
    assert summary["rollouts"] == summary["traces"] == len(read_trajectories(seed_path)) == 8
    assert seed_rollouts(p) == 8


def test_the_stage_keys_move_with_the_traces_content(tmp_path, store):
    import shutil

    from flows.stage_flows import stage_payload, traces_input
    from lopd_core.traces import TraceStore, as_trajectories
    from tasks.caching import stage_key
    from tasks.stage_params import STAGES
    from tests.traces._traffic import turn_record

    copy_dir = tmp_path / "traces"
    shutil.copytree(store, copy_dir)
    p = Params()
    p.lopd = replace(p.lopd, bank_source="traces", trajectories="traces", traces=str(copy_dir))

    def keys():
        out = {}
        for stage, source in (("bank", p.lopd.bank_source), ("distill", p.lopd.trajectories)):
            inputs = dict.fromkeys(STAGES[stage].inputs)
            inputs["traces"] = traces_input(p, source)
            out[stage] = stage_key(stage_payload(p, stage, inputs))
        return out

    before = keys()
    assert keys() == before
    store_again = TraceStore(copy_dir, segment_bytes=10**7, max_bytes=10**8)
    store_again.append(
        turn_record(
            "new-one",
            as_trajectories(trace_table(copy_dir).iloc[:1])[0],
            session="s9",
            messages=[{"role": "user", "content": "[cobalt] hi"}],
        )
    )
    store_again.close()
    after = keys()
    assert after["bank"] != before["bank"] and after["distill"] != before["distill"]
    rollouts_only = replace(p.lopd, bank_source="rollouts", trajectories="rollouts")
    assert traces_input(replace(p, lopd=rollouts_only), "rollouts") is None


@pytest.mark.parametrize("command", ["bank", "cycle"])
def test_source_flag_is_the_setting(command, capsys):
    """`--source traces` sets lopd.bank_source (and lopd.trajectories for the cycle): refused at load without a
    trace path, before any work starts."""
    from lopd_cli.main import main

    assert main([command, "--source", "traces"]) == 2
    err = capsys.readouterr().err
    assert "lopd.traces: got ''" in err and "lopd.bank_source='traces'" in err
    assert ("lopd.trajectories='traces'" in err) == (command == "cycle")


def test_the_importance_weight_reads_the_recorded_logprobs(tmp_path, store, tiny_model, tiny_tokenizer, monkeypatch):
    """With the sampled-token loss and the importance weight, p_sample is the served version's recorded log-prob."""
    from lopd_core.distill.scoring import losses as L

    params = _params(tmp_path, store, trajectories="traces", student_loss="sampled", importance_weight=True)
    d = _distiller(params, tiny_model, tiny_tokenizer)
    seen = []
    weight = L.truncated_importance_weight
    monkeypatch.setattr(
        L, "truncated_importance_weight", lambda s, p, **k: seen.append(p.detach().clone()) or weight(s, p, **k)
    )
    d.step()
    trajs = d.traces.take(0, 4)
    recorded = sorted(round(lp, 5) for t in trajs for lp, m in zip(t.sample_logprobs[1:], t.action_mask[1:]) if m)
    assert seen and sorted(round(float(v), 5) for p in seen for v in p) == recorded
