"""The teacher in play: what the frozen base plays on held-out tasks alone, reading its bank rows as text, and
reading them as the composer's latents — the ceiling the cycle's distillation trains toward.

A distilled student ends near its teacher (DESIGN §3), so every evaluation of a cycle should say how high that
teacher stands. The tasks and sampling seeds are the evaluation's own (`lopd_core/evaluation.py`, the split
without experience), so `base` here equals the evaluated base's own figure on that split; each task reads its J
nearest same-world bank rows as in training, but never its own (the held-out tasks have none in the bank anyway).

Output, per environment and split, beside the decoding modes in eval.json:
    {env: {split: {"teacher_in_play": {"base" | "text" | "latents": {mode: summary}}}}}
"""

from __future__ import annotations

from collections.abc import Callable

from lopd_core.config import Params
from lopd_core.distill.composer.composer import Composer
from lopd_core.distill.composer.encoder_lora import lora_fingerprint
from lopd_core.distill.composer.lru import LRUCache
from lopd_core.distill.teacher.teacher_rollout import latent_rollout, task_latents
from lopd_core.envs import Task
from lopd_core.evaluation import eval_sampling, eval_shards, shard_requests, summarize
from lopd_core.model.chat import make_chat
from lopd_core.rollout.engine import RolloutRequest, rollout

TEACHER_IN_PLAY = "teacher_in_play"
CONDITIONS = ("base", "text", "latents")


def teacher_in_play(
    model,
    tokenizer,
    params: Params,
    composer: Composer,
    retrieve: Callable[[list[Task]], list[list[str]]],
    *,
    splits: list[str],
    log=print,
) -> dict:
    """{env: {split: {TEACHER_IN_PLAY: {condition: {mode: summary}}}}} on `splits` of eval.splits, every mode of
    eval.modes, with `model` as the frozen base and `composer` writing its latents."""
    results: dict = {}
    shards = [s for s in eval_shards(params) if not s.experience and s.split in splits]
    # one split's requests and latents, played in every mode: eval_shards lists a split's modes one after another,
    # so one entry serves them all and the last split's latents are let go (a whole split's: the largest cache)
    cache: LRUCache[tuple[str, str, str], tuple] = LRUCache(capacity=1)
    for shard in shards:
        key = (shard.env, shard.split, lora_fingerprint(composer.encoder_lora))
        if key not in cache:
            plain = shard_requests(params, shard)
            texts = retrieve([r.task for r in plain])
            latents = task_latents(
                model,
                tokenizer,
                composer,
                texts,
                max_tokens=params.composer.max_experience_tokens,
                queries=[r.task.instruction for r in plain],
            )
            with_text = [RolloutRequest(r.task, experiences=tuple(x)) for r, x in zip(plain, texts)]
            cache.put(key, (plain, with_text, latents))
        plain, with_text, latents = cache.get(key)
        sampling = eval_sampling(params, shard.mode)
        ro, seed = params.rollout, params.seed
        played = {
            "base": rollout(model, make_chat(tokenizer), plain, sampling=sampling, batch_size=ro.batch_size, seed=seed),
            "text": rollout(
                model, make_chat(tokenizer), with_text, sampling=sampling, batch_size=ro.batch_size, seed=seed
            ),
            "latents": latent_rollout(
                model, tokenizer, plain, latents, sampling=sampling, batch_size=ro.batch_size, seed=seed
            ),
        }
        cell = results.setdefault(shard.env, {}).setdefault(shard.split, {}).setdefault(TEACHER_IN_PLAY, {})
        for condition, trajs in played.items():
            cell.setdefault(condition, {})[shard.mode] = summary = summarize(trajs)
            log(
                f"teacher in play {shard.env}/{shard.split}/{shard.mode} {condition}: success "
                f"{summary['success_rate']:.3f} {summary['ci95']} (n={summary['n']})"
            )
    return results


def merge_teacher(results: dict, teacher: dict) -> dict:
    """eval.json's results with the teacher in play placed under each environment and split it was played on."""
    merged = {env: dict(splits) if isinstance(splits, dict) else splits for env, splits in results.items()}
    for env, splits in teacher.items():
        for split, section in splits.items():
            target = merged.setdefault(env, {})
            target[split] = {**target.get(split, {}), **section}
    return merged


def teacher_lines(results: dict, modes: list[str]) -> list[str]:
    """One line per environment, split and mode: base -> text / latents success with intervals."""

    def pct(cell: dict) -> str:
        low, high = cell["ci95"]
        return f"{100 * cell['success_rate']:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"

    lines = []
    for env, splits in results.items():
        for split, section in (splits or {}).items() if isinstance(splits, dict) else ():
            play = section.get(TEACHER_IN_PLAY) if isinstance(section, dict) else None
            for mode in modes if play else ():
                cells = {c: play.get(c, {}).get(mode) for c in CONDITIONS}
                if all(cells.values()):
                    lines.append(
                        f"{env} {split} {mode}: base {pct(cells['base'])}, text {pct(cells['text'])}, "
                        f"latents {pct(cells['latents'])} (n = {cells['base']['n']})"
                    )
    return lines
