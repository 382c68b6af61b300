"""A model with its own chat template: its trajectories are its template's ids, the action mask covers exactly
its sampled tokens, its tool-call syntax reaches the environment as the environment's, and the latent teacher's
splice lands at the head of its first user turn. Two foreign tokenizers (tests/model/_foreign_tokenizers.py),
one Hermes/Qwen3-like and one Llama-3-like, against the embedded format that must stay as it was."""

import json

import pytest
import torch
from _foreign_tokenizers import hermes_tokenizer, llama_tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM

from lopd_core.config import ModelConfig
from lopd_core.distill.scoring.teacher import Framing, embed_row, splice_position
from lopd_core.distill.teacher.teacher_rollout import latent_rollout
from lopd_core.envs import format_call, make_env, make_tasks, parse_action
from lopd_core.model.chat import ChatCodec, experience_block, make_chat
from lopd_core.model.chat.template import TemplateChat, toolworld_schemas
from lopd_core.model.loading import add_experience_tokens, load_policy
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

SYSTEM = "tools: bank_get_balance(account) bank_transfer(src,dst,amount)"
USER = "[aurora] Move 40 from a12 to a7."
ARGS = {"src": "a12", "dst": "a7", "amount": 40}
OBS = '{"result": {"id": "t3", "balance": 300}}'
ANSWER = "Done. The transfer went through."
EXPERIENCES = ["Move 40 from a12 to a7: bank_transfer -> ok", "Balance of a3: bank_get_balance -> 300"]
BUILDERS = {"hermes": hermes_tokenizer, "llama": llama_tokenizer}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tokenizer(request):
    tok = BUILDERS[request.param]()
    add_experience_tokens(tok)
    return tok


def tiny_model(vocab_size: int, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    return Qwen3ForCausalLM(config).eval()


def template_ids(tok, messages, tools=None, generation=False) -> list[int]:
    return list(
        tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation, tokenize=True, return_dict=False
        )
    )


# ---- (a) the trajectory's ids are the template's -----------------------------------------------------------
@pytest.mark.parametrize("experiences", [None, EXPERIENCES], ids=["plain", "experiences"])
def test_trajectory_ids_equal_apply_chat_template(tokenizer, experiences):
    chat = make_chat(tokenizer)
    assert isinstance(chat, TemplateChat) and chat.tools_in_template
    traj = chat.start(SYSTEM, USER, experiences)
    traj.add_action(chat.action_ids(format_call("bank_transfer", ARGS)))
    traj.add_forced(chat.observation_ids(OBS))
    traj.add_action(chat.action_ids(ANSWER))
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": experience_block(experiences) + USER},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "bank_transfer", "arguments": ARGS}}],
        },
        {"role": "tool", "content": OBS},
        {"role": "assistant", "content": ANSWER},
    ]
    expected = template_ids(tokenizer, messages, tools=toolworld_schemas(SYSTEM))
    assert traj.token_ids == expected[: len(traj)]
    assert tokenizer.decode(expected[len(traj) :]).strip() == ""  # at most the template's trailing newline
    assert traj.token_ids[len(traj) - 1] == chat.im_end_id
    text = tokenizer.decode(traj.token_ids)
    assert '"description": "Transfer money' in text  # the tools went to the template, as full schemas
    sampled = [t for t, m in zip(traj.token_ids, traj.action_mask) if m]
    call = chat.action_ids(format_call("bank_transfer", ARGS))
    assert sampled == call + chat.action_ids(ANSWER)


def test_a_system_text_without_toolworld_tools_is_rendered_as_is(tokenizer):
    chat = make_chat(tokenizer)
    system = "Write the function the user asks for."
    traj = chat.start(system, USER)
    assert traj.token_ids == template_ids(
        tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": USER}], generation=True
    )
    assert toolworld_schemas("tools: bank_get_balance(account) no_such_tool(x)") is None


def test_an_environments_own_tool_schemas_reach_the_template(tokenizer):
    """A declarative environment's tools (not toolworld's) come with its first observation and are rendered by
    the template's own `tools=` handling, not looked up from the system text."""
    from lopd_core.envs import Task
    from lopd_core.envs.declarative import DeclarativeToolEnv

    def shelve(state: dict, title: str, shelf: int) -> dict:
        """Put a book on a shelf.

        Args:
            title: the book's title
            shelf: the shelf's number
        """
        state.setdefault("shelves", {})[title] = shelf
        return {"status": "shelved"}

    class ShelfEnv(DeclarativeToolEnv):
        name = "shelf"
        tools = (shelve,)

    task = Task(
        "shelf/train/0000",
        "shelf",
        "train",
        "shelf",
        "shelf",
        "Shelve Dune on shelf 3.",
        {"state": {}, "checks": []},
        3,
    )
    first = ShelfEnv().reset(task)
    assert [t["name"] for t in first.tools] == ["shelve"]
    chat = make_chat(tokenizer)
    expected = template_ids(
        tokenizer,
        [{"role": "system", "content": first.system}, {"role": "user", "content": first.user}],
        tools=[{"type": "function", "function": t} for t in first.tools],
        generation=True,
    )
    assert chat.start(first.system, first.user, tools=list(first.tools)).token_ids == expected
    assert chat.start(first.system, first.user).token_ids != expected  # the listing alone names no known tool


# ---- (b) the real rollout engine: the mask selects exactly the sampled tokens -------------------------------
def test_rollout_masks_exactly_the_sampled_tokens(tokenizer):
    chat = make_chat(tokenizer)
    model = tiny_model(len(tokenizer))
    opener = chat.encode(chat.syntax.open or "{")[0]
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():  # a biased head: the random policy ends some turns itself and opens calls often
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[chat.im_end_id], head.bias[opener] = 4.0, 5.0
    model.lm_head = head
    tasks = [t for t in make_tasks("toolworld", "test_id", 8, seed=3)][:4]
    sampling = Sampling(temperature=1.0, max_new_tokens=6, max_context=4096)
    trajs = rollout(model, chat, [RolloutRequest(t) for t in tasks], sampling=sampling, batch_size=4, seed=0)
    ended_by_policy = ended_by_engine = 0
    for task, traj in zip(tasks, trajs):
        first = make_env(task).reset(task)
        rebuilt = chat.start(first.system, first.user, tools=list(first.tools))
        assert traj.token_ids[: traj.prompt_length] == rebuilt.token_ids
        assert [t["function"] for t in toolworld_schemas(first.system)] == list(first.tools)
        assert traj.token_ids[: traj.prompt_length] == template_ids(
            tokenizer,
            [{"role": "system", "content": first.system}, {"role": "user", "content": first.user}],
            tools=[{"type": "function", "function": t} for t in first.tools],
            generation=True,
        )
        at = traj.prompt_length
        for turn, step in enumerate(traj.episode):
            run = []
            while at < len(traj.token_ids) and traj.action_mask[at]:
                run.append(traj.token_ids[at])
                at += 1
            assert run and chat.decode_action(run) == step["action"]
            rebuilt.add_action(run)
            if run[-1] == chat.im_end_id:
                ended_by_policy += 1
            else:
                ended_by_engine += 1
                rebuilt.add_forced([chat.im_end_id])
            if turn < len(traj.episode) - 1:
                rebuilt.add_forced(chat.observation_ids(step["observation"]))
            at = len(rebuilt)
        assert traj.token_ids == rebuilt.token_ids and traj.action_mask == rebuilt.action_mask
        for m, lp in zip(traj.action_mask, traj.sample_logprobs):
            assert (lp < 0) if m else (lp == 0.0)
    assert ended_by_policy and ended_by_engine
    assert max(len(t.episode) for t in trajs) > 1  # observations went through observation_ids


# ---- (c) the model's tool-call syntax reaches the environment as the environment's -------------------------
def test_tool_call_syntax_round_trips_into_the_env(tokenizer):
    chat = make_chat(tokenizer)
    canonical = format_call("bank_transfer", ARGS)
    assert chat.decode_action(chat.action_ids(canonical)) == canonical
    assert parse_action(chat.decode_action(chat.action_ids(canonical))) == ("call", "bank_transfer", ARGS)
    assert chat.decode_action(chat.action_ids(ANSWER)) == ANSWER
    own = chat.tokenizer.decode(chat.action_ids(canonical)[:-1])
    if chat.syntax.open:  # Hermes: the tags are the env's, the JSON inside is re-laid; a reasoning block goes
        assert own.startswith("<tool_call>\n") and own != canonical
        assert chat.decode_action(chat.encode("<think>\nplan\n</think>\n\n" + own)) == canonical
        malformed = '<tool_call>\n{"name": "bank_transfer", "arguments": {\n</tool_call>'
        unclosed = '<tool_call>\n{"name": "bank_transfer"'
        assert parse_action(chat.decode_action(chat.encode(unclosed)))[:2] == ("error", "unclosed tool_call")
    else:  # Llama: a bare JSON object with `parameters`
        assert json.loads(own) == {"name": "bank_transfer", "parameters": ARGS}
        malformed = '{"name": "bank_transfer", "parameters": {'
        assert parse_action(chat.decode_action(chat.encode('{"total": 40}'))) == ("answer", '{"total": 40}', None)
    assert parse_action(chat.decode_action(chat.encode(malformed)))[:2] == ("error", "malformed json")
    task = next(t for t in make_tasks("toolworld", "test_id", 40, seed=5) if "bank" in t.spec["domains"])
    env = make_env(task)
    env.reset(task)
    result = env.step(chat.decode_action(chat.action_ids(format_call("bank_list_accounts", {}))))
    assert '"result"' in result.observation and env.episode[0]["call"] == {
        "name": "bank_list_accounts",
        "arguments": {},
    }


# ---- (d) experience tokens, embeddings, and where the latent teacher splices --------------------------------
def test_experience_tokens_are_added_and_embeddings_mean_initialised():
    tok = llama_tokenizer()
    model = tiny_model(len(tok))
    before_in = model.get_input_embeddings().weight.detach().clone()
    before_out = model.get_output_embeddings().weight.detach().clone()
    new_ids = add_experience_tokens(tok, model)
    assert new_ids == [len(tok) - 2, len(tok) - 1]
    assert tok.convert_ids_to_tokens(new_ids) == ["<|exp_start|>", "<|exp_end|>"]
    assert all(len(tok.encode(t, add_special_tokens=False)) == 1 for t in ("<|exp_start|>", "<|exp_end|>"))
    for now, before in (
        (model.get_input_embeddings().weight, before_in),
        (model.get_output_embeddings().weight, before_out),
    ):
        assert now.shape[0] == len(tok)
        torch.testing.assert_close(now[: before.shape[0]], before)  # old rows untouched
        torch.testing.assert_close(now[new_ids], before.mean(0).expand(2, -1))
    assert model.config.vocab_size == len(tok)
    assert add_experience_tokens(tok, model) == []  # idempotent
    # A checkpoint with spare rows past its vocabulary (as Qwen's have) keeps its size: the spare rows serve.
    tok2 = hermes_tokenizer()
    roomy = tiny_model(len(tok2) + 8)
    add_experience_tokens(tok2, roomy)
    assert roomy.get_input_embeddings().weight.shape[0] == len(tok2) + 6


def test_teacher_splice_lands_at_the_head_of_the_first_user_turn(tokenizer):
    chat = make_chat(tokenizer)
    framing = Framing.from_tokenizer(tokenizer)
    assert framing.user_header == tuple(chat.user_header) and framing.im_start is None
    experience = EXPERIENCES[0]
    plain = chat.start(SYSTEM, USER)
    plain.add_action(chat.action_ids(format_call("bank_transfer", ARGS)))
    plain.add_forced(chat.observation_ids(OBS))
    with_text = chat.start(SYSTEM, USER, [experience]).token_ids
    at = splice_position(plain.token_ids, framing)
    assert tokenizer.decode(plain.token_ids[at:]).startswith(USER)
    inner = chat.encode(experience)
    assert with_text == (
        plain.token_ids[:at]
        + [framing.exp_start]
        + inner
        + [framing.exp_end, framing.newline]
        + plain.token_ids[at : len(with_text) - len(inner) - 3]
    )
    # Latents that are the experience text's own embeddings give the teacher the text conversation's inputs.
    embed = torch.nn.Embedding(len(tokenizer), 4)
    spliced, shift = embed_row(embed, plain.token_ids, embed(torch.tensor(inner)), framing)
    full = with_text + plain.token_ids[len(with_text) - len(inner) - 3 :]
    torch.testing.assert_close(spliced, embed(torch.tensor(full)))
    assert shift == len(inner) + 3


def test_latent_teacher_with_the_text_as_latents_plays_as_the_text(tokenizer):
    """End to end through `latent_rollout`: latents that are an experience text's own embeddings make the same
    greedy moves as the text in the first user turn (a model with large random weights reads every token)."""
    chat = make_chat(tokenizer)
    model = tiny_model(len(tokenizer), seed=1)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    tasks = make_tasks("toolworld", "test_id", 4, seed=10)
    greedy = Sampling(temperature=0.0, max_new_tokens=16, max_context=4096)
    experience = EXPERIENCES[0]
    latents = [model.get_input_embeddings()(torch.tensor(chat.encode(experience))).detach() for _ in tasks]
    by_text = rollout(model, chat, [RolloutRequest(t, experiences=(experience,)) for t in tasks], sampling=greedy)
    by_latents = latent_rollout(model, tokenizer, [RolloutRequest(t) for t in tasks], latents, sampling=greedy)
    plain = rollout(model, chat, [RolloutRequest(t) for t in tasks], sampling=greedy)

    def actions(traj):
        return [t for t, m in zip(traj.token_ids, traj.action_mask) if m]

    assert [actions(t) for t in by_latents] == [actions(t) for t in by_text]
    assert [actions(t) for t in plain] != [actions(t) for t in by_text]  # the experience changes the play
    assert [t.token_ids[: t.prompt_length] for t in by_latents] == [t.token_ids[: t.prompt_length] for t in plain]


def test_load_policy_gives_a_foreign_model_its_experience_tokens(tmp_path):
    tok = hermes_tokenizer()
    tiny_model(len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, loaded = load_policy(ModelConfig(name_or_path=str(tmp_path), device="cpu"))
    assert "<|exp_start|>" in loaded.get_vocab() and model.get_input_embeddings().weight.shape[0] == len(loaded)
    assert isinstance(make_chat(loaded), TemplateChat)


def test_embedded_tokenizer_keeps_the_embedded_format(tiny_tokenizer, tmp_path):
    assert isinstance(make_chat(tiny_tokenizer), ChatCodec)
    framing = Framing.from_tokenizer(tiny_tokenizer)
    assert framing.user_header == () and framing.im_start is not None
    tiny_tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    assert isinstance(make_chat(AutoTokenizer.from_pretrained(tmp_path)), ChatCodec)  # survives a save
