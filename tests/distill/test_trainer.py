"""LOPD core: the latent splice lines up with the text format, the composer scales its latents, and the
trainer follows DESIGN §3 — moves every trainable parameter, ascends β by the rule, skips non-finite updates
and resumes to the same numbers."""

import copy
import csv
import itertools
import math
from dataclasses import replace

import pytest
import torch

from lopd_core.distill.composer.composer import Composer, ExperienceEncoder, compose_latents, mean_embedding_norm
from lopd_core.distill.loop import loop as loop_mod
from lopd_core.distill.loop import trainer as trainer_mod
from lopd_core.distill.loop.checkpoints import CheckpointError, plain_data
from lopd_core.distill.scoring import losses as L
from lopd_core.distill.scoring.models import TeacherView, make_student_and_teacher
from lopd_core.distill.scoring.teacher import Framing, action_logits, build_batch, splice_position
from lopd_core.distill.update.dashboard import CSV_COLUMNS
from lopd_core.envs import make_tasks, run_oracle
from lopd_core.errors import TrainingDiverged
from lopd_core.experience import format_experience
from lopd_core.model.chat import ChatCodec
from tests._batches import loop_params


def _oracle_trajectory(codec, task, experiences=None):
    actions, results, _ = run_oracle(task)
    traj = codec.start("tools: x", task.instruction, experiences)
    for i, a in enumerate(actions):
        traj.add_action(codec.action_ids(a))
        if not results[i].done:
            traj.add_forced(codec.observation_ids(results[i].observation))
    return traj


def test_latent_slot_matches_the_text_experience_format(tiny_model, tiny_tokenizer):
    # Splicing the *embeddings of the experience text* as latents must reproduce, position for position, a
    # plain forward over the conversation with that text in its first user turn.
    codec = ChatCodec(tiny_tokenizer)
    framing = Framing.from_tokenizer(tiny_tokenizer)
    task = make_tasks("toolworld", "train", 1, seed=3)[0]
    exp = ["[aurora] pay Bob\nbank_transfer {} -> ok"]
    plain = _oracle_trajectory(codec, task)
    with_text = _oracle_trajectory(codec, task, exp)
    at = splice_position(plain.token_ids, framing)
    assert tiny_tokenizer.decode(plain.token_ids[:at]).endswith("<|im_start|>user\n")
    text_ids = tiny_tokenizer("\n".join(exp), add_special_tokens=False)["input_ids"]
    latents = [tiny_model.get_input_embeddings()(torch.tensor(text_ids))]
    with torch.no_grad():
        spliced = action_logits(
            tiny_model, build_batch(tiny_model, [plain.token_ids], [plain.action_mask], latents, framing)
        )
        reference = action_logits(tiny_model, build_batch(tiny_model, [with_text.token_ids], [with_text.action_mask]))
    torch.testing.assert_close(spliced, reference, atol=1e-4, rtol=1e-4)


def test_composer_latents_have_the_embedding_norm_and_cache(tiny_model, tiny_tokenizer):
    norm = mean_embedding_norm(tiny_model)
    composer = Composer(tiny_model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=norm)
    encoder = ExperienceEncoder(TeacherView(tiny_model), tiny_tokenizer)
    out = compose_latents(composer, encoder, [["a success", "another one"], [], ["a success"]])
    assert [o.shape for o in out] == [(8, 32), (0, 32), (4, 32)]
    torch.testing.assert_close(out[0].norm(dim=-1), torch.full((8,), norm), atol=1e-4, rtol=1e-4)
    assert encoder.misses == 2 and encoder.hits == 1  # "a success" encoded once
    out[0].sum().backward()
    assert composer.queries.grad is not None


def test_lora_teacher_is_the_base_with_one_copy(tiny_model, tiny_tokenizer):
    base = copy.deepcopy(tiny_model)
    trainable, student, teacher = make_student_and_teacher(base, mode="lora", lora_rank=2)
    for name, p in trainable.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # a trained adapter: student now differs from the base
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        with teacher.active() as t:
            teacher_logits = t(ids).logits
        student_logits = student(ids).logits
        base_logits = tiny_model(ids).logits
    torch.testing.assert_close(teacher_logits, base_logits)
    assert not torch.allclose(student_logits, base_logits)
    assert teacher.lm is student  # same module, same weights: one copy in memory


def _params(tmp_path, **lopd):
    return loop_params(tmp_path, **lopd)


def _retriever():
    pool = make_tasks("toolworld", "train", 6, seed=99)
    texts = []
    for t in pool:
        _, _, env = run_oracle(t)
        texts.append(format_experience(t.instruction, env.episode))
    return lambda tasks: [texts[:2] for _ in tasks]


def _distiller(params, tiny_model, tiny_tokenizer):
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    composer = Composer(
        model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=mean_embedding_norm(model)
    )
    return trainer_mod.Distiller(
        params, model, tiny_tokenizer, _retriever(), composer=composer, initial_rollouts=10, log=lambda m: None
    )


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_training_steps_follow_the_design(tmp_path, tiny_model, tiny_tokenizer):
    params = _params(tmp_path)
    d = _distiller(params, tiny_model, tiny_tokenizer)
    theta0 = {n: p.detach().clone() for n, p in d.trainable.named_parameters()}
    phi0 = {n: p.detach().clone() for n, p in d.composer.named_parameters()}
    loop_mod.run_distill(d)
    rows = _rows(params.lopd.csv)
    assert list(rows[0].keys()) == CSV_COLUMNS
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert [int(r["rollouts"]) for r in rows] == [14, 18, 22]  # 10 seed rollouts + 4 per step
    for prev, nxt in itertools.pairwise(rows):  # dual ascent, as DESIGN §5 states it
        expected = max(0.0, float(prev["beta"]) + 0.5 * (0.05 - float(prev["delta"])))
        assert float(nxt["beta"]) == pytest.approx(expected, rel=1e-4, abs=1e-5)
    moved_theta = [n for n, p in d.trainable.named_parameters() if not torch.equal(p, theta0[n])]
    assert len(moved_theta) == len(theta0)
    unmoved_phi = [n for n, p in d.composer.named_parameters() if torch.equal(p, phi0[n])]
    assert not unmoved_phi, unmoved_phi
    for r in rows:
        assert 0.0 < float(r["topk_mass"]) <= 1.0 + 1e-6
        assert float(r["latent_norm_ratio"]) == pytest.approx(1.0, rel=1e-3)
        assert math.isfinite(float(r["distill_loss"])) and float(r["distill_loss"]) >= 0


def test_resumed_run_prints_the_same_numbers(tmp_path, tiny_model, tiny_tokenizer):
    full = _params(tmp_path / "a")
    loop_mod.run_distill(_distiller(full, tiny_model, tiny_tokenizer))
    split = _params(tmp_path / "b")
    loop_mod.run_distill(_distiller(split, tiny_model, tiny_tokenizer), stop_after=1)
    assert len(_rows(split.lopd.csv)) == 1
    resumed = _distiller(split, tiny_model, tiny_tokenizer)  # fresh process state, same params
    state = loop_mod.run_distill(resumed)
    assert state.step == 3
    drop = {"step_seconds"}
    a = [{k: v for k, v in r.items() if k not in drop} for r in _rows(full.lopd.csv)]
    b = [{k: v for k, v in r.items() if k not in drop} for r in _rows(split.lopd.csv)]
    assert a == b


def test_non_finite_loss_skips_the_update(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    params = _params(tmp_path, steps=1, max_skipped_share=1.0)
    d = _distiller(params, tiny_model, tiny_tokenizer)
    theta0 = {n: p.detach().clone() for n, p in d.trainable.named_parameters()}
    real = L.reverse_kl_topk
    monkeypatch.setattr(L, "reverse_kl_topk", lambda *a, **k: real(*a, **k) * float("nan"))
    state = loop_mod.run_distill(d)
    assert state.skipped_updates >= 1
    assert all(torch.equal(p, theta0[n]) for n, p in d.trainable.named_parameters())


def test_a_run_that_skips_too_many_updates_fails_before_saving(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    """Probe: lr_student=inf trained 13 NaN tensors and exited 0 with "update skipped" lines. Now the stage
    fails (non-zero exit in the CLI) as soon as the skipped share exceeds lopd.max_skipped_share: the run cannot
    end under it any more, so it stops before spending the rest of its steps."""
    params = _params(tmp_path, steps=4)
    d = _distiller(params, tiny_model, tiny_tokenizer)
    real = L.reverse_kl_topk
    monkeypatch.setattr(L, "reverse_kl_topk", lambda *a, **k: real(*a, **k) * float("nan"))
    with pytest.raises(TrainingDiverged, match="max_skipped_share"):
        loop_mod.run_distill(d)
    assert d.state.step < 4


# ---- checkpoints: plain data, the settings they were made under, damage named ------------------------------
def _checkpointed(tmp_path, tiny_model, tiny_tokenizer, stop_after=1, **lopd):
    """Params of a run stopped after `stop_after` steps, its checkpoint on disk."""
    params = _params(tmp_path, **lopd)
    loop_mod.run_distill(_distiller(params, tiny_model, tiny_tokenizer), stop_after=stop_after)
    return params


def test_checkpoint_is_read_with_weights_only_and_records_its_settings(
    tmp_path, tiny_model, tiny_tokenizer, monkeypatch
):
    params = _checkpointed(tmp_path, tiny_model, tiny_tokenizer)
    path = _distiller(params, tiny_model, tiny_tokenizer).checkpoint_path()
    payload = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data only
    assert payload["state"]["step"] == 1
    assert payload["settings"]["lopd.lr_student"] == params.lopd.lr_student
    assert payload["settings"]["seed"] == 0 and "lopd.steps" not in payload["settings"]
    calls = []
    real_load = torch.load
    monkeypatch.setattr(trainer_mod.torch, "load", lambda *a, **k: calls.append(k) or real_load(*a, **k))
    assert _distiller(params, tiny_model, tiny_tokenizer).load_checkpoint()
    assert calls and all(k.get("weights_only") is True for k in calls)


def test_plain_data_turns_numpy_scalars_into_numbers_and_refuses_objects():
    import numpy as np

    assert plain_data({"a": [np.float32(0.5), (1, None)]}) == {"a": [0.5, (1, None)]}
    assert type(plain_data(np.int64(3))) is int
    with pytest.raises(TypeError, match=r"state\['x'\].*weights_only"):
        plain_data({"x": object()}, "state")


def test_resume_under_other_settings_is_refused_listing_each_key(tmp_path, tiny_model, tiny_tokenizer):
    params = _checkpointed(tmp_path, tiny_model, tiny_tokenizer)
    other = copy.deepcopy(params)
    other.lopd, other.seed = replace(other.lopd, lr_student=1e-3, margin=0.1), 1
    with pytest.raises(CheckpointError) as info:
        loop_mod.run_distill(_distiller(other, tiny_model, tiny_tokenizer))
    message = str(info.value)
    assert str(_distiller(params, tiny_model, tiny_tokenizer).checkpoint_path()) in message
    for line in ("lopd.lr_student: 0.0003 → 0.001", "lopd.margin: 0.05 → 0.1", "seed: 0 → 1"):
        assert line in message, message
    assert "--fresh" in message and "lopd.resume_mismatch=warn" in message
    assert "lopd.tasks_per_step" not in message  # only the keys that differ


def test_a_longer_run_and_other_paths_resume_silently(tmp_path, tiny_model, tiny_tokenizer):
    params = _checkpointed(tmp_path, tiny_model, tiny_tokenizer)
    longer = copy.deepcopy(params)
    longer.lopd = replace(longer.lopd, steps=4, checkpoint_every=2)
    logged = []
    d = _distiller(longer, tiny_model, tiny_tokenizer)
    d.log = logged.append
    assert loop_mod.run_distill(d, stop_after=2).step == 2
    assert not any("warning" in m for m in logged), logged


def test_resume_mismatch_warn_resumes_and_says_what_differs(tmp_path, tiny_model, tiny_tokenizer):
    params = _checkpointed(tmp_path, tiny_model, tiny_tokenizer)
    other = copy.deepcopy(params)
    other.lopd = replace(other.lopd, lr_student=1e-3, resume_mismatch="warn")
    logged = []
    d = _distiller(other, tiny_model, tiny_tokenizer)
    d.log = logged.append
    assert d.load_checkpoint() and d.state.step == 1
    assert any("warning" in m and "lopd.lr_student: 0.0003 → 0.001" in m for m in logged), logged


def test_a_checkpoint_past_the_requested_steps_is_reported(tmp_path, tiny_model, tiny_tokenizer):
    params = _checkpointed(tmp_path, tiny_model, tiny_tokenizer, stop_after=2)
    shorter = copy.deepcopy(params)
    shorter.lopd = replace(shorter.lopd, steps=1)
    with pytest.raises(CheckpointError, match=r"at step 2, past the 1 steps asked for.*--fresh"):
        loop_mod.run_distill(_distiller(shorter, tiny_model, tiny_tokenizer))
    shorter.lopd = replace(shorter.lopd, resume_mismatch="warn")
    logged = []
    d = _distiller(shorter, tiny_model, tiny_tokenizer)
    d.log = logged.append
    assert loop_mod.run_distill(d).step == 2
    assert any("warning" in m and "past the 1 steps" in m for m in logged), logged


def test_a_checkpoint_without_recorded_settings_is_refused(tmp_path, tiny_model, tiny_tokenizer):
    params = _checkpointed(tmp_path, tiny_model, tiny_tokenizer)
    d = _distiller(params, tiny_model, tiny_tokenizer)
    payload = torch.load(d.checkpoint_path(), weights_only=True)
    del payload["settings"]  # as written before checkpoints recorded them
    torch.save(payload, d.checkpoint_path())
    with pytest.raises(CheckpointError, match=r"records no settings.*--fresh"):
        d.load_checkpoint()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_checkpoint_names_itself_and_suggests_fresh(tmp_path, tiny_model, tiny_tokenizer, damage):
    params = _checkpointed(tmp_path, tiny_model, tiny_tokenizer)
    d = _distiller(params, tiny_model, tiny_tokenizer)
    path = d.checkpoint_path()
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": bytes(range(256)) * 8, "empty": b""}[damage])
    with pytest.raises(CheckpointError) as info:
        d.load_checkpoint()
    message = str(info.value)
    assert message.startswith(str(path)) and "unreadable checkpoint" in message and "--fresh" in message


def test_a_file_that_is_no_checkpoint_is_named(tmp_path, tiny_model, tiny_tokenizer):
    d = _distiller(_params(tmp_path), tiny_model, tiny_tokenizer)
    d.checkpoint_path().parent.mkdir(parents=True)
    torch.save({"weights": torch.ones(2)}, d.checkpoint_path())
    with pytest.raises(CheckpointError, match=r"not a `lopd distill` checkpoint \(no state, "):
        d.load_checkpoint()


def test_cli_prints_a_checkpoint_error_without_traceback(monkeypatch, capsys):
    from lopd_cli.main import main
    from lopd_core.drivers import distill

    def refuse(*_a, **_k):
        raise CheckpointError(
            "data/lopd/checkpoint.pt: unreadable checkpoint (EOFError: ); rerun with --fresh to start over"
        )

    monkeypatch.setattr(distill, "run_lopd", refuse)
    assert main(["distill"]) == 1
    err = capsys.readouterr().err
    assert "data/lopd/checkpoint.pt" in err and "--fresh" in err and "Traceback" not in err
