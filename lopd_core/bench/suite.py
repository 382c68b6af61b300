"""The external benchmarks named in `eval.benchmarks`, run on one policy as part of the evaluate stage.

`lopd evaluate` and the pipeline's evaluate task call `run_benchmarks` after the built-in environments and
write the returned sections into the same metrics/eval.json (under "bfcl", "acebench", "humaneval"), where the
MLflow layer picks them up. Each benchmark uses its settings under `bench` (data directories, categories,
limit), exactly as `lopd bench run NAME` does.
"""

from __future__ import annotations


def run_benchmarks(model, tokenizer, params, log=print) -> dict[str, dict]:
    """{benchmark: scores} for each name in params.eval.benchmarks (empty when none are named)."""
    results: dict[str, dict] = {}
    for name in params.eval.benchmarks:
        log(f"evaluate: benchmark {name}")
        if name == "bfcl":
            from lopd_core.bench.bfcl.runner import run_bfcl

            results[name] = run_bfcl(model, tokenizer, params.bench, log=log)[0]
        elif name == "acebench":
            from lopd_core.bench.acebench.runner import run_acebench

            results[name] = run_acebench(model, tokenizer, params.bench, log=log)[0]
        elif name == "humaneval":
            results[name] = _humaneval(model, tokenizer, params)
        else:  # config validation names the allowed values; this guards direct callers
            raise ValueError(f"unknown benchmark {name!r}: expected bfcl, acebench or humaneval")
    return results


def _humaneval(model, tokenizer, params) -> dict:
    from lopd_core.bench.humaneval import load_problems, score
    from lopd_core.bench.humaneval_run import generate_completions

    problems = load_problems()
    if params.bench.limit:
        problems = dict(list(problems.items())[: params.bench.limit])
    rows = generate_completions(
        model,
        tokenizer,
        problems,
        samples=1,
        temperature=0.0,
        max_new_tokens=params.bench.max_new_tokens,
        seed=params.seed,
    )
    summary, _ = score(problems, rows, ks=(1,))
    return summary
