"""Conversations through a tokenizer's chat template, generated greedily in batches (benchmark runs).

Rendering: `tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True)`. A template that
knows tools (Qwen, Llama 3.1, ...) places them itself and the model answers in its own JSON tool-call syntax;
`native_tools` tells the caller whether that happens (probed once by rendering a dummy tool). A template
without tool support — the embedded tiny model's — ignores them, so the caller writes the functions into the
system message instead (each benchmark's prompt says how to answer).

Generation reuses the rollout engine's batched, KV-cached `generate_turn` at temperature 0. Prompts are
sorted by length before batching, so a batch wastes little on padding. A prompt that does not fit the
model's context (its prompt plus `max_new_tokens` beyond `max_position_embeddings`) is not generated: the
caller gets None for it and fails that test case as `context_overflow`, instead of scoring what a model says
past the positions it was trained on.
"""

from __future__ import annotations

import torch

from lopd_core.rollout.engine import Sampling, generate_turn

_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "lopd_probe_tool", "description": "probe", "parameters": {"type": "object", "properties": {}}},
}
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")


class ChatGenerator:
    def __init__(self, model, tokenizer, *, max_new_tokens: int = 256, batch_size: int = 8, seed: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.batch_size, self.seed = max_new_tokens, batch_size, seed
        vocab = tokenizer.get_vocab()
        end = next((t for t in _END_OF_TURN if t in vocab), None)
        self.stop_id = vocab[end] if end else tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_id
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.native_tools = self._template_renders_tools()

    def _template_renders_tools(self) -> bool:
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False
            )
        except Exception:  # noqa: BLE001 — a template that rejects `tools` has no tool support
            return False
        return "lopd_probe_tool" in text

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of the conversation up to the assistant's next turn."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools if self.native_tools else None, add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def fits(self, prompt: list[int]) -> bool:
        return self.max_positions is None or len(prompt) + self.max_new_tokens <= self.max_positions

    def _decode(self, ids: list[int]) -> str:
        if ids and ids[-1] == self.stop_id:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        for token in (self.tokenizer.eos_token, self.tokenizer.pad_token):
            if token:
                text = text.replace(token, "")
        return text.strip()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]]) -> list[str | None]:
        """Greedy completion of each prompt (None where the prompt does not fit the context)."""
        outputs: list[str | None] = [None] * len(prompts)
        runnable = sorted((i for i, p in enumerate(prompts) if self.fits(p)), key=lambda i: len(prompts[i]))
        sampling = Sampling(temperature=0.0, max_new_tokens=self.max_new_tokens)
        device = next(self.model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(self.seed)
        for start in range(0, len(runnable), self.batch_size):
            batch = runnable[start : start + self.batch_size]
            results = generate_turn(
                self.model,
                [prompts[i] for i in batch],
                sampling=sampling,
                stop_id=self.stop_id,
                pad_id=self.pad_id,
                generator=generator,
            )
            for i, (ids, _) in zip(batch, results):
                outputs[i] = self._decode(ids)
        return outputs
