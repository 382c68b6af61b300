"""`eval.benchmarks`: the evaluate stage runs the named benchmarks and their numbers reach eval.json and MLflow."""

from lopd_core.bench.suite import run_benchmarks
from lopd_core.config import load_params
from lopd_core.export import eval_rows
from tasks.tracking import eval_metrics


def test_no_benchmarks_by_default(tiny_model, tiny_tokenizer):
    params = load_params("params.yaml")
    assert params.eval.benchmarks == []
    assert run_benchmarks(tiny_model, tiny_tokenizer, params, log=lambda *_: None) == {}


def test_humaneval_runs_through_the_sandbox(tiny_model, tiny_tokenizer):
    params = load_params("params.yaml", ["eval.benchmarks=[humaneval]", "bench.limit=2", "bench.max_new_tokens=8"])
    results = run_benchmarks(tiny_model, tiny_tokenizer, params, log=lambda *_: None)
    summary = results["humaneval"]
    assert summary["n_problems"] == 2
    assert summary["pass@1"] == 0.0  # a random tiny model writes no working Python


def test_benchmark_sections_are_metrics_but_not_environment_rows():
    results = {
        "toolworld": {"test_id": {"greedy": {"success_rate": 0.25, "reward_mean": 0.5, "n": 4}}},
        "humaneval": {"pass@1": 0.5, "n_problems": 2, "statuses": {"passed": 1}, "source": "model:x"},
        "bfcl": {"simple": {"accuracy": 0.1, "correct": 1, "n": 10}, "mean_accuracy": {"accuracy": 0.1}},
    }
    assert [row[0] for row in eval_rows(results)] == ["toolworld"]
    metrics = eval_metrics(results)
    assert metrics["eval.toolworld.test_id.greedy.success_rate"] == 0.25
    assert metrics["eval.bfcl.simple.accuracy"] == 0.1
    assert metrics["eval.humaneval.statuses.passed"] == 1.0
    assert any(name.startswith("eval.humaneval.pass") and value == 0.5 for name, value in metrics.items())
    assert not any("source" in name for name in metrics)
