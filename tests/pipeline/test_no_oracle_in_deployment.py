"""The guard of the adaptation setting: nothing oracle reaches a deployment world. The bank holds only the
agent's own sampled successes there; the composer's cold start reads oracle episodes of the pretraining worlds
only (lopd_core/drivers/bank.py seed_bank, lopd_core/distill/composer/coldstart_data.py)."""

from __future__ import annotations

import pandas as pd

from lopd_core.config import load_params
from lopd_core.distill.composer.coldstart_data import ORACLE_SAMPLE_INDEX, pretraining_retriever, pretraining_successes
from lopd_core.envs.toolworld.worlds import WorldSplit
from lopd_core.model.chat import ChatCodec


def _params(tmp_path, model_dir="", extra=()):
    (tmp_path / "params.yaml").write_text("seed: 0\n")
    return load_params(
        tmp_path / "params.yaml",
        [
            *([f"model.name_or_path={model_dir}"] if model_dir else []),
            f"bank.dir={tmp_path}/bank",
            f"bank.index_dir={tmp_path}/index",
            "envs.pretrain_worlds=3",
            "coldstart.oracle_tasks=12",
            "bank.seed_tasks=6",
            "bank.samples_per_task=2",
            "bank.min_reward=0.0",
            "rollout.max_new_tokens=16",
            "rollout.max_context=768",
            *extra,
        ],
    )


def test_the_cold_start_reads_only_pretraining_worlds(tmp_path, tiny_tokenizer):
    params = _params(tmp_path)
    worlds = WorldSplit.from_config(params.envs)
    trajectories, successes = pretraining_successes(params, ChatCodec(tiny_tokenizer))
    assert successes and {s.task.world for s in successes} <= set(worlds.pretrain)
    assert not {s.task.world for s in successes} & set(worlds.deploy)
    with pretraining_retriever(params, trajectories) as retrieve:
        texts = retrieve([s.task for s in successes[:4]])
    for s, found in zip(successes[:4], texts):
        assert found and all(t.startswith(f"[{s.task.world}]") for t in found)  # same world, never another


def test_seed_bank_rows_are_sampled_in_the_deployment_worlds(tmp_path, tiny_model, tiny_tokenizer):
    from lopd_core.drivers.distill import bank_paths, seed_bank
    from lopd_core.rollout.table import read_trajectories

    model_dir = tmp_path / "policy"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    params = _params(tmp_path, str(model_dir))
    summary = seed_bank(params, log=lambda *_: None)
    parquet, seed_path = bank_paths(params)
    seed = read_trajectories(seed_path)
    assert len(seed) == summary["rollouts"] == 12  # every row sampled, every sample charged
    assert (seed["sample_index"] != ORACLE_SAMPLE_INDEX).all()
    assert set(seed["world"]) == set(params.envs.deploy_worlds)
    bank = pd.read_parquet(parquet)
    assert len(bank) == summary["bank_rows"]
    assert set(bank["world"]) <= set(params.envs.deploy_worlds)
    assert not bank["policy_version"].str.contains("oracle").any()


def test_the_cold_start_reads_one_to_max_experiences_rows_when_asked(tmp_path, tiny_tokenizer):
    """`coldstart.max_experiences`: the cold start's retriever reads up to that many same-world rows (more than
    bank.top_j) and keeps 1..max of them per target, varying between calls; 0 keeps bank.top_j every time."""
    params = _params(tmp_path, extra=["coldstart.oracle_tasks=40", "coldstart.max_experiences=6", "bank.top_j=2"])
    trajectories, successes = pretraining_successes(params, ChatCodec(tiny_tokenizer))
    tasks = [s.task for s in successes[:6]]
    with pretraining_retriever(params, trajectories) as retrieve:
        counts = {len(found) for _ in range(10) for found in retrieve(tasks)}
    assert max(counts) > 2 and min(counts) >= 1 and max(counts) <= 6  # beyond top_j, and varied
    (tmp_path / "plain").mkdir()
    plain = _params(tmp_path / "plain", extra=["coldstart.oracle_tasks=40", "bank.top_j=2"])
    with pretraining_retriever(plain, trajectories) as retrieve:
        assert {len(found) for found in retrieve(tasks)} == {2}
