"""Does the base know each world's conventions, and does experience in context help? Teacher-forced, clean oracle.

    python probes/convention_probe.py --model data/base [--tasks 300] [--split test_id] [--composer phi0.pt]

Two measurements on the same held-out tasks (their own world's conventions, no slips):

* **conventions** — at every convention decision (the first action token where the task's oracle and the oracle
  under another world's conventions part ways: which payment tool, `/notes` or `notes`, `OSL` or `oslo`, an extra
  confirmation step), the probability the base puts on its own world's choice (`p_right`) and on the other
  world's (`p_other`), per world. A base that reads the `[world]` tag would approach the warm start's ≈ 0.8 /
  0.2 (convention noise 0.3; ≈ 0.9 / 0.1 at the default 0.15); one that ignores it splits its mass between
  the two. Measured again with three same-world successes in context (`conventions_with_experience`): they
  show the right choice, so a base that uses experience in context moves p_right up there — the information a
  latent teacher is meant to carry.
* **log-likelihood** — the oracle's action tokens' total log-probability per task (nats; higher is better, and
  comparable across tokenizers since it is the probability of the same text), `p_seq` its mean exp (the chance
  that sampling at temperature 1 reproduces the oracle exactly) and `exact` the share of tasks whose every
  action token is the argmax; without and with three same-world successes in context (the evaluation's pool).
* **tag swap** — at the same decisions, p(own choice) − p(other world's choice) with the task's `[world]` tag
  and with the other world's tag put in its place: whether the base reads the tag at all (the margin flips
  sign) or only weakly (it flips but stays small).

These are the smooth numbers the warm-start recipe was tuned on: greedy success over 200 tasks moves by a few
tasks between equally good bases, while the log-likelihood over 300 separates recipes (seed-to-seed spread of a
build ≈ 0.6 nats). Prints JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import random

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.config import load_params
from lopd_core.distill.composer.composer import ExperienceEncoder, compose_latents
from lopd_core.distill.loop.build import load_composer
from lopd_core.distill.scoring.models import TeacherView
from lopd_core.distill.scoring.teacher import Framing, embed_row, splice_position
from lopd_core.envs import WORLDS, make_tasks
from lopd_core.envs.toolworld.worlds import WorldSplit
from lopd_core.evaluation import EVAL_SEED_OFFSET
from lopd_core.model.chat import ChatCodec
from lopd_core.model.demos import Demo, ExperiencePool, encode_demo, play


def _logprobs(model, seq, latent=None) -> torch.Tensor:
    """(T-1, V) next-token log-probs of the sequence's ids. With `latent` = (latents (J·K, D), framing), the
    latents are spliced into the first user turn as the latent teacher reads them; rows stay aligned with the
    ids (row i predicts id i+1)."""
    with torch.no_grad():
        if latent is None:
            return torch.log_softmax(model(torch.tensor([seq.token_ids])).logits[0, :-1].float(), -1)
        latents, framing = latent
        emb, shift = embed_row(model.get_input_embeddings(), seq.token_ids, latents, framing)
        logits = model(inputs_embeds=emb[None]).logits[0].float()  # (T + shift, V)
        at = splice_position(seq.token_ids, framing)
        rows = list(range(at - 1)) + list(range(at - 1 + shift, logits.shape[0] - 1))  # skip the latent slot
        return torch.log_softmax(logits[rows], -1)


class LatentReader:
    """The latent teacher's view of a task: its experiences composed into J·K latents by a composer (φ0)."""

    def __init__(self, model, tokenizer, composer_path: str, params_file: str):
        params = load_params(params_file)
        self.framing = Framing.from_tokenizer(tokenizer)
        self.composer = load_composer(composer_path, model, params.composer).eval()
        self.encoder = ExperienceEncoder(
            TeacherView(model), tokenizer, max_tokens=params.composer.max_experience_tokens
        )

    def __call__(self, experiences: tuple[str, ...]):
        with torch.no_grad():
            return compose_latents(self.composer, self.encoder, [list(experiences)])[0], self.framing


def _with_experiences(demo: Demo, experiences: tuple[str, ...]) -> Demo:
    return Demo(demo.system, demo.user, experiences, demo.actions, demo.observations, demo.world_followed)


def decisions(task, seq, codec, experiences: tuple[str, ...] = ()):
    """(world, position, the other world's ids) for every other world whose oracle first parts ways with `seq`
    at an action token: a convention decision. Both continuations read the same `experiences` as text."""
    for world in WORLDS:
        if world == task.world:
            continue
        other = encode_demo(_with_experiences(play(task, conventions_world=world)[0], experiences), codec)
        j = next((j for j in range(min(len(seq), len(other))) if seq.token_ids[j] != other.token_ids[j]), None)
        if j is not None and seq.action_mask[j]:  # else the worlds agree (or part ways only in an observation)
            yield world, j, other.token_ids


def convention_choices(
    model,
    codec,
    tasks,
    pool: ExperiencePool | None = None,
    rng: random.Random | None = None,
    reader: LatentReader | None = None,
) -> dict:
    """p_right / p_other per world; with `pool`, both continuations read the same three same-world successes
    (same template first), which show the task's own conventions — as text, or with `reader` as latents."""
    stats: dict = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for task in tasks:
        demo, _, _ = play(task)
        experiences = tuple(pool.sample(task, 3, rng)) if pool is not None else ()
        as_text = () if reader is not None else experiences
        seq = encode_demo(_with_experiences(demo, as_text), codec)
        lp = _logprobs(model, seq, reader(experiences) if reader is not None else None)
        for _, j, other in decisions(task, seq, codec, as_text):
            row = stats[task.world]
            row[0] += math.exp(lp[j - 1, seq.token_ids[j]])
            row[1] += math.exp(lp[j - 1, other[j]])
            row[2] += 1
    return {
        w: {"p_right": round(r / n, 3), "p_other": round(o / n, 3), "decisions": n}
        for w, (r, o, n) in sorted(stats.items())
    }


def _choice_margin(model, prefix: list[int], own: int, other: int) -> float:
    """p(own) − p(other) for the token after `prefix`."""
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([prefix])).logits[0, -1].float(), -1)
    return float(p[own] - p[other])


def tag_swap(model, codec, tasks) -> dict:
    """Does the base read the `[world]` tag at all? At each convention decision, p(own choice) − p(other
    world's choice) with the task's own tag, and again with the tag swapped to the other world's (same ids
    otherwise). A base that ignores the tag gives the same margin both ways; one that reads it fully flips it."""
    real, swapped, n = 0.0, 0.0, 0
    for task in tasks:
        demo, _, _ = play(task)
        seq = encode_demo(demo, codec)
        for world, j, other in decisions(task, seq, codec):
            retagged = encode_demo(
                Demo(
                    demo.system,
                    demo.user.replace(f"[{task.world}]", f"[{world}]"),
                    (),
                    demo.actions,
                    demo.observations,
                    world,
                ),
                codec,
            )
            k = j + len(retagged) - len(seq)  # the same decision in the retagged ids
            real += _choice_margin(model, seq.token_ids[:j], seq.token_ids[j], other[j])
            swapped += _choice_margin(model, retagged.token_ids[:k], seq.token_ids[j], other[j])
            n += 1
    return {
        "margin_own_tag": round(real / max(n, 1), 3),
        "margin_other_tag": round(swapped / max(n, 1), 3),
        "decisions": n,
    }


def oracle_likelihood(
    model, codec, tasks, pool: ExperiencePool | None, rng: random.Random, reader: LatentReader | None = None
) -> dict:
    ll_sum = p_sum = exact = 0.0
    for task in tasks:
        demo, _, _ = play(task)
        latent = None
        if pool is not None:
            experiences = tuple(pool.sample(task, 3, rng))
            if reader is not None:
                latent = reader(experiences)
            else:
                demo = _with_experiences(demo, experiences)
        seq = encode_demo(demo, codec)
        lp = _logprobs(model, seq, latent)
        target = torch.tensor(seq.token_ids[1:])
        mask = torch.tensor(seq.action_mask[1:], dtype=torch.bool)
        ll = float(lp.gather(-1, target[:, None]).squeeze(-1)[mask].sum())
        ll_sum += ll
        p_sum += math.exp(ll)
        exact += bool((lp.argmax(-1) == target)[mask].all())
    n = len(tasks)
    return {"loglik": round(ll_sum / n, 3), "p_seq": round(p_sum / n, 4), "exact": round(exact / n, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="data/base")
    ap.add_argument("--tasks", type=int, default=300)
    ap.add_argument("--split", default="test_id")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--composer",
        default="",
        help="a cold-start composer (phi0.pt): also measure the base reading the experiences as its latents",
    )
    ap.add_argument("--params", default="params.yaml", help="the run's worlds, and the composer's shape")
    args = ap.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    codec = ChatCodec(tokenizer)
    # the run's worlds: test_id / test_ood in the deployment worlds, pretrain_test in the pretraining worlds
    worlds = WorldSplit.from_config(load_params(args.params).envs).for_split(args.split)
    tasks = make_tasks("toolworld", args.split, args.tasks, args.seed + EVAL_SEED_OFFSET, worlds)
    pool = ExperiencePool(
        make_tasks("toolworld", "train", max(400, 40 * len(worlds)), args.seed + 2 * EVAL_SEED_OFFSET, worlds)
    )
    out = {
        "model": args.model,
        "split": args.split,
        "tasks": len(tasks),
        "conventions": convention_choices(model, codec, tasks),
        "conventions_with_experience": convention_choices(model, codec, tasks, pool, random.Random(args.seed)),
        "tag_swap": tag_swap(model, codec, tasks),
        "oracle_actions": {
            "without_experience": oracle_likelihood(model, codec, tasks, None, random.Random(args.seed)),
            "with_experience": oracle_likelihood(model, codec, tasks, pool, random.Random(args.seed)),
        },
    }
    if args.composer:  # the same experiences (same rng stream), read as the composer's latents
        reader = LatentReader(model, tokenizer, args.composer, args.params)
        out["composer"] = args.composer
        out["conventions_with_latents"] = convention_choices(
            model, codec, tasks, pool, random.Random(args.seed), reader
        )
        out["oracle_actions"]["with_latents"] = oracle_likelihood(
            model, codec, tasks, pool, random.Random(args.seed), reader
        )
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
