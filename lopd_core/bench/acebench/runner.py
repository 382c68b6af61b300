"""Run a model on ACEBench (normal and special categories): ACEBench's protocol, our wording.

ACEBench is prompt-based: the system message carries the API documents (plus the current time, or the user's
profile for `normal_preference`) and how to answer — calls as a Python list `[ApiName(key='value')]` —; the
user message carries the conversation so far. For the special categories the system message also gives the
three fixed sentences the checker looks for (missing parameters, incorrect values, no suitable function);
those sentences are part of the protocol and stay in English in both languages, as in ACEBench. The output is
kept as `text` (special categories are judged on it; normal ones parse it into calls), so a run can be saved
and rescored with `lopd bench score acebench`. A prompt longer than the model's context fails as
`context_overflow`.
"""

from __future__ import annotations

import json
import time

from lopd_core.bench.acebench.checker import ERROR_PHRASE, INCOMPLETE_PHRASE, IRRELEVANT_PHRASE
from lopd_core.bench.acebench.data import (
    SPECIAL,
    AceEntry,
    expand_categories,
    load_category,
    resolve_data_dir,
)
from lopd_core.bench.acebench.scoring import category_scores, score_entries, with_summaries
from lopd_core.bench.chat_generation import ChatGenerator
from lopd_core.bench.results import Verdict, fail
from lopd_core.config import BenchConfig

CALL_FORMAT = {
    "en": (
        "Decide which API requests the assistant should make next, given the API documents and the "
        "conversation. Answer only with the requests, as a Python list: [ApiName(key1='value1', "
        "key2='value2'), OtherApi(key='value')]. Include a parameter only when the conversation gives its "
        "value, taking the user's own words where the document asks no particular format; an API without "
        "parameters is called as [ApiName()]. Write nothing else."
    ),
    "zh": (
        "请根据API文档和对话内容，判断assistant下一步应发出的API请求。只输出请求本身，写成Python列表："
        "[ApiName(key1='value1', key2='value2'), OtherApi(key='value')]。只包含对话中给出了取值的参数；"
        "文档未规定格式时使用用户原话；没有参数的API写成[ApiName()]。不要输出其他内容。"
    ),
}
SPECIAL_RULES = {
    "en": "If the request cannot be served as given, answer with exactly one of these instead:",
    "zh": "如果无法按原样完成请求，请改为只输出以下之一：",
}
SPECIAL_SENTENCES = (
    f'["{ERROR_PHRASE} (value) for the parameters (key) in the conversation history."]',
    f'["{INCOMPLETE_PHRASE} (key1, key2) for the api (ApiName)"]',
    f'["Due to {IRRELEVANT_PHRASE}, I cannot solve this problem."]',
)
HEADINGS = {
    "en": ("Current time", "User profile", "API documents", "Conversation so far"),
    "zh": ("当前时间", "用户画像", "API文档", "对话历史"),
}


def messages_for(entry: AceEntry) -> list[dict]:
    time_h, profile_h, docs_h, history_h = HEADINGS[entry.language]
    parts = [CALL_FORMAT[entry.language]]
    if entry.category in SPECIAL:
        parts.append("\n".join([SPECIAL_RULES[entry.language], *SPECIAL_SENTENCES]))
    if entry.profile:
        parts.append(f"{profile_h}:\n{entry.profile}")
    elif entry.time:
        parts.append(f"{time_h}: {entry.time}")
    parts.append(f"{docs_h}:\n{json.dumps(entry.functions, ensure_ascii=False, indent=1)}")
    return [
        {"role": "system", "content": "\n\n".join(parts)},
        {"role": "user", "content": f"{history_h}:\n{entry.question}"},
    ]


def run_category(entries: list[AceEntry], generator: ChatGenerator) -> tuple[dict[str, Verdict], dict[str, dict]]:
    """(verdict per id, predictions record per id) of a model on one category of one language."""
    outputs = generator.generate([generator.render(messages_for(e)) for e in entries])
    records = {e.id: {"id": e.id, "text": out or ""} for e, out in zip(entries, outputs)}
    verdicts = score_entries(entries, records)
    for entry, out in zip(entries, outputs):
        if out is None:
            verdicts[entry.id] = fail("context_overflow", "the prompt does not fit the model's context")
    return verdicts, records


def run_acebench(
    model,
    tokenizer,
    bench: BenchConfig,
    *,
    categories: list[str] | None = None,
    languages: list[str] | None = None,
    log=print,
) -> tuple[dict, dict[str, list[dict]]]:
    """A model on ACEBench (default: bench.acebench_categories x bench.acebench_languages, the first
    bench.limit cases — conversations for multi-turn — of each).

    Returns ({language: {category: scores, normal_summary, special_summary}}, predictions records per
    "language/category"). This is what `lopd bench run acebench` and the evaluate flow call; scoring.write_scores
    merges the scores into metrics/eval.json."""
    data_dir = resolve_data_dir(bench.acebench_dir)
    generator = ChatGenerator(model, tokenizer, max_new_tokens=bench.max_new_tokens, batch_size=bench.batch_size)
    scores: dict = {}
    records: dict[str, list[dict]] = {}
    for language in languages or bench.acebench_languages:
        scores[language] = {}
        for category in expand_categories(categories or bench.acebench_categories):
            started = time.perf_counter()
            entries = load_category(category, language, data_dir, bench.limit)
            verdicts, by_id = run_category(entries, generator)
            result = category_scores(entries, verdicts)
            result["context_overflow"] = sum(v.error_type == "context_overflow" for v in verdicts.values())
            scores[language][category] = result
            records[f"{language}/{category}"] = list(by_id.values())
            log(
                f"acebench {language}/{category}: accuracy {result['accuracy']:.4f} (n={result['n']}, "
                f"{result['context_overflow']} over context) in {time.perf_counter() - started:.0f}s"
            )
        with_summaries(scores[language])
    return scores, records
