"""Running a model on BFCL: the dialogue loop with a scripted model, and the real generator on a tiny model."""

import json

import pytest

from lopd_core.bench.bfcl.data import BfclEntry, load_category, package_data_dir
from lopd_core.bench.bfcl.runner import as_tool, opening_messages, run_category
from lopd_core.bench.chat_generation import ChatGenerator
from lopd_core.bench.tool_calls import parse_call_string

DATA = package_data_dir()
needs_bfcl = pytest.mark.skipif(DATA is None or not DATA.is_dir(), reason="bfcl-eval is not installed")


class ScriptedModel:
    """Stands in for ChatGenerator: answers from a script, one output per call of `generate` (batch of 1)."""

    native_tools = False

    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.conversations = []

    def render(self, messages, tools=None):
        self.conversations.append(json.loads(json.dumps(messages)))
        return [0]

    def generate(self, prompts):
        return [self.outputs.pop(0) for _ in prompts]


@needs_bfcl
def test_multi_turn_loop_with_a_model_that_answers_the_ground_truth():
    entry = load_category("multi_turn_miss_func", DATA, 1)[0]
    script = []
    for calls in entry.answer:  # each turn: the calls, then an answer without a call ends the turn
        if calls:
            script.append("[" + ", ".join(calls) + "]")
        script.append("Done.")
    model = ScriptedModel(script)
    verdicts, records = run_category([entry], model, DATA)
    assert verdicts[entry.id].valid, verdicts[entry.id].error
    assert [[parse_call_string(c) for c in t] for t in records[entry.id]["turns"]] == [
        [parse_call_string(c) for c in t] for t in entry.answer
    ]
    last = model.conversations[-1]
    assert sum(m["role"] == "tool" for m in last) == sum(len(t) for t in entry.answer)  # every result came back
    assert any("More functions are available now" in m["content"] for m in last if m["role"] == "user")


@needs_bfcl
def test_single_turn_run_scores_parsed_output():
    entries = load_category("parallel", DATA, 2)
    first = entries[0].answer
    text = (
        "["
        + ", ".join(
            f"{n}(" + ", ".join(f"{k}={v[0]!r}" for k, v in p.items() if v[0] != "") + ")"
            for e in first
            for n, p in e.items()
        )
        + "]"
    )
    verdicts, records = run_category(entries, ScriptedModel([text, "no idea"]), DATA)
    assert verdicts[entries[0].id].valid, verdicts[entries[0].id].error
    assert not verdicts[entries[1].id].valid
    assert records[entries[1].id] == {"id": entries[1].id, "text": "no idea"}


def test_prompt_carries_functions_and_keeps_a_system_message():
    doc = {
        "name": "add",
        "description": "add",
        "parameters": {
            "type": "dict",
            "properties": {"a": {"type": "float"}, "xs": {"type": "tuple", "items": {"type": "any"}}},
            "required": ["a"],
        },
    }
    entry = BfclEntry(
        "live_simple_0",
        "live_simple",
        [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]],
        [doc],
        None,
    )
    messages = opening_messages(entry, native_tools=False)
    assert messages[0]["role"] == "system" and '"name": "add"' in messages[0]["content"]
    assert messages[0]["content"].endswith("Be brief.") and len(messages) == 2
    schema = as_tool(doc)["function"]["parameters"]
    assert schema["type"] == "object" and schema["properties"]["a"]["type"] == "number"
    assert schema["properties"]["xs"] == {"type": "array", "items": {"type": "string"}}


def test_real_generation_on_the_tiny_model(tiny_model, tiny_tokenizer):
    doc = {
        "name": "ping",
        "description": "ping a host",
        "parameters": {"type": "dict", "properties": {"host": {"type": "string"}}, "required": ["host"]},
    }
    entry = BfclEntry(
        "simple_python_0", "simple", [[{"role": "user", "content": "ping a"}]], [doc], [{"ping": {"host": ["a"]}}]
    )
    generator = ChatGenerator(tiny_model, tiny_tokenizer, max_new_tokens=8, batch_size=2)
    assert not generator.native_tools  # the embedded template has no tool support: functions go in the prompt
    verdicts, records = run_category([entry], generator, DATA)
    assert isinstance(records[entry.id]["text"], str)
    assert verdicts[entry.id].error_type != "context_overflow"
    too_long = ChatGenerator(tiny_model, tiny_tokenizer, max_new_tokens=5000)
    verdicts, _ = run_category([entry], too_long, DATA)
    assert verdicts[entry.id].error_type == "context_overflow"
