"""A tokenizer's fingerprint: what a trace records so that training can tell it was tokenized the same way.

Why: a trace holds token ids only. Ids of another tokenizer with the same vocabulary size train silently on
nonsense, and a larger one fails deep in an embedding lookup; the fingerprint turns both into a one-line refusal
(lopd_core/distill/loop/trace_source.py). It hashes the whole mapping token -> id (added and special tokens
included), so two tokenizers agree exactly when every id means the same token.
"""

from __future__ import annotations

import hashlib
import json


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    return "vocab-sha256:" + digest.hexdigest()[:16]
