"""`lopd bench score|run acebench` end to end (in process), and the prompt protocol of a run."""

import json
from pathlib import Path

import pytest

from lopd_cli.main import main
from lopd_core.bench.acebench.data import load_category, resolve_data_dir
from lopd_core.bench.acebench.runner import messages_for
from lopd_core.bench.acebench.scoring import ground_truth_prediction

ROOT = Path(__file__).resolve().parents[2]
DATA_SETTING = str(ROOT / ".." / "shared" / "benchmarks" / "acebench")
pytestmark = pytest.mark.skipif(not Path(DATA_SETTING).is_dir(), reason="ACEBench data not at ../shared")


def predictions(path, languages, categories, prefix=True):
    data = resolve_data_dir(DATA_SETTING)
    rows = []
    for language in languages:
        for category in categories:
            for entry in load_category(category, language, data):
                row = ground_truth_prediction(entry)
                rows.append({**row, "id": f"{language}/{row['id']}" if prefix else row["id"]})
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def test_score_both_languages_with_prefixed_ids(tmp_path):
    file = predictions(tmp_path / "p.jsonl", ["en", "zh"], ["normal_atom_bool", "special_irrelevant"])
    code = main(
        [
            "bench",
            "score",
            "acebench",
            "--category",
            "normal_atom_bool",
            "--category",
            "special_irrelevant",
            "--predictions",
            str(file),
            "--data-dir",
            DATA_SETTING,
            "--out",
            str(tmp_path / "eval.json"),
        ]
    )
    assert code == 0
    result = json.loads((tmp_path / "eval.json").read_text())["acebench"]
    for language in ("en", "zh"):
        assert result[language]["normal_atom_bool"] == {"accuracy": 1.0, "correct": 50, "n": 50}
        assert result[language]["normal_summary"] == {"accuracy": 1.0, "categories": 1}
        assert result[language]["special_summary"] == {"accuracy": 1.0, "categories": 1}


def test_multi_turn_scores_conversations(tmp_path):
    file = predictions(tmp_path / "p.jsonl", ["en"], ["normal_multi_turn_user_switch"], prefix=False)
    assert (
        main(
            [
                "bench",
                "score",
                "acebench",
                "--category",
                "normal_multi_turn_user_switch",
                "--language",
                "en",
                "--predictions",
                str(file),
                "--data-dir",
                DATA_SETTING,
                "--out",
                str(tmp_path / "eval.json"),
            ]
        )
        == 0
    )
    scores = json.loads((tmp_path / "eval.json").read_text())["acebench"]["en"]["normal_multi_turn_user_switch"]
    assert scores == {"accuracy": 1.0, "process_accuracy": 1.0, "conversations": 50, "correct": 100, "n": 100}


@pytest.mark.parametrize(
    "args,message",
    [
        (["--category", "normal_atom_bool"], "have no language prefix"),
        (["--category", "agent_multi_turn", "--language", "en"], "(agent) is not supported"),
        (["--category", "atomic", "--language", "en"], "unknown ACEBench category 'atomic'"),
    ],
)
def test_clear_errors(tmp_path, capsys, args, message):
    file = predictions(tmp_path / "p.jsonl", ["en"], ["normal_atom_bool"], prefix=False)
    assert (
        main(
            [
                "bench",
                "score",
                "acebench",
                *args,
                "--predictions",
                str(file),
                "--data-dir",
                DATA_SETTING,
                "--out",
                str(tmp_path / "eval.json"),
            ]
        )
        == 2
    )
    assert message in capsys.readouterr().err


def test_data_dir_is_a_setting(tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text("")
    code = main(
        [
            "bench",
            "score",
            "acebench",
            "--category",
            "normal",
            "--language",
            "en",
            "--predictions",
            str(tmp_path / "p.jsonl"),
            "--set",
            'bench.acebench_dir=""',
        ]
    )
    assert code == 1 and "set bench.acebench_dir" in capsys.readouterr().err


def test_prompts_carry_the_protocol():
    data = resolve_data_dir(DATA_SETTING)
    special = messages_for(load_category("special_incomplete", "zh", data, 1)[0])
    assert "Missing necessary parameters" in special[0]["content"] and "API文档" in special[0]["content"]
    preference = messages_for(load_category("normal_preference", "en", data, 1)[0])
    assert "User profile" in preference[0]["content"] and preference[1]["content"].startswith("Conversation")


def test_run_saves_answers_per_language(tmp_path, tiny_model, tiny_tokenizer):
    model_dir = tmp_path / "model"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    code = main(
        [
            "bench",
            "run",
            "acebench",
            "--model",
            str(model_dir),
            "--category",
            "special_irrelevant",
            "--language",
            "en",
            "--limit",
            "2",
            "--data-dir",
            DATA_SETTING,
            "--predictions-out",
            str(tmp_path / "answers"),
            "--out",
            str(tmp_path / "eval.json"),
            "--set",
            "bench.max_new_tokens=4",
        ]
    )
    assert code == 0
    rows = (tmp_path / "answers" / "en" / "special_irrelevant.jsonl").read_text().splitlines()
    assert len(rows) == 2
    scores = json.loads((tmp_path / "eval.json").read_text())["acebench"]["en"]["special_irrelevant"]
    assert scores["n"] == 2
