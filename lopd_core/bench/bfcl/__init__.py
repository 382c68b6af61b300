"""BFCL (Berkeley Function Calling Leaderboard), v3 and v4 data formats: our own checker, scoring, live runs.

    data.py        categories, data folder (setting, default: the bfcl-eval package's data), entries
    checker.py     single-turn rules (name, required, types, values, order, irrelevance)
    multi_turn.py  the package's simulated APIs driven without eval; per-turn state and response checks
    scoring.py     predictions JSONL -> verdicts -> accuracy per category
    answers.py     ground truth as predictions;  mutations.py  the mutation suite
    reference.py   BFCL's own checker behind a stub, for agreement measurements only
    runner.py      prompting a model through its chat template, parsing, multi-turn execution

Command line: `lopd bench score bfcl --category C --predictions FILE`, `lopd bench run bfcl --category C`.
"""
