"""Sharded evaluation: the shards cover the in-process evaluation exactly, and the Prefect flow that maps them
as tasks (threads here; Dask/Ray through the same task-runner switch) writes the same results."""

import json
from pathlib import Path

import torch

from lopd_core.config import load_params
from lopd_core.evaluation import EvalShard, eval_shards, evaluate

ROOT = Path(__file__).resolve().parents[2]


def test_shards_enumerate_every_cell_in_report_order():
    params = load_params(
        ROOT / "params.yaml",
        [
            "eval.splits=[test_id, test_ood]",
            "eval.modes=[greedy, sampled]",
            "eval.with_experience=true",
            "envs.mix={toolworld: 1.0}",
        ],
    )
    shards = eval_shards(params)
    assert len(shards) == 2 * 2 * 2
    assert shards[:3] == [
        EvalShard("toolworld", "test_id", False, "greedy"),
        EvalShard("toolworld", "test_id", False, "sampled"),
        EvalShard("toolworld", "test_id", True, "greedy"),
    ]
    assert shards[2].variant == "test_id+experience"


def test_sharded_flow_writes_what_evaluate_computes(tmp_path, tiny_model, tiny_tokenizer, prefect_harness):
    from flows.evaluate_sharded import run_sharded
    from lopd_core.model.loading import load_policy

    tiny_model.save_pretrained(tmp_path / "model")
    tiny_tokenizer.save_pretrained(tmp_path / "model")
    overrides = [
        f"model.name_or_path={tmp_path / 'model'}",
        "eval.n_per_split=2",
        "eval.splits=[test_id]",
        "eval.modes=[greedy, sampled]",
        "eval.with_experience=true",
        "rollout.max_new_tokens=12",
        "envs.mix={toolworld: 1.0}",
    ]
    params = load_params(ROOT / "params.yaml", overrides)
    torch.manual_seed(0)
    expected = evaluate(*load_policy(params.model), params, log=lambda _m: None)

    out = tmp_path / "eval.json"
    got = run_sharded(str(ROOT / "params.yaml"), overrides, task_runner="threads:2", out=str(out))
    assert got == expected
    assert json.loads(out.read_text()) == json.loads(json.dumps(expected))
    assert set(got["toolworld"]) == {"test_id", "test_id+experience"}
