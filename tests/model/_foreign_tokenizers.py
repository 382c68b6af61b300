"""Two tokenizers unlike the embedded one, built here from a few strings: a Hermes/Qwen3-like one (`<|im_start|>`
turns, `<tool_call>` tags, tools listed in the system turn) and a Llama-3-like one (header tokens, `<|eot_id|>`,
a bare JSON call with `parameters`). Vocabularies, pre-tokenizers and Jinja templates are ours, written for the
tests; they follow the shape of those families' public formats, not their text."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

HERMES_TEMPLATE = (
    "{{- '<|im_start|>system\\n' + messages[0].content }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one function per turn. Signatures:\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nReturn a call as JSON with the name and arguments inside <tool_call></tool_call>.' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for m in messages[1:] %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for c in (m.tool_calls or []) %}"
    '{{- \'<tool_call>\\n{"name": "\' + c.function.name + \'", "arguments": \' + (c.function.arguments | tojson)'
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA_TEMPLATE = (
    "{{- bos_token + '<|start_header_id|>system<|end_header_id|>\\n\\n' + messages[0].content }}"
    "{%- if tools %}"
    '{{- \'\\n\\nTo call a function, reply with only {"name": function name, "parameters": arguments}.\' }}'
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- for m in messages[1:] %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    '{{- \'<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "\' + m.tool_calls[0].function.name'
    " + '\", \"parameters\": ' + (m.tool_calls[0].function.arguments | tojson) + '}<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content | trim) + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

CORPUS = [
    "tools: bank_get_balance(account) bank_transfer(src,dst,amount)",
    "[aurora] Move 40 from a12 to a7.",
    '{"name": "bank_transfer", "arguments": {"src": "a12", "dst": "a7", "amount": 40}}',
    '{"name": "bank_transfer", "parameters": {"src": "a12", "dst": "a7", "amount": 40}}',
    '{"result": {"id": "t3", "balance": 300}}',
    '{"error": "unknown tool"}',
    "Done. The transfer went through.",
    "You may call one function per turn. Return a call as JSON with the name and arguments.",
    '{"type": "function", "function": {"name": "bank_transfer", "description": "Move money.", "parameters": {}}}',
]


def _bpe(specials: list[str], split: str, vocab_size: int, corpus: list[str]) -> Tokenizer:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus * 20, trainer=trainer)
    return bpe


def hermes_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen-like: words keep a leading space, newlines are pieces of their own; `<tool_call>` tags are added
    tokens but not special ones (as in Qwen3)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = _bpe(specials, r"\n+| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+| +", 420, CORPUS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.chat_template = HERMES_TEMPLATE
    return tok


def llama_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-3-like: a begin-of-text token, header tokens, `<|eot_id|>`; digits in runs of up to three; no pad
    token (the end of turn pads)."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    bpe = _bpe(specials, r"\n+|[A-Za-z]+|[0-9]{1,3}| ?[^\sA-Za-z0-9]+| +", 380, CORPUS[::-1])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", clean_up_tokenization_spaces=False
    )
    tok.chat_template = LLAMA_TEMPLATE
    return tok
