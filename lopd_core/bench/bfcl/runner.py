"""Run a model on BFCL: prompt through its chat template, generate greedily, parse calls, execute multi-turn.

Prompting. A chat template with tool support gets the functions as tools (BFCL's type names translated to
JSON Schema: dict -> object, float -> number, tuple -> array, any -> string) and answers in its own JSON
tool-call syntax. A template without it (the embedded tiny model's) gets our system message: the functions as
JSON and the instruction to answer with Python calls, `[func(param=value), ...]`, or nothing when no function
fits. Both answers parse with tool_calls.parse_calls.

Multi-turn. Each user turn, the model is asked again after each answer that contains calls: the calls run on
the simulated APIs (multi_turn.py) and their results come back as `tool` messages; an answer without calls
ends the turn, as does `max_steps_per_turn`. Functions held out by miss_func arrive at their turn (as tools,
or listed in a user message). The calls made per turn become the `turns` prediction, scored like a file.

Outputs are predictions records (`text` for single-turn, `turns` for multi-turn), so a run can be saved and
rescored with `lopd bench score bfcl`. A prompt longer than the model's context fails as `context_overflow`.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from lopd_core.bench.bfcl.data import BfclEntry, load_category, resolve_data_dir
from lopd_core.bench.bfcl.multi_turn import build_apis
from lopd_core.bench.bfcl.scoring import score_entries, with_mean
from lopd_core.bench.chat_generation import ChatGenerator
from lopd_core.bench.results import Verdict, accuracy_summary, fail
from lopd_core.bench.tool_calls import calls_or_none
from lopd_core.config import BenchConfig

_SCHEMA_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}

INSTRUCTION = (
    "You can call the functions listed below. Read the user's request and answer only with the function calls "
    "that fulfil it, written as a Python list: [func_name(param=value, other_param=value), other_func(param=value)]. "
    "Use the parameter names of the functions. If no function fits the request, or a required value is not "
    "given, answer in plain words without any call. Write nothing else besides the calls."
)
MULTI_TURN_NOTE = (
    "After your calls run, you will see their results; call more functions if the request "
    "needs them, and answer without a call once the request is done."
)


def json_schema(node):
    """BFCL's parameter document as JSON Schema (what chat templates with tool support expect)."""
    if isinstance(node, dict):
        out = {k: json_schema(v) for k, v in node.items()}
        if isinstance(out.get("type"), str):
            out["type"] = _SCHEMA_TYPES.get(out["type"], out["type"])
        return out
    if isinstance(node, list):
        return [json_schema(v) for v in node]
    return node


def as_tool(doc: dict) -> dict:
    return {
        "type": "function",
        "function": {
            "name": doc["name"],
            "description": doc.get("description", ""),
            "parameters": json_schema(doc.get("parameters", {})),
        },
    }


def system_text(functions: list[dict], multi_turn: bool) -> str:
    note = f"\n{MULTI_TURN_NOTE}" if multi_turn else ""
    return f"{INSTRUCTION}{note}\n\nFunctions:\n{json.dumps(functions, ensure_ascii=False, indent=1)}"


def opening_messages(entry: BfclEntry, native_tools: bool) -> list[dict]:
    """The first turn's messages, with our instruction merged into its system message (or a new one)."""
    messages = copy.deepcopy(entry.turns[0])
    if native_tools:
        return messages
    text = system_text(entry.functions, entry.multi_turn)
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{text}\n\n{messages[0]['content']}"
        return messages
    return [{"role": "system", "content": text}, *messages]


@dataclass
class _Dialogue:
    """One multi-turn test case being played."""

    entry: BfclEntry
    messages: list[dict]
    tools: list[dict]
    apis: object
    turn: int = 0
    steps: int = 0
    calls: list[list[str]] = field(default_factory=lambda: [[]])
    overflow: bool = False
    done: bool = False

    def next_turn(self, native_tools: bool) -> None:
        self.turn += 1
        self.steps = 0
        if self.turn >= len(self.entry.turns):
            self.done = True
            return
        self.calls.append([])
        added = self.entry.added_functions.get(self.turn, [])
        new_messages = copy.deepcopy(self.entry.turns[self.turn])
        if added:
            self.tools += [as_tool(d) for d in added]
            note = (
                "More functions are available now."
                if native_tools
                else f"More functions are available now:\n{json.dumps(added, ensure_ascii=False, indent=1)}"
            )
            new_messages = [{"role": "user", "content": note}, *new_messages]
        self.messages += new_messages


def _play_single_turn(entries: list[BfclEntry], generator: ChatGenerator) -> tuple[dict, set]:
    prompts = [
        generator.render(opening_messages(e, generator.native_tools), [as_tool(d) for d in e.functions])
        for e in entries
    ]
    outputs = generator.generate(prompts)
    records = {e.id: {"id": e.id, "text": out or ""} for e, out in zip(entries, outputs)}
    return records, {e.id for e, out in zip(entries, outputs) if out is None}


def _play_multi_turn(
    entries: list[BfclEntry], generator: ChatGenerator, data_dir: Path, max_steps_per_turn: int
) -> tuple[dict, set]:
    dialogues = [
        _Dialogue(
            e, opening_messages(e, generator.native_tools), [as_tool(d) for d in e.functions], build_apis(e, data_dir)
        )
        for e in entries
    ]
    while active := [d for d in dialogues if not d.done]:
        outputs = generator.generate([generator.render(d.messages, d.tools) for d in active])
        for dialogue, text in zip(active, outputs):
            if text is None:
                dialogue.overflow = dialogue.done = True
                continue
            dialogue.messages.append({"role": "assistant", "content": text})
            calls = calls_or_none(text)
            for call in calls:
                dialogue.calls[-1].append(call.python_source())
                dialogue.messages.append({"role": "tool", "content": dialogue.apis.execute(call)})
            dialogue.steps += 1
            if not calls or dialogue.steps >= max_steps_per_turn:
                dialogue.next_turn(generator.native_tools)
    records = {}
    for d in dialogues:
        turns = d.calls + [[] for _ in range(len(d.entry.turns) - len(d.calls))]
        records[d.entry.id] = {"id": d.entry.id, "turns": turns}
    return records, {d.entry.id for d in dialogues if d.overflow}


def run_category(
    entries: list[BfclEntry], generator: ChatGenerator, data_dir: Path, max_steps_per_turn: int = 5
) -> tuple[dict[str, Verdict], dict[str, dict]]:
    """(verdict per id, predictions record per id) of a model on one category's entries."""
    if not entries:
        return {}, {}
    if entries[0].multi_turn:
        records, overflow = _play_multi_turn(entries, generator, data_dir, max_steps_per_turn)
    else:
        records, overflow = _play_single_turn(entries, generator)
    verdicts = score_entries(entries, records, data_dir)
    for entry_id in overflow:
        verdicts[entry_id] = fail("context_overflow", "the prompt does not fit the model's context")
    return verdicts, records


def run_bfcl(
    model, tokenizer, bench: BenchConfig, *, categories: list[str] | None = None, log=print
) -> tuple[dict, dict[str, list[dict]]]:
    """A model on BFCL categories (default: bench.bfcl_categories, the first bench.limit cases of each).

    Returns ({category: {accuracy, correct, n, context_overflow}, "mean_accuracy": {...}}, predictions records
    per category). This is what `lopd bench run bfcl` and the evaluate flow call; scoring.write_scores merges
    the scores into metrics/eval.json."""
    data_dir = resolve_data_dir(bench.bfcl_dir)
    generator = ChatGenerator(model, tokenizer, max_new_tokens=bench.max_new_tokens, batch_size=bench.batch_size)
    scores: dict = {}
    records: dict[str, list[dict]] = {}
    for category in categories or bench.bfcl_categories:
        started = time.perf_counter()
        entries = load_category(category, data_dir, bench.limit)
        verdicts, by_id = run_category(entries, generator, data_dir, bench.max_steps_per_turn)
        overflow = sum(v.error_type == "context_overflow" for v in verdicts.values())
        scores[category] = {**accuracy_summary(verdicts), "context_overflow": overflow}
        records[category] = list(by_id.values())
        log(
            f"bfcl {category}: accuracy {scores[category]['accuracy']:.4f} ({scores[category]['correct']}/"
            f"{len(entries)}, {overflow} over context) in {time.perf_counter() - started:.0f}s"
        )
    return with_mean(scores), records
