"""Training refuses traces recorded with another tokenizer in one line, before any step's work."""

from __future__ import annotations

import pytest

from lopd_core.distill.loop.trace_source import TraceStream
from lopd_core.traces import TraceStore
from lopd_core.traces.fingerprint import tokenizer_fingerprint
from tests.serve.test_store import turn
from tests.serve.test_store_faults import feedback


def store_of(folder, fingerprints: list[str]):
    with TraceStore(folder, segment_bytes=10**6, max_bytes=10**7) as store:
        for i, fp in enumerate(fingerprints):
            record = turn(f"t{i}", 0)
            if fp is not None:
                record["tokenizer"] = fp
            store.append(record)
            store.append(feedback(f"t{i}"))
    return str(folder)


def test_traces_of_another_tokenizer_are_refused_in_one_line(tmp_path, tiny_tokenizer):
    mine = tokenizer_fingerprint(tiny_tokenizer)
    stream = TraceStream(store_of(tmp_path / "a", [mine, "vocab-sha256:0123456789abcdef"]), 0, max_tokens=100)
    with pytest.raises(ValueError, match="another tokenizer") as refused:
        stream.check_tokenizer(tiny_tokenizer)
    assert "\n" not in str(refused.value) and mine in str(refused.value)
    TraceStream(store_of(tmp_path / "b", [mine, mine]), 0, max_tokens=100).check_tokenizer(tiny_tokenizer)
    with pytest.warns(UserWarning, match="predate tokenizer fingerprints"):
        TraceStream(store_of(tmp_path / "c", [None]), 0, max_tokens=100).check_tokenizer(tiny_tokenizer)


def test_the_fingerprint_tells_two_tokenizers_of_one_size_apart(tiny_tokenizer):
    vocab = dict(tiny_tokenizer.get_vocab())

    class Swapped:  # the same size, two ids exchanged: the ids would train on the wrong tokens
        def get_vocab(self):
            a, b = sorted(vocab)[:2]
            return {**vocab, a: vocab[b], b: vocab[a]}

    assert tokenizer_fingerprint(Swapped()) != tokenizer_fingerprint(tiny_tokenizer)
