"""`lopd bench score|run bfcl` end to end (in process): metrics merged, clear errors, predictions saved."""

import json

import pytest

from lopd_cli.main import main
from lopd_core.bench.bfcl.answers import ground_truth_prediction
from lopd_core.bench.bfcl.data import load_category, package_data_dir

DATA = package_data_dir()
pytestmark = pytest.mark.skipif(DATA is None or not DATA.is_dir(), reason="bfcl-eval is not installed")


def write_predictions(path, categories, limit):
    rows = [ground_truth_prediction(e) for c in categories for e in load_category(c, DATA, limit)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_score_merges_into_existing_metrics(tmp_path, capsys):
    metrics = tmp_path / "eval.json"
    metrics.write_text(json.dumps({"toolworld": {"test_id": {"greedy": {"success_rate": 0.5}}}}))
    predictions = write_predictions(tmp_path / "p.jsonl", ["simple", "multi_turn_base"], 4)
    code = main(
        [
            "bench",
            "score",
            "bfcl",
            "--category",
            "simple",
            "--category",
            "multi_turn_base",
            "--partial",
            "--predictions",
            str(predictions),
            "--out",
            str(metrics),
            "--details",
            str(tmp_path / "d.jsonl"),
        ]
    )
    assert code == 0
    result = json.loads(metrics.read_text())
    assert result["toolworld"]["test_id"]["greedy"]["success_rate"] == 0.5  # someone else's numbers survive
    assert result["bfcl"]["simple"] == {"accuracy": 1.0, "correct": 4, "n": 4}
    assert result["bfcl"]["mean_accuracy"] == {"accuracy": 1.0, "categories": 2}
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == 8
    assert '"accuracy": 1.0' in capsys.readouterr().out


def test_missing_predictions_count_as_failures_without_partial(tmp_path):
    predictions = write_predictions(tmp_path / "p.jsonl", ["simple"], 4)
    assert (
        main(
            [
                "bench",
                "score",
                "bfcl",
                "--category",
                "simple",
                "--predictions",
                str(predictions),
                "--out",
                str(tmp_path / "eval.json"),
            ]
        )
        == 0
    )
    scores = json.loads((tmp_path / "eval.json").read_text())["bfcl"]["simple"]
    assert scores["correct"] == 4 and scores["n"] == len(load_category("simple", DATA))


def test_text_predictions_are_parsed_as_in_live_evaluation(tmp_path):
    entry = load_category("simple", DATA, 1)[0]
    ((name, params),) = entry.answer[0].items()
    call = f"{name}(" + ", ".join(f"{k}={v[0]!r}" for k, v in params.items() if v[0] != "") + ")"
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": entry.id, "text": f"```\n[{call}]\n```"}) + "\n")
    assert (
        main(
            [
                "bench",
                "score",
                "bfcl",
                "--category",
                "simple",
                "--partial",
                "--predictions",
                str(tmp_path / "p.jsonl"),
                "--out",
                str(tmp_path / "eval.json"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "eval.json").read_text())["bfcl"]["simple"]["accuracy"] == 1.0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--category", "java"], "unknown BFCL category 'java'"),
        (["--category", "simple"], "no prediction matches an id of category 'simple'"),
    ],
)
def test_clear_errors(tmp_path, capsys, args, message):
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "nope", "calls": []}) + "\n")
    assert (
        main(
            [
                "bench",
                "score",
                "bfcl",
                *args,
                "--predictions",
                str(tmp_path / "p.jsonl"),
                "--out",
                str(tmp_path / "eval.json"),
            ]
        )
        == 2
    )
    assert message in capsys.readouterr().err


def test_missing_data_dir_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text("")
    assert (
        main(
            [
                "bench",
                "score",
                "bfcl",
                "--category",
                "simple",
                "--predictions",
                str(tmp_path / "p.jsonl"),
                "--data-dir",
                str(tmp_path / "absent"),
            ]
        )
        == 1
    )
    assert "is not a directory" in capsys.readouterr().err


def test_run_saves_answers_and_scores(tmp_path, tiny_model, tiny_tokenizer):
    model_dir = tmp_path / "model"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    code = main(
        [
            "bench",
            "run",
            "bfcl",
            "--model",
            str(model_dir),
            "--category",
            "irrelevance",
            "--limit",
            "2",
            "--predictions-out",
            str(tmp_path / "answers"),
            "--out",
            str(tmp_path / "eval.json"),
            "--set",
            "bench.max_new_tokens=4",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "answers" / "irrelevance.jsonl").read_text().splitlines()]
    assert [set(r) for r in rows] == [{"id", "text"}] * 2
    scores = json.loads((tmp_path / "eval.json").read_text())["bfcl"]["irrelevance"]
    assert scores["n"] == 2 and "context_overflow" in scores
