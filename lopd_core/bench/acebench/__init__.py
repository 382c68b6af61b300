"""ACEBench (tool usage), normal and special categories, English and Chinese: our checker, scoring, live runs.

    data.py     categories, languages, the data folder (the setting bench.acebench_dir), entries
    checker.py  ACEBench's rules for normal (call) and special (text) answers
    scoring.py  predictions -> verdicts -> accuracy (end and process accuracy for multi-turn slices)
    runner.py   ACEBench's prompt protocol, greedy generation, parsing

The `agent` category is not supported. What it would need: ACEBench plays it as a dialogue between the model
under test and a simulated *user* (itself an LLM role-playing the instruction, which we would have to run as a
second model), against stateful simulated phone/travel APIs (message, reminder, food-ordering platform, flight
booking) whose classes live in ACEBench's code, not in its data folder: we would need those classes (or our
own equivalents keyed by the data's `initial_config`), a call dispatcher like BFCL's multi-turn one, a step
limit, and the two scores ACEBench defines — end-to-end accuracy (the final state of every involved class
equals `ground_truth`) and process accuracy (the share of the `mile_stone` calls found, in order, among the
calls made). The simulated user also makes runs non-deterministic unless it is greedy and fixed.
"""
