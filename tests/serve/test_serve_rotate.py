"""`lopd serve store rotate` (issue #47 item 3): the running server moves its store's segments into an archive while
conversations go on. Sessions mid-conversation, a rotation through the command, then the conversations continue:
the archive and the live store each read back with no orphan turn, every answered turn and label kept, and a
session's trajectory in the live store carries its archived history token for token."""

from __future__ import annotations

import warnings

import httpx

from lopd_core.traces import read_traces
from tests.serve.conftest import make_server
from tests.serve.test_resume import ask, label


def test_sessions_mid_conversation_rotate_and_go_on_with_nothing_lost(tiny_checkpoints, tmp_path, capsys):
    from lopd_cli.main import main

    store = tmp_path / "traces"
    talks = {s: [{"role": "user", "content": f"[cobalt] hello from {s}"}] for s in ("a", "b", "c", "e", "f")}
    first: dict[str, dict] = {}
    with make_server(tiny_checkpoints[0], store) as live:
        for s, talk in talks.items():  # two turns each
            for _ in range(2):
                first[s] = answer = ask(live, s, talk)
                talk += [answer["choices"][0]["message"], {"role": "user", "content": "go on"}]
        assert label(live, "a").status_code == 200  # judged before the rotation: stays with its turns

        assert main(["serve", "store", "rotate", str(store), "--url", live.root]) == 0
        printed = capsys.readouterr().out
        assert "archive" in printed and "4 open sessions" in printed  # b, c, e and f; a was judged
        assert httpx.get(live.root + "/health").json()["store"]["bytes"] == 0  # the bound's room back at once

        after = {s: ask(live, s, talks[s]) for s in ("b", "c", "e")}  # the conversations go on
        fresh = ask(live, "d", [{"role": "user", "content": "a new one"}])
        assert label(live, "b").json()["turns"] == 3
        # a label naming the archived trajectory lands on the one that carries it on
        old_c = first["c"]["lopd"]["trajectory_id"]
        relabel = label(live, "c", trajectory_id=old_c, reward=0.5, success=False).json()
        assert relabel == {"ok": True, "trajectory_id": after["c"]["lopd"]["trajectory_id"], "turns": 3}
        # a label for a conversation that ended before the rotation: carried on whole into the live store first
        late = label(live, "f").json()
        assert late["trajectory_id"] != first["f"]["lopd"]["trajectory_id"] and late["turns"] == 2

    with make_server(tiny_checkpoints[0], store) as again:  # a restart goes on in the trajectory that carries e
        talks["e"] += [after["e"]["choices"][0]["message"], {"role": "user", "content": "and after a restart"}]
        assert ask(again, "e", talks["e"])["lopd"]["trajectory_id"] == after["e"]["lopd"]["trajectory_id"]

    archives = list((store / "archive").iterdir())
    assert len(archives) == 1 and printed.strip().endswith("history") and str(archives[0]) in printed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torn line, no label without its turns
        archived = read_traces(archives[0]).set_index("trajectory_id")
        kept = read_traces(store).set_index("trajectory_id")
    assert sorted(archived["session"]) == ["a", "b", "c", "e", "f"] and (archived["num_turns"] == 2).all()
    assert archived["labeled"].tolist() == [s == "a" for s in archived["session"]]
    assert (
        sorted(kept["session"]) == ["b", "c", "d", "e", "f"]
        and kept.loc[fresh["lopd"]["trajectory_id"], "origin"] == "new"
    )
    assert kept.loc[after["e"]["lopd"]["trajectory_id"], "num_turns"] == 4
    for s in ("b", "c"):
        row, parent = kept.loc[after[s]["lopd"]["trajectory_id"]], first[s]["lopd"]["trajectory_id"]
        assert row["origin"] == "rotated" and row["parent"] == parent and row["num_turns"] == 3 and row["labeled"]
        # the history whole, sampled ids still actions with their log-probs, then the new turn
        old = archived.loc[parent]
        assert list(row["token_ids"][: len(old["token_ids"])]) == list(old["token_ids"])
        assert list(row["action_mask"][: len(old["action_mask"])]) == list(old["action_mask"])
        assert row["prompt_length"] == old["prompt_length"] and row["started"] == old["started"]
        # what the model read and sampled in the turn after the rotation (then, cut at max_tokens, a closing token)
        served = after[s]["prompt_token_ids"] + after[s]["choices"][0]["token_ids"]
        assert list(row["token_ids"][: len(served)]) == served and len(row["token_ids"]) - len(served) <= 1
    assert kept.loc[after["c"]["lopd"]["trajectory_id"], "reward"] == 0.5
    carrier, parent = kept.loc[late["trajectory_id"]], archived.loc[first["f"]["lopd"]["trajectory_id"]]
    assert carrier["origin"] == "rotated" and carrier["num_turns"] == 2 and carrier["success"]
    assert list(carrier["token_ids"]) == list(parent["token_ids"]) and carrier["messages"] == parent["messages"]


def test_rotate_without_a_server_is_one_line(tmp_path, capsys):
    from lopd_cli.main import main
    from tests._servers import free_port

    assert main(["serve", "store", "rotate", "--url", f"http://127.0.0.1:{free_port()}"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no server answers" in err and "lopd serve" in err
