"""The constrained decoder's helper (lopd_core/rollout/constrained.py, issue #47 item 4) on the tiny tokenizer and on
two foreign ones: every token of a valid output is in its step's mask and the end token closes it; an invalid
continuation is masked; seeded random walks over the masks end in outputs the server's own parsers read as what
was asked (a JSON object of the schema, a call of a declared tool in the chat format's syntax); the optimized mask
(the vocabulary walked as sorted ranges, plain string text as one precomputed mask, masks cached by state) equals
a naive one that feeds every token's bytes; the schema subset is compiled, and what lies outside it is named."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from lopd_core.envs.toolworld.tools import parse_calls
from lopd_core.model.chat import ChatCodec
from lopd_core.model.chat.template import TemplateChat
from lopd_core.model.loading import add_experience_tokens
from lopd_core.rollout.constrained import Constrained, vocabulary
from lopd_core.rollout.json_schema import SchemaError, compile_schema, schema_text
from lopd_core.rollout.turn_grammar import OutputConstraint
from lopd_serve.conversation import call_text
from lopd_serve.protocol import ApiError
from lopd_serve.structured import check_writable
from tests.model._foreign_tokenizers import hermes_tokenizer, llama_tokenizer

KEY = {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["a", "b", 1, None]},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "home": {"$ref": "#/$defs/Place"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}
CALLS = ("<tool_call>", "</tool_call>")  # the embedded format's call syntax


def answer(schema) -> OutputConstraint:
    return OutputConstraint(schema=schema_text(schema))


def calls(*names, several=False, open_close=CALLS, key="arguments") -> OutputConstraint:
    return OutputConstraint(
        tools=tuple((n, schema_text(KEY)) for n in names),
        call_open=open_close[0],
        call_close=open_close[1],
        arguments_key=key,
        several_calls=several,
    )


def accepts(constraint, tokenizer, end_id, ids) -> bool:
    """Every id is in its step's mask (the end token last, or after the ids)."""
    c = Constrained(constraint, tokenizer, end_id)
    for t in [*ids, end_id] if not ids or ids[-1] != end_id else ids:
        if not bool(c.mask(len(tokenizer))[t]):
            return False
        c.advance(t)
    return True


def walk(constraint, tokenizer, end_id, seed, steps=1200) -> list[int] | None:
    """A seeded random walk over the masks (the end token taken half the times it is allowed); None if it did not
    end within `steps`."""
    rng = random.Random(seed)
    c = Constrained(constraint, tokenizer, end_id)
    ids = []
    for _ in range(steps):
        allowed = c.mask(len(tokenizer)).nonzero().flatten().tolist()
        token = end_id if end_id in allowed and rng.random() < 0.5 else rng.choice(allowed)
        c.advance(token)
        ids.append(token)
        if token == end_id:
            return ids
    return None


def valid(value, schema) -> bool:
    """The schema subset, checked by hand on a parsed value (the reference the decoded outputs must meet)."""
    schema = PERSON["$defs"]["Place"] if schema.get("$ref") else schema
    if "anyOf" in schema:
        return any(valid(value, s) for s in schema["anyOf"])
    if "enum" in schema:
        return value in schema["enum"] and type(value) in {type(v) for v in schema["enum"]}
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties")
        if not isinstance(value, dict) or (props is not None and not set(value) <= set(props)):
            return False
        return set(schema.get("required", [])) <= set(value) and all(valid(v, props[k]) for k, v in value.items())
    if kind == "array":
        return isinstance(value, list) and all(valid(v, schema.get("items", {})) for v in value)
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
    }
    return checks[kind](value) if kind else True


@pytest.fixture(scope="module")
def codec(tiny_tokenizer):
    return ChatCodec(tiny_tokenizer)


def test_a_valid_output_is_kept_token_by_token_and_an_invalid_one_is_masked(codec):
    tok, end = codec.tokenizer, codec.im_end_id
    person = {"name": "Ann Lee", "age": -12, "score": 1.5e3, "tags": ["x", 'é "q" \\ /'], "note": None}
    for doc in (json.dumps(person), json.dumps(person, indent=2), json.dumps({"home": {"city": "Oslo"}, **person})):
        assert accepts(answer(PERSON), tok, end, codec.encode(doc)), doc
    assert accepts(answer({"type": "object"}), tok, end, codec.encode('{"a": [1, {"b": null}], "c": "\\u00e9"}'))
    for doc in (
        '{"age": 3}',  # a required key missing
        '{"name": "a", "age": "3"}',  # a string where an integer goes
        '{"name": "a", "age": 3, "other": 1}',  # an undeclared key
        '{"name": "a", "age": 3,}',  # a trailing comma
        '{"name": "a", "name": "b", "age": 3}',  # a key twice
        '{"name": "a", "age": 3.5}',  # a fraction for an integer
        '{"name": "\\ud800", "age": 1}',  # an escaped surrogate (no character: the store could not write it)
        '{"name": "a", "age": 1} ',  # text after the object
        "[1]",  # not an object
    ):
        assert not accepts(answer(PERSON), tok, end, codec.encode(doc)), doc
    call = codec.action_ids(call_text("lookup", {"key": "a b"}))  # what the environment's syntax writes
    assert accepts(calls("lookup", "send"), tok, end, call)
    assert not accepts(calls("send"), tok, end, call)  # another tool than the one named
    for arguments in ({"key": "</tool_call>"}, {}, {"key": 1}):  # the tag in a string; a required key; a type
        assert not accepts(calls("lookup"), tok, end, codec.action_ids(call_text("lookup", arguments)))
    two = codec.action_ids(call_text("lookup", {"key": "a"}) + "\n" + call_text("send", {"key": "b"}))
    assert accepts(calls("lookup", "send", several=True), tok, end, two)
    assert not accepts(calls("lookup", "send"), tok, end, two)


def test_random_walks_end_in_what_the_server_parses(codec):
    tok, end = codec.tokenizer, codec.im_end_id
    done = {"object": 0, "schema": 0, "call": 0, "either": 0}
    either = OutputConstraint(
        schema=schema_text(PERSON),
        tools=(("lookup", schema_text(KEY)),),
        call_open=CALLS[0],
        call_close=CALLS[1],
        several_calls=True,
    )
    for seed in range(12):
        if (ids := walk(answer({"type": "object"}), tok, end, seed)) is not None:
            assert isinstance(json.loads(codec.decode_action(ids)), dict)
            done["object"] += 1
        if (ids := walk(answer(PERSON), tok, end, seed)) is not None:
            assert valid(json.loads(codec.decode_action(ids)), PERSON), codec.decode_action(ids)
            done["schema"] += 1
        if (ids := walk(calls("lookup", "send", several=True), tok, end, seed)) is not None:
            content, found = parse_calls(codec.decode_action(ids))
            assert found and content == "" and all(n in ("lookup", "send") and valid(a, KEY) for n, a in found)
            done["call"] += 1
        if (ids := walk(either, tok, end, seed)) is not None:
            text = codec.decode_action(ids)
            found = parse_calls(text)[1]
            assert (found and all(n == "lookup" for n, _ in found)) or valid(json.loads(text), PERSON), text
            done["either"] += 1
    assert min(done.values()) >= 3, done


@pytest.mark.parametrize("family", ["hermes", "llama"])
def test_a_call_is_written_in_the_templates_own_syntax(family):
    """A model's own template: the call comes out in the syntax its template writes (Hermes' tags, Llama 3's bare
    JSON with `parameters`), and its chat format reads it back as the environment's call."""
    tok = hermes_tokenizer() if family == "hermes" else llama_tokenizer()
    add_experience_tokens(tok)
    chat = TemplateChat(tok)
    syntax = chat.syntax
    constraint = calls("lookup", open_close=(syntax.open, syntax.close), key=syntax.arguments_key)
    assert accepts(constraint, tok, chat.im_end_id, chat.action_ids(call_text("lookup", {"key": "a"})))
    finished = 0
    for seed in range(12):
        ids = walk(constraint, tok, chat.im_end_id, seed)
        if ids is not None:
            found = parse_calls(chat.decode_action(ids))
            assert found is not None and [n for n, _ in found[1]] == ["lookup"] and valid(found[1][0][1], KEY)
            finished += 1
    assert finished >= 3


def naive_mask(c: Constrained, size: int) -> torch.Tensor:
    """The reference: a token is allowed when feeding it (by id, else its bytes) leads to a state."""
    allowed = torch.zeros(size, dtype=torch.bool)
    for t in range(size):
        if t == c.end_id:
            allowed[t] = c.done
        elif c.vocabulary.feed(c.grammar, c.state, t) is not None:
            allowed[t] = True
    return allowed


def test_the_mask_equals_the_naive_reference(codec):
    tok, end = codec.tokenizer, codec.im_end_id
    size = len(tok)
    either = OutputConstraint(
        schema=schema_text(PERSON), tools=(("lookup", None),), call_open=CALLS[0], call_close=CALLS[1]
    )
    for constraint in (answer({"type": "object"}), answer(PERSON), calls("lookup", "send", several=True), either):
        for seed in range(3):
            rng = random.Random(seed)
            c = Constrained(constraint, tok, end)
            for _ in range(60):
                mask = c.mask(size)
                assert torch.equal(mask, naive_mask(c, size)), (constraint, c.state)
                token = rng.choice(mask.nonzero().flatten().tolist())
                if token == end:
                    break
                c.advance(token)


def test_the_schema_subset_is_compiled_and_the_rest_named():
    compile_schema(PERSON)  # pydantic's shapes: $defs and $ref, anyOf with null, enum, annotations
    compile_schema({"type": ["string", "null"], "title": "T"})
    refused = {
        "schema.properties.age.minimum": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}},
        "schema.pattern": {"type": "string", "pattern": "a+"},
        "schema.allOf": {"allOf": [{"type": "string"}]},
        "schema.anyOf.1": {"anyOf": [{"type": "string"}, {"type": "string", "enum": ["a"]}]},  # both begin with "
        "schema.additionalProperties": {"type": "object", "additionalProperties": {"type": "string"}},
        "schema.required": {"type": "object", "properties": {}, "required": ["x"]},
        "$defs.Node.properties.next.$ref": {  # a recursive schema
            "type": "array",
            "items": {"$ref": "#/$defs/Node"},
            "$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}},
        },
        "schema.$ref": {"$ref": "https://example.com/schema.json"},  # only the root's $defs
        "schema.type": {"type": "date"},
    }
    for path, schema in refused.items():
        with pytest.raises(SchemaError) as error:
            compile_schema(schema)
        assert error.value.path == path and str(error.value).startswith(path + ": "), str(error.value)


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-like tokenizer: SentencePiece's `▁` for a space, `<0xNN>` byte pieces for what it lacks (here
    every non-ASCII character), a few merges."""
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁", *map(chr, range(0x21, 0x7F))]
    merges = [("▁", "a"), ('"', ":")]
    vocab = {p: i for i, p in enumerate(pieces + ["".join(m) for m in merges])}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bpe.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>")


def test_the_vocabulary_is_read_as_bytes_or_refused(tiny_tokenizer):
    text = 'Déjà {"k": "v"} 😀'
    byte_level = vocabulary(tiny_tokenizer)
    assert byte_level.cannot_write() is None
    assert b"".join(byte_level.bytes[i] for i in tiny_tokenizer.encode(text)) == text.encode()
    sp_tok = sentencepiece_tokenizer()
    sp = vocabulary(sp_tok)
    assert sp.kind == "sentencepiece" and sp.cannot_write() is None
    assert b"".join(sp.bytes[i] for i in sp_tok.encode(text)) == b" " + text.encode()  # its leading `▁` included
    word_piece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    word_piece.decoder = decoders.WordPiece()
    wp = PreTrainedTokenizerFast(tokenizer_object=word_piece, unk_token="[UNK]")
    assert "neither byte-level BPE nor SentencePiece" in vocabulary(wp).cannot_write()
    with pytest.raises(ApiError) as refused:
        check_writable(answer({"type": "object"}), wp)
    assert refused.value.status == 400 and refused.value.param == "response_format"
