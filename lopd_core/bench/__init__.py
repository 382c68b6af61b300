"""External benchmarks: scoring prediction files and running a model on real test sets.

Tool use: `bfcl` (Berkeley Function Calling Leaderboard, v3/v4 data format) and `acebench` (normal and special
categories, English and Chinese), sharing the call parser (tool_calls.py), predictions files
(predictions.py), chat rendering and greedy generation (chat_generation.py) and the merge into
metrics/eval.json (results.py). Code: `humaneval` (humaneval.py). Data folders are settings; nothing here
downloads anything.

Keep this file (and bfcl/__init__.py, acebench/__init__.py) free of imports: lopd_core.config reads the category
lists from bfcl/data.py and acebench/data.py, which import only the standard library and results.py.
"""
