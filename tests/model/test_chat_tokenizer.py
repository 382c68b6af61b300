"""Tokenizer and chat codec: ids built segment by segment equal the chat template's, digits split, and the
policy's tokens are exactly the masked ones."""

import pytest

from lopd_core.model.chat import EXP_END, EXP_START, IM_END, TOOL_CALL, ChatCodec, TrajectoryIds
from lopd_core.model.tokenizer import train_tokenizer

SYSTEM = "tools: bank_get_balance(account) bank_transfer(src,dst,amount)"
USER = "[aurora] Move 40 from a12 to a7."
ACTION = '<tool_call>{"name": "bank_transfer", "arguments": {"src": "a12", "dst": "a7", "amount": 40}}</tool_call>'
OBS = '{"result": {"id": "t3", "balance": 300}}'


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [SYSTEM, USER, ACTION, OBS, "done", "[borealis] What is the balance of a3?"] * 50
    return train_tokenizer(corpus, vocab_size=400)


def test_codec_ids_equal_chat_template(tokenizer):
    codec = ChatCodec(tokenizer)
    traj = codec.start(SYSTEM, USER, ["past success 1", "past success 2"])
    traj.add_action(codec.action_ids(ACTION))
    traj.add_forced(codec.observation_ids(OBS))
    traj.add_action(codec.action_ids("done"))
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER, "experiences": ["past success 1", "past success 2"]},
        {"role": "assistant", "content": ACTION},
        {"role": "tool", "content": OBS},
        {"role": "assistant", "content": "done"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.rstrip("\n") == tokenizer.decode(traj.token_ids)
    templ_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert templ_ids[: len(traj)] == traj.token_ids


def test_action_mask_selects_exactly_the_actions(tokenizer):
    codec = ChatCodec(tokenizer)
    traj = codec.start(SYSTEM, USER)
    traj.add_action(codec.action_ids(ACTION))
    traj.add_forced(codec.observation_ids(OBS))
    traj.add_action(codec.action_ids("done"))
    sampled = [t for t, m in zip(traj.token_ids, traj.action_mask) if m]
    assert tokenizer.decode(sampled) == ACTION + IM_END + "done" + IM_END


def test_special_tokens_single_and_copied_values_tokenize_alike(tokenizer):
    for tok in (TOOL_CALL, IM_END, EXP_START, EXP_END):
        assert len(tokenizer(tok, add_special_tokens=False)["input_ids"]) == 1

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    # A value the policy copies is the same ids in prose, in an observation and in a call's arguments.
    for value in ("a12", "340", "Rosa"):
        in_prose = ids(f"[aurora] Move {value} now.")
        in_json = ids(f'{{"src": "{value}"}}')
        value_ids = ids(value)
        assert any(in_prose[i : i + len(value_ids)] == value_ids for i in range(len(in_prose)))
        assert any(in_json[i : i + len(value_ids)] == value_ids for i in range(len(in_json)))
    pieces = tokenizer.convert_ids_to_tokens(ids("a340"))
    assert pieces[0] == "a" and "".join(pieces[1:]) == "340"
    # A frequent JSON key is one token with its quotes, colon, space and opening quote: the slot's name sits
    # right before the value to copy, and is the same token in a call and in an experience.
    assert len(ids('"name": "')) == 1
    assert (
        tokenizer.convert_ids_to_tokens(ids('{"name": "bank_wire"}'))[1]
        == tokenizer.convert_ids_to_tokens(ids('"name": "'))[0]
    )


def test_trajectory_ids_keep_lengths_aligned():
    traj = TrajectoryIds()
    traj.add_forced([1, 2, 3])
    traj.add_action([4, 5], [-0.1, -0.2])
    assert traj.action_mask == [0, 0, 0, 1, 1]
    assert traj.sample_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2]
    assert len(traj) == 5
