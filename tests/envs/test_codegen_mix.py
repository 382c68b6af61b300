"""codegen in the environment mix: task streams in proportion, codegen demonstrations and experience, the bank's
codegen rows, and a tiny distillation run that draws both environments' tasks."""

import copy
import random
from dataclasses import replace

import pytest
import torch

from lopd_core.bank.store import BankStore
from lopd_core.config import Params, load_params
from lopd_core.distill.composer.coldstart_data import oracle_trajectory
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.loop import loop as loop_mod
from lopd_core.distill.loop import trainer as trainer_mod
from lopd_core.envs import make_tasks
from lopd_core.envs.codegen import FAMILIES, families_for, oracle_action
from lopd_core.envs.mix import interleave, mix_counts, mixed_tasks
from lopd_core.envs.toolworld.worlds import WorldSplit
from lopd_core.experience import experience_text
from lopd_core.model.chat import ChatCodec
from lopd_core.model.codegen_demos import (
    CodegenExperiencePool,
    build_codegen_demos,
    flawed_variant,
    play_codegen,
)
from lopd_core.model.demos import encode_demo
from lopd_core.rollout.table import trajectories_to_frame

MIX = {"toolworld": 0.7, "codegen": 0.3}
PRETRAIN = WorldSplit.from_config(Params().envs).pretrain  # the warm start's stream: codegen train not carved


def test_the_mix_is_set_from_the_command_line():
    params = load_params("params.yaml", ["envs.mix={toolworld: 0.7, codegen: 0.3}"])
    assert params.envs.mix == MIX


def test_mix_counts_apportion_by_largest_remainder():
    assert mix_counts(MIX, 10) == {"codegen": 3, "toolworld": 7}
    # 8 -> exact 5.6 / 2.4: toolworld has the larger remainder and gets the odd one
    assert mix_counts(MIX, 8) == {"codegen": 2, "toolworld": 6}
    assert mix_counts({"toolworld": 2.0, "codegen": 1.0}, 0) == {"codegen": 0, "toolworld": 0}
    assert sum(mix_counts({"toolworld": 1.0, "codegen": 1.0}, 7).values()) == 7


def test_interleave_keeps_order_and_spreads_evenly():
    merged = interleave({"a": [1, 2, 3, 4], "b": ["x", "y"]})
    # a's items at 1/8, 3/8, 5/8, 7/8; b's at 1/4, 3/4
    assert merged == [1, "x", 2, 3, "y", 4]


def test_a_single_env_mix_is_exactly_that_envs_tasks():
    assert mixed_tasks({"toolworld": 1.0}, "train", 12, 3) == make_tasks("toolworld", "train", 12, 3)


def test_every_slice_of_a_mixed_stream_holds_both_envs():
    tasks = mixed_tasks(MIX, "train", 40, 0)
    assert sum(t.env == "codegen" for t in tasks) == 12
    assert [t for t in tasks if t.env == "codegen"] == make_tasks("codegen", "train", 12, 0)
    for start in range(0, 40, 8):  # a distillation step of 8 tasks
        envs = [t.env for t in tasks[start : start + 8]]
        assert 2 <= envs.count("codegen") <= 3, envs


def test_flawed_variant_changes_one_thing_in_the_body():
    family = FAMILIES["clamp"]
    variant = flawed_variant(family.source, random.Random(0))
    assert variant is not None and variant != family.source
    assert variant.splitlines()[0] == family.source.splitlines()[0]  # the signature is kept
    assert flawed_variant(family.source, random.Random(0)) == variant  # seeded


def test_a_noisy_codegen_demo_fixes_its_first_attempt_from_real_feedback():
    task = make_tasks("codegen", "train", 1, 0)[0]  # clamp
    demo, success, episode = play_codegen(task, noise=1.0, rng=random.Random(1))
    assert success and demo.actions[-1] == oracle_action(task)
    if len(demo.actions) > 1:  # the flawed attempt failed: its feedback names the first failing test
        assert demo.observations[0].startswith("passed ") and "first failure" in demo.observations[0]
        assert episode[0]["observation"] == demo.observations[0]


def test_codegen_demos_mix_experience_and_noise_and_are_seeded():
    kwargs = dict(n=40, experience_fraction=0.4, max_experiences=2, noise=0.5, slip=0.0, seed=0, worlds=PRETRAIN)
    demos = build_codegen_demos(**kwargs)
    assert len(demos) == 40
    with_experience = [d for d in demos if d.experiences]
    assert 8 <= len(with_experience) <= 24
    for d in with_experience:  # same family, whole function, and the answer is that function
        assert all(d.actions[0].strip() in e for e in d.experiences)
    assert any(len(d.actions) > 1 for d in demos)  # some first attempts were flawed and fixed
    assert [d.text() for d in build_codegen_demos(**kwargs)] == [d.text() for d in demos]


def test_codegen_experience_pool_prefers_the_family_then_the_topic():
    pool = CodegenExperiencePool(make_tasks("codegen", "train", 96, 5))
    task = make_tasks("codegen", "test_id", 1, 6)[0]  # as in evaluation: a held-out instance, a train pool
    picked = pool.sample(task, 3, random.Random(0))
    assert len(picked) == 3 and all(f"def {task.spec['function']}(" in e for e in picked)
    held_out = make_tasks("codegen", "test_ood", 1, 0)[0]
    assert held_out.template not in {f.name for f in families_for("train")}
    near = pool.sample(held_out, 2, random.Random(0))
    topic = FAMILIES[held_out.template].topic
    assert near and all(any(f"def {f.function}(" in e for f in FAMILIES.values() if f.topic == topic) for e in near)


def test_codegen_oracle_seeds_reach_the_bank_with_their_whole_code(tmp_path, tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    tasks = mixed_tasks({"toolworld": 1.0, "codegen": 1.0}, "train", 4, 0)
    trajs = [oracle_trajectory(codec, t) for t in tasks]
    assert all(t.success for t in trajs) and {t.task.env for t in trajs} == {"toolworld", "codegen"}
    report = BankStore(tmp_path / "bank.parquet").refresh(
        trajectories_to_frame(trajs), min_reward=1.0, policy_version="oracle", cycle=0
    )
    assert report.added == 4
    rows = BankStore(tmp_path / "bank.parquet").load()
    code_rows = rows[rows["env"] == "codegen"]
    for _, row in code_rows.iterrows():
        task = next(t for t in tasks if t.task_id == row["task_id"])
        assert oracle_action(task).strip() in row["experience_text"]
        assert row["experience_text"] == experience_text(task, [{"action": oracle_action(task)}])


def test_encoded_codegen_demo_supervises_only_the_answers(tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    task = make_tasks("codegen", "train", 1, 0)[0]
    demo, _, _ = play_codegen(task, noise=1.0, rng=random.Random(1))
    ids = encode_demo(demo, codec)
    answers = tiny_tokenizer.decode([i for i, m in zip(ids.token_ids, ids.action_mask) if m])
    assert oracle_action(task).strip() in answers and task.instruction not in answers


def test_a_tiny_mixed_distillation_draws_both_envs(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    params = Params()
    params.seed = 0
    params.envs = replace(params.envs, mix={"toolworld": 0.5, "codegen": 0.5})
    params.rollout = replace(params.rollout, max_new_tokens=16, max_context=512)
    params.lopd = replace(
        params.lopd,
        tasks_per_step=2,
        samples_per_task=2,
        steps=2,
        out_dir=str(tmp_path / "lopd"),
        csv=str(tmp_path / "distill.csv"),
    )
    seen = []
    real_rollout = trainer_mod.rollout

    def recording_rollout(model, codec, requests, **kwargs):
        seen.extend(r.task.env for r in requests)
        return real_rollout(model, codec, requests, **kwargs)

    monkeypatch.setattr(trainer_mod, "rollout", recording_rollout)
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    composer = Composer(
        model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(model)
    )
    code_pool = CodegenExperiencePool(make_tasks("codegen", "train", 40, 9))
    rng = random.Random(0)

    def retriever(tasks):  # codegen tasks read codegen experience; toolworld ones none (enough for this test)
        return [code_pool.sample(t, 1, rng) if t.env == "codegen" else [] for t in tasks]

    distiller = trainer_mod.Distiller(params, model, tiny_tokenizer, retriever, composer=composer, log=lambda m: None)
    state = loop_mod.run_distill(distiller)
    assert state.step == 2
    assert seen.count("codegen") == seen.count("toolworld") == 4  # 2 steps x (1 task of each env x 2 samples)
    per_step = [seen[i : i + 4] for i in (0, 4)]
    assert all(set(step) == {"toolworld", "codegen"} for step in per_step)


@pytest.mark.parametrize("n", [0, 1, 5])
def test_mix_counts_sum_to_n(n):
    assert sum(mix_counts({"codegen": 0.2, "toolworld": 0.8}, n).values()) == n
