"""Replay (lopd.replay_share, lopd_core/distill/update/replay.py): a share of each step's tasks comes from earlier
worlds, deterministically per (seed, step); on those tasks the teacher reads no experience; the dashboard's
`replay_kl` is the token mean of the KL on the replay rows; a replayed task's rollouts never join the growing bank."""

import copy
import csv
import math
from dataclasses import asdict, replace

import pytest
import torch
from _batches import loop_params, oracle_texts, six_trajectories, step_params

from lopd_core.config import ConfigError, Params
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.distill.loop import loop as loop_mod
from lopd_core.distill.loop import trainer as trainer_mod
from lopd_core.distill.update.dashboard import replay_kl
from lopd_core.envs.mix import deployment_tasks
from lopd_core.envs.toolworld.worlds import pretrain_worlds

TOL = 1e-5


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= TOL * max(1.0, abs(b))


def _distiller(params, model, tokenizer, retriever):
    model = copy.deepcopy(model)
    torch.manual_seed(0)
    composer = Composer(
        model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(model)
    )
    return trainer_mod.Distiller(params, model, tokenizer, retriever, composer=composer, log=lambda m: None)


def _reads(texts):
    return lambda tasks: [texts[:2] for _ in tasks]


@pytest.fixture(scope="module")
def texts():
    return oracle_texts(3)


def test_replay_tasks_take_their_share_and_come_from_earlier_worlds(tmp_path, tiny_model, tiny_tokenizer, texts):
    # 8 tasks a step at share 0.3: round(2.4) = 2 replay tasks; half of the replay stream is the pretraining worlds,
    # half aurora (lopd.replay_worlds): one source each
    params = loop_params(tmp_path, tasks_per_step=8, steps=3, replay_share=0.3, replay_worlds=["aurora"])
    d = _distiller(params, tiny_model, tiny_tokenizer, _reads(texts))
    pretraining = set(pretrain_worlds(params.envs.pretrain_worlds, params.envs.world_seed))
    replayed = []
    for s in range(6):  # two blocks of lopd.steps
        tasks = d.step_tasks(s)
        assert len(tasks) == 8
        replay = [t for t in tasks if d.replay.is_replay(t)]
        assert len(replay) == 2, s
        assert all(t.world in params.envs.deploy_worlds for t in tasks if t not in replay)
        assert all(t.world in pretraining | {"aurora"} and t.split == "train" for t in replay)
        replayed += replay
    assert sum(t.world == "aurora" for t in replayed) == len(replayed) // 2
    first_block = [t.world for t in replayed[:6] if t.world != "aurora"]
    assert len(set(first_block)) == len(first_block) == 3  # spread over the pretraining worlds


def test_no_replay_leaves_the_training_stream_as_it_was(tmp_path, tiny_model, tiny_tokenizer, texts):
    params = loop_params(tmp_path, tasks_per_step=4, steps=2)
    d = _distiller(params, tiny_model, tiny_tokenizer, _reads(texts))
    stream = deployment_tasks(params.envs, "train", 8, params.seed + 17)
    assert d.step_tasks(0) + d.step_tasks(1) == stream
    assert not any(d.replay.is_replay(t) for t in stream)


def test_a_resumed_run_draws_the_same_step_tasks(tmp_path, tiny_model, tiny_tokenizer, texts):
    params = loop_params(tmp_path, tasks_per_step=4, steps=3, replay_share=0.5)
    first = _distiller(params, tiny_model, tiny_tokenizer, _reads(texts))
    want = [first.step_tasks(s) for s in range(7)]
    resumed = _distiller(params, tiny_model, tiny_tokenizer, _reads(texts))  # fresh caches, asked from step 4 on
    assert [resumed.step_tasks(s) for s in (4, 5, 6, 0, 1, 2, 3)] == [want[s] for s in (4, 5, 6, 0, 1, 2, 3)]
    assert want[0] != want[3]  # the next block is fresh tasks, replay included
    other_seed = replace(params, seed=1)
    assert _distiller(other_seed, tiny_model, tiny_tokenizer, _reads(texts)).step_tasks(0) != want[0]


def test_the_settings_are_checked_at_load():
    p = Params()
    with pytest.raises(ConfigError, match="lopd.replay_share"):  # 0.05 × 8 rounds to no replay task
        replace(p.lopd, replay_share=0.05)
    with pytest.raises(ConfigError, match="lopd.replay_share"):  # no fresh task left
        replace(p.lopd, replay_share=1.0)
    with pytest.raises(ConfigError, match="lopd.replay_share"):
        replace(p.lopd, replay_share=0.5, trajectories="traces", traces="x")
    with pytest.raises(ConfigError, match="lopd.replay_worlds"):
        replace(p.lopd, replay_worlds=["atlantis"])
    assert replace(p.lopd, replay_share=0.0625).replay_per_step == 1  # 0.5 rounds half up


def test_a_deployment_world_is_not_replayed(tmp_path, tiny_model, tiny_tokenizer, texts):
    params = loop_params(tmp_path, replay_share=0.5, replay_worlds=list(Params().envs.deploy_worlds))
    with pytest.raises(ConfigError, match="lopd.replay_worlds.*envs.deploy_worlds"):
        _distiller(params, tiny_model, tiny_tokenizer, _reads(texts))


def test_replay_kl_is_the_token_mean_over_replay_rows():
    # KL sums 2.0, 1.0, 3.0 over 4, 2 and 2 action tokens; rows 0 and 2 replayed: (2 + 3) / (4 + 2) = 5/6
    kl, counts = torch.tensor([2.0, 1.0, 3.0]), torch.tensor([4, 2, 2])
    assert replay_kl(kl, counts, [True, False, True]) == pytest.approx(5 / 6, abs=1e-7)
    assert math.isnan(replay_kl(kl, counts, [False, False, False]))
    assert math.isnan(replay_kl(kl, torch.tensor([0, 2, 2]), [True, False, False]))  # a replay row without tokens


@pytest.fixture(scope="module")
def batch(tiny_model, tiny_tokenizer):
    return six_trajectories(tiny_model, tiny_tokenizer)


@pytest.mark.parametrize("simple", [True, False], ids=["reference", "optimised"])
def test_a_replayed_task_reads_nothing_and_its_kl_is_reported(tmp_path, tiny_model, tiny_tokenizer, batch, simple):
    """Task 1 of three replayed: the retriever is never asked about it, and the update is exactly the update of a
    retriever that finds nothing for it; replay_kl is the token mean of the per-trajectory KL on its two rows."""
    tasks, trajs = batch
    texts = oracle_texts(3)
    asked = []

    def retriever(ts):
        asked.extend(ts)
        return [texts[:2] for _ in ts]

    knobs = {"micro_batch": 0, "share_prompt": False} if simple else {"micro_batch": 2}
    replayed = _distiller(step_params(tmp_path / "a", **knobs), tiny_model, tiny_tokenizer, retriever)
    replayed.models.is_replay = lambda t: t == tasks[1]
    reads_nothing = _distiller(
        step_params(tmp_path / "b", **knobs),
        tiny_model,
        tiny_tokenizer,
        lambda ts: [[] if t == tasks[1] else texts[:2] for t in ts],
    )
    for d in (replayed, reads_nothing):  # the same student away from the base, so that its KL to the base is not 0
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for q in d.trainable.parameters():
                q.add_(torch.randn(q.shape, generator=g) * 0.05)
    got = replayed.update(tasks, trajs)
    want = reads_nothing.update(tasks, trajs)
    assert tasks[1] not in asked and tasks[0] in asked and tasks[2] in asked
    a, b = asdict(got.row), asdict(want.row)
    assert math.isnan(b["replay_kl"])  # nothing is replayed there
    different = {k: (a[k], b[k]) for k in a if k not in ("step_seconds", "replay_kl") and not _close(a[k], b[k])}
    assert not different, different
    for (n, p), q in zip(replayed.trainable.named_parameters(), reads_nothing.trainable.parameters()):
        torch.testing.assert_close(p, q, atol=TOL, rtol=TOL, msg=n)
    counts = [sum(t.action_mask[1:]) for t in trajs]  # predicted action tokens (position 0 never is)
    rows = (2, 3)  # task 1's two samples
    want_kl = sum(got.trajectory_kl[i] * counts[i] for i in rows) / sum(counts[i] for i in rows)
    assert got.row.replay_kl == pytest.approx(want_kl, rel=1e-6)
    assert got.row.replay_kl > 1e-4


def test_replayed_rollouts_never_join_the_bank(tmp_path, tiny_model, tiny_tokenizer, texts):
    params = loop_params(tmp_path, tasks_per_step=2, steps=1, replay_share=0.5)
    d = _distiller(params, tiny_model, tiny_tokenizer, _reads(texts))
    out = d.step()
    tasks = d.step_tasks(0)
    assert len(out.trajectories) == 2 and all(t.task == tasks[0] for t in out.trajectories)  # task 1 is replay
    assert d.replay.is_replay(tasks[1]) and d.state.rollouts == 4  # still charged as rollouts
    assert abs(out.row.replay_kl) < 1e-6  # the student starts as the base: its KL to the base on old prompts is 0


def test_a_resumed_run_with_replay_prints_the_same_numbers(tmp_path, tiny_model, tiny_tokenizer, texts):
    full = loop_params(tmp_path / "a", replay_share=0.5)
    loop_mod.run_distill(_distiller(full, tiny_model, tiny_tokenizer, _reads(texts)))
    split = loop_params(tmp_path / "b", replay_share=0.5)
    loop_mod.run_distill(_distiller(split, tiny_model, tiny_tokenizer, _reads(texts)), stop_after=1)
    loop_mod.run_distill(_distiller(split, tiny_model, tiny_tokenizer, _reads(texts)))

    def rows(p):
        with open(p.lopd.csv) as f:
            return [{k: v for k, v in r.items() if k != "step_seconds"} for r in csv.DictReader(f)]

    assert rows(full) == rows(split)
    assert all(math.isfinite(float(r["replay_kl"])) for r in rows(full))


def test_a_cycle_replays_the_worlds_earlier_cycles_deployed_to():
    from lopd_core.drivers.cycle_record import with_earlier_worlds

    p = Params()
    p.envs = replace(p.envs, deploy_worlds=["dune"])
    history = [{"deploy_worlds": ["cobalt"]}, {"deploy_worlds": ["dune"]}, {"deploy_worlds": ["cobalt", "aurora"]}, {}]
    p.lopd = replace(p.lopd, replay_share=0.0)
    assert with_earlier_worlds(p, history) is p  # no replay asked: the distill stage's key does not move
    p.lopd = replace(p.lopd, replay_share=0.25, replay_worlds=["borealis"])
    assert with_earlier_worlds(p, history).lopd.replay_worlds == ["borealis", "cobalt", "aurora"]  # not dune: deployed
    assert with_earlier_worlds(p, []) is p


def test_auto_replays_in_a_cycle_only_where_its_steps_roll_out_toolworld_tasks():
    from lopd_core.drivers.cycle_record import cycle_replay, with_earlier_worlds
    from lopd_core.settings.checks import CYCLE_REPLAY_SHARE

    p = Params()
    assert p.lopd.replay_share == "auto" and p.lopd.replay_per_step == 0  # a single run or a comparison: none
    resolved = cycle_replay(p)
    assert resolved.lopd.replay_share == CYCLE_REPLAY_SHARE
    assert resolved.lopd.replay_per_step == round(CYCLE_REPLAY_SHARE * p.lopd.tasks_per_step) > 0
    assert with_earlier_worlds(p, []).lopd.replay_share == CYCLE_REPLAY_SHARE
    traces = replace(p, lopd=replace(p.lopd, trajectories="traces", traces="served.parquet"))
    assert cycle_replay(traces).lopd.replay_share == 0  # a step of served traces rolls out nothing to replay
    one = replace(p, lopd=replace(p.lopd, tasks_per_step=1))
    assert cycle_replay(one).lopd.replay_share == 0  # no room for a replay task beside a fresh one
    codegen = replace(p, envs=replace(p.envs, mix={"codegen": 1.0}))
    assert cycle_replay(codegen).lopd.replay_share == 0
    explicit = replace(p, lopd=replace(p.lopd, replay_share=0.25))
    assert cycle_replay(explicit) is explicit  # a number is the user's choice, kept as it is


def test_a_cycle_after_one_that_did_not_promote_trains_on_a_fresh_seed():
    """Its champion, bank and φ are the cycle before's, so the same seed would replay that cycle from cache."""
    from lopd_core.drivers.cycle_record import RETRY_SEED_STRIDE, retries_of_champion, with_retry_seed

    p = replace(Params(), seed=3)
    assert with_retry_seed(p, []) is p  # the first cycle
    assert with_retry_seed(p, [{"promoted": True}]) is p  # a new champion: its first try
    history = [{"promoted": True}, {"promoted": False}, {"promoted": False}]
    assert retries_of_champion(history) == 2
    assert with_retry_seed(p, history).seed == 3 + 2 * RETRY_SEED_STRIDE
    assert with_retry_seed(p, history[:2]).seed == 3 + RETRY_SEED_STRIDE  # each retry its own stream
