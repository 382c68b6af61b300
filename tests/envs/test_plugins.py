"""Environment plugins: resolution (built-ins, envs.plugins, entry points), task files, configuration, the split
between the pretraining stream (built-ins only) and the deployment stream (the whole mix), evaluation shards,
and `lopd envs check`."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
from _plugin_fixture import NotesEnv

from lopd_core.config import ConfigError, EnvsConfig, Params
from lopd_core.envs import check_env_contract, make_env, make_tasks, registry
from lopd_core.envs.task_files import TaskFileError

library = pytest.importorskip("lopd_example_env", reason="install examples/lopd-example-env (setup.sh --dev)")


@pytest.fixture(autouse=True)
def clean_registry():
    registry.use_config(SimpleNamespace(plugins={}, task_files={}))
    yield
    registry.use_config(SimpleNamespace(plugins={}, task_files={}))


def use(plugins=None, task_files=None):
    registry.use_config(SimpleNamespace(plugins=plugins or {}, task_files=task_files or {}))


def write_tasks(path, rows):
    path.write_text("# a comment line\n\n" + "\n".join(json.dumps(r) for r in rows) + "\n")
    return path


NOTE = {"state": {"notes": {}}, "checks": [{"op": "present", "path": ["notes", "a"]}]}


def test_the_example_resolves_through_its_entry_point():
    assert registry.installed()["library"] == "lopd_example_env:LibraryEnv"
    assert registry.env_class("library") is library.LibraryEnv
    assert registry.env_splits("library") == ("train", "test_id", "test_ood")
    for split in registry.env_splits("library"):
        tasks = make_tasks("library", split, 3, seed=0)
        assert [t.env for t in tasks] == ["library"] * 3 and {t.world for t in tasks} == {"library"}


def test_params_plugins_resolve_and_bad_ones_say_why():
    with pytest.raises(ValueError, match="unknown env 'notes'; known: toolworld, codegen, library"):
        make_env("notes")
    use({"notes": "_plugin_fixture:NotesEnv", "wrong": "_plugin_fixture:Misnamed", "fn": "_plugin_fixture:add_note"})
    assert type(make_env("notes").inner).__name__ == "NotesEnv"  # behind the step timeout (guarded.py)
    with pytest.raises(ValueError, match="the class's name is 'something_else'"):
        make_env("wrong")
    with pytest.raises(TypeError, match="not an environment class"):
        make_env("fn")
    with pytest.raises(ValueError, match="no task_file"):  # no file of its own and none configured
        make_tasks("notes", "train", 1, 0)
    assert list(registry.known_envs())[:3] == ["toolworld", "codegen", "notes"]


def test_a_plugins_own_make_tasks_is_the_task_source():
    use({"counter": "_plugin_fixture:CounterEnv"})
    assert registry.env_splits("counter") == ("train", "test_id")
    tasks = make_tasks("counter", "test_id", 2, seed=5)
    assert [t.task_id for t in tasks] == ["counter/test_id/5/0", "counter/test_id/5/1"]
    with pytest.raises(ValueError, match="has no 'test_ood' tasks; its splits: train, test_id"):
        make_tasks("counter", "test_ood", 2, 0)


def test_task_files_splits_order_repeats_and_held_out_caps(tmp_path):
    rows = [{"split": "train", "instruction": f"Add note {i}.", **NOTE} for i in range(3)]
    rows += [{"split": "test_ood", "instruction": "Add a.", "task_id": "ood-a", "world": "w2", "max_turns": 2, **NOTE}]
    use({"notes": "_plugin_fixture:NotesEnv"}, {"notes": str(write_tasks(tmp_path / "t.jsonl", rows))})
    assert registry.env_splits("notes") == ("train", "test_ood")
    train = make_tasks("notes", "train", 7, seed=1)
    assert len(train) == 7 and sorted(t.task_id for t in train[:3]) == [f"notes/train/{i:04d}" for i in range(3)]
    assert make_tasks("notes", "train", 4, seed=1) == train[:4]  # a larger n extends a smaller one
    assert make_tasks("notes", "train", 7, seed=1) == train  # seeded
    (ood,) = make_tasks("notes", "test_ood", 5, seed=1)  # held out: never repeated
    assert (ood.task_id, ood.world, ood.template, ood.max_turns) == ("ood-a", "w2", "notes", 2)
    assert ood.spec == NOTE and train[0].max_turns == NotesEnv.max_turns
    # NotesEnv declares a tool with a bug: the checker calls every tool, so it fails there, naming it (issue #30)
    with pytest.raises(AssertionError, match=r"task notes/train/\d+: a tool raised inside \(crash: KeyError"):
        check_env_contract(lambda: make_env("notes"), train[:3] + [ood])


@pytest.mark.parametrize(
    "line, why",
    [
        ("{not json", ":3: not JSON"),
        ('["a"]', ":3: a task must be a JSON object"),
        ('{"split": "dev", "instruction": "x"}', "split 'dev' is not one of train, val, test_id"),
        ('{"split": "train", "instruction": ""}', "instruction must be a non-empty string"),
        ('{"split": "train", "instruction": "x", "max_turns": 0, "state": {}, "checks": []}', "max_turns must be"),
        ('{"split": "train", "instruction": "x", "state": {}, "checks": [{"op": "exec"}]}', "unknown check op 'exec'"),
    ],
)
def test_bad_task_lines_name_the_file_and_line(tmp_path, line, why):
    path = tmp_path / "bad.jsonl"
    path.write_text("# header\n\n" + line + "\n")
    use({"notes": "_plugin_fixture:NotesEnv"}, {"notes": str(path)})
    with pytest.raises(TaskFileError, match=why):
        make_tasks("notes", "train", 1, 0)


def test_duplicate_task_ids_are_refused(tmp_path):
    rows = [{"split": "train", "instruction": "x", "task_id": "same", **NOTE}] * 2
    use({"notes": "_plugin_fixture:NotesEnv"}, {"notes": str(write_tasks(tmp_path / "t.jsonl", rows))})
    with pytest.raises(TaskFileError, match=":4: task_id 'same' appears twice"):
        make_tasks("notes", "train", 1, 0)


def test_configuration_accepts_plugins_and_names_what_is_known(tmp_path):
    assert EnvsConfig(mix={"toolworld": 1.0, "library": 0.5}).mix["library"] == 0.5
    EnvsConfig(mix={"notes": 1.0}, plugins={"notes": "_plugin_fixture:NotesEnv"})
    with pytest.raises(
        ConfigError,
        match=r"envs.mix: got 'nope', expected one of the known environments: codegen, "
        r"toolworld, library",
    ):
        EnvsConfig(mix={"nope": 1.0})
    with pytest.raises(ConfigError, match=r"envs.plugins.codegen"):
        EnvsConfig(plugins={"codegen": "m:C"})
    with pytest.raises(ConfigError, match=r"envs.task_files.toolworld: .* expected a plugin environment's name"):
        EnvsConfig(task_files={"toolworld": "x.jsonl"})
    with pytest.raises(ConfigError, match=r"envs.task_files.library: .* expected an existing JSON Lines file"):
        EnvsConfig(task_files={"library": str(tmp_path / "missing.jsonl")})


def test_pretraining_draws_built_ins_only_and_deployment_the_whole_mix():
    from lopd_core.envs.mix import deployment_tasks, pretraining_mix, pretraining_tasks

    envs = EnvsConfig(mix={"toolworld": 1.0, "library": 1.0}, pretrain_worlds=2)
    assert pretraining_mix(envs.mix) == {"toolworld": 1.0}
    assert pretraining_mix({"library": 1.0}) == {"toolworld": 1.0}
    assert {t.env for t in pretraining_tasks(envs, 6, seed=0)} == {"toolworld"}
    train = deployment_tasks(envs, "train", 6, seed=0)
    assert [t.env for t in train].count("library") == 3 and {t.env for t in train} == {"toolworld", "library"}


def test_a_small_task_files_val_and_test_final_take_what_it_has_with_a_warning(tmp_path):
    """At the default sizes (hundreds asked) a hand-written file's val / test_final hold a few tasks: the split takes
    them, warning with the env and both counts; a mix whose plugin has no such split draws it from the others, and
    one where no env has it fails at once, naming the split (teacher_probe.py draws before it loads a model)."""
    from lopd_core.envs.mix import deployment_tasks

    n = Params().eval.n_per_split
    rows = [
        {"split": s, "instruction": f"Add note {s} {i}.", **NOTE}
        for s, k in [("train", 3), ("val", 2)]
        for i in range(k)
    ]
    rows.append({"split": "test_final", "instruction": "Add the final note.", **NOTE})
    path = str(write_tasks(tmp_path / "t.jsonl", rows))
    use({"notes": "_plugin_fixture:NotesEnv"}, {"notes": path})
    for split, count in (("val", 2), ("test_final", 1)):
        with pytest.warns(UserWarning, match=rf"env 'notes'.* holds {count} '{split}' tasks, fewer than the {n} asked"):
            tasks = make_tasks("notes", split, n, seed=0)
        assert len(tasks) == count and {t.split for t in tasks} == {split}
    envs = EnvsConfig(
        mix={"toolworld": 1.0, "notes": 1.0},
        plugins={"notes": "_plugin_fixture:NotesEnv"},
        task_files={"notes": path},
        pretrain_worlds=2,
    )
    with pytest.warns(UserWarning, match="holds 2 'val' tasks"):
        val = deployment_tasks(envs, "val", 8, seed=0)
    assert [t.env for t in val].count("notes") == 2 and len(val) == 6  # toolworld's 4 and the file's 2
    without = str(write_tasks(tmp_path / "no_val.jsonl", rows[:3]))
    envs = replace(envs, task_files={"notes": without})
    with pytest.warns(UserWarning, match="notes has no 'val' tasks.*drawn from toolworld only"):
        assert {t.env for t in deployment_tasks(envs, "val", 4, seed=0)} == {"toolworld"}
    with pytest.raises(ValueError, match="no environment of the mix has 'val' tasks \\(notes\\)"):
        deployment_tasks(replace(envs, mix={"notes": 1.0}), "val", 4, seed=0)


def test_evaluation_shards_of_a_plugin_skip_pretrain_test_and_experience():
    from lopd_core.evaluation import eval_shards

    params = Params()
    params.envs = EnvsConfig(mix={"toolworld": 1.0, "library": 1.0})
    params.eval = replace(params.eval, modes=["greedy"], with_experience=True)
    shards = {(s.env, s.variant) for s in eval_shards(params)}
    assert {v for e, v in shards if e == "library"} == {"test_id", "test_ood"}
    assert {v for e, v in shards if e == "toolworld"} == {
        "test_id",
        "test_ood",
        "pretrain_test",
        "test_final",
        "test_id+experience",
        "test_ood+experience",
        "pretrain_test+experience",
        "test_final+experience",
    }


def test_lopd_envs_check_prints_ok_or_every_failure(capsys):
    from lopd_cli.main import main

    assert main(["envs", "check", "library"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "OK library: the contract holds on 9 tasks (train 3, test_id 3, test_ood 3); "
        "entry point lopd.envs: lopd_example_env:LibraryEnv"
    )
    assert len(out) == 2 and out[1].startswith("note: library's tools are trusted code")  # test_plugin_isolation.py
    assert main(["envs", "check", "echo", "--set", "envs.plugins={echo: '_plugin_fixture:EchoEnv'}"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[0].startswith("FAIL echo train: [env contract] task echo/train/0/0: user text")
    assert main(["envs", "check", "nope"]) == 1
    assert "unknown env 'nope'" in capsys.readouterr().out
    assert main(["envs", "list"]) == 0
    assert "library          entry point lopd.envs: lopd_example_env:LibraryEnv" in capsys.readouterr().out


def test_plugin_successes_bank_and_retrieve_within_their_world(tmp_path):
    """What the cycle does with a plugin's successes, on scripted wins (a tiny base rarely wins one): bank rows
    under the env's name and world, a tool-chain experience text, same-world retrieval."""
    from _plugin_fixture import solve_library

    from lopd_core.bank import ExperienceBank
    from lopd_core.envs import run_oracle
    from lopd_core.rollout.engine import Trajectory
    from lopd_core.rollout.table import trajectories_to_frame

    def won(task, actions):
        env = make_env(task)
        env.reset(task)
        for action in actions:
            r = env.step(action)
        assert r.info["success"]
        return Trajectory(
            task=task,
            sample_index=0,
            experiences=(),
            token_ids=[1, 2, 3],
            action_mask=[0, 1, 1],
            sample_logprobs=[0.0, -0.1, -0.2],
            prompt_length=1,
            reward=1.0,
            success=True,
            stop_reason="answer",
            num_turns=len(actions),
            episode=env.episode,
        )

    trajs = [won(t, solve_library(t)) for t in make_tasks("library", "train", 6, seed=0)]
    trajs += [won(t, run_oracle(t)[0]) for t in make_tasks("toolworld", "train", 6, seed=0)]
    with ExperienceBank(tmp_path / "experience.parquet", index_dir=tmp_path / "index") as bank:
        bank.refresh(trajectories_to_frame(trajs), min_reward=1.0, policy_version="scripted", cycle=0)
        rows = bank.store.load()
        library_rows = rows[rows["env"] == "library"]
        assert len(library_rows) == 6 and set(library_rows["world"]) == {"library"}
        assert all(
            "lend_book {" in text or "return_book {" in text or "books_by {" in text
            for text in library_rows["experience_text"]
        )
        query = make_tasks("library", "test_id", 2, seed=0)
        hits = bank.retrieve(query, 3, False, same_world=True)
        assert [[h.world for h in task_hits] for task_hits in hits] == [["library"] * 3] * 2
