"""Generate HumanEval completions with a policy in the project's chat format, ready for `humaneval.score`.

The prompt (signature + docstring) is the user turn after a one-line system instruction, exactly as codegen
tasks are framed, and the reply is one assistant turn decoded by the rollout engine's batched generator
(`generate_turn`). The reply's code (first fenced block, else the whole text) becomes the completion: a reply
that restates the function at top level is appended after the prompt on a new line (it redefines the stub),
an indented reply continues the prompt's function body. A context longer than the model's positions keeps its
last tokens (the signature and docstring end of the prompt).
"""

from __future__ import annotations

import torch

from lopd_core.envs.codegen import extract_code
from lopd_core.model.chat import make_chat
from lopd_core.rollout.engine import Sampling, generate_turn

SYSTEM_PROMPT = "Complete the Python function. Reply with the code only."
TOP_LEVEL_STARTS = ("def ", "import ", "from ", "class ", "@")


def completion_from_reply(reply: str) -> str:
    code = extract_code(reply)
    if code.lstrip().startswith(TOP_LEVEL_STARTS) and not code.startswith((" ", "\t")):
        return "\n" + code
    return code


def generate_completions(
    model,
    tokenizer,
    problems: dict[str, dict],
    *,
    samples: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int = 384,
    batch_size: int = 16,
    seed: int = 0,
    log=print,
) -> list[dict]:
    """`samples` completions per problem: [{"task_id", "completion", "reply"}] in problem order."""
    codec = make_chat(tokenizer)
    max_positions = int(getattr(model.config, "max_position_embeddings", 4096))
    budget = max(8, max_positions - max_new_tokens)
    sampling = Sampling(temperature=temperature, max_new_tokens=min(max_new_tokens, max_positions - 8))
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    requests = [
        (task_id, codec.start(SYSTEM_PROMPT, p["prompt"]).token_ids[-budget:])
        for task_id, p in problems.items()
        for _ in range(samples)
    ]
    rows = []
    for start in range(0, len(requests), batch_size):
        chunk = requests[start : start + batch_size]
        turns = generate_turn(
            model,
            [ids for _, ids in chunk],
            sampling=sampling,
            stop_id=codec.im_end_id,
            pad_id=codec.pad_id,
            generator=generator,
        )
        for (task_id, _), (ids, _) in zip(chunk, turns):
            reply = codec.decode_action(ids)
            rows.append({"task_id": task_id, "completion": completion_from_reply(reply), "reply": reply})
        log(f"humaneval: generated {len(rows)}/{len(requests)}")
    return rows
