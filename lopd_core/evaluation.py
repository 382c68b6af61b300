"""`lopd evaluate`: success rate, mean reward, n and a 95% interval per environment, split and decoding mode.

Both decoding modes are always reported: for a small model, sampled success at temperature 1 mostly measures
how sharp the policy is (any sharper policy raises it), while greedy success measures what it knows. With
`eval.with_experience`, each split is also played with same-world oracle successes as text in the first user
turn (for codegen: same-family reference solutions; reported as `<split>+experience`): that measures whether
the policy can use experience in context, which the latent teacher depends on.

Plugin environments (lopd_core/envs/registry.py) are evaluated on the splits they have (no `pretrain_test`
unless they provide one: they have no pretraining worlds) and without `+experience` (it needs an oracle).

Output (DESIGN §5): {env: {split: {mode: {success_rate, reward_mean, n, ci95, reward_ci95}}}}; ci95 is the Wilson
score interval [low, high] of the success rate, reward_ci95 the normal interval of the mean reward. Beside it, one
row per played task (lopd_core/outcomes.py), which the promotion gate pairs task by task (lopd_core/gate.py).

Pairing: the tasks of a split come from one seeded stream (`params.seed + EVAL_SEED_OFFSET`; instance i depends
only on the env, the seed, the split and i) and the rollouts from one sampling seed (`params.seed`), whatever the
policy: two policies evaluated under the same params play the same tasks with the same seeds. `eval.batch` k plays
instances [k·n, (k+1)·n) of the same stream: fresh tasks, never a repeat. Batch 0 is the report's (`lopd evaluate`,
the cycle's report: the same tasks every cycle, so the lineage's bars compare on the same tasks); `lopd cycle`'s gate
plays batches >= 1, each cycle its own (flows/gate.py), so no decision reads tasks an earlier one read or the report
shows. `batch_tasks` says how many batches a split has.

Splits: test_final is evaluated and reported like any split, and read by no decision (lopd_core/envs/held_out.py);
val holds held-out training tasks for design choices. Neither is the gate's (lopd_core/settings/run.py refuses them).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from lopd_core.config import ConfigError, Params
from lopd_core.envs import Task, make_tasks, registry
from lopd_core.envs.toolworld.worlds import WorldSplit
from lopd_core.model.chat import make_chat
from lopd_core.model.codegen_demos import CodegenExperiencePool
from lopd_core.model.demos import ExperiencePool
from lopd_core.outcomes import outcome_rows
from lopd_core.rollout.engine import RolloutRequest, Sampling, Trajectory, rollout

EVAL_SEED_OFFSET = 1_000_003  # evaluation tasks come from their own seed stream, apart from training's


def wilson_interval(successes: int, n: int, z: float = 1.96) -> list[float]:
    if n == 0:
        return [0.0, 1.0]
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


def task_domains(task) -> tuple[str, ...]:
    """The tool domains a task exercises (a cross-domain task has several); codegen tasks are `codegen`."""
    from lopd_core.envs import TEMPLATES

    return TEMPLATES[task.template].domains if task.template in TEMPLATES else (task.env,)


def mean_interval(values: list[float], z: float = 1.96) -> list[float]:
    """The normal 95 % interval of a mean reward, mean ± z·s/√n (s the sample sd), clipped to the rewards' [0, 1];
    [0, 1] below two values. The report draws it on the reward bars (a success rate's is `wilson_interval`)."""
    n = len(values)
    if n < 2:
        return [0.0, 1.0]
    mean = sum(values) / n
    half = z * math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
    return [round(max(0.0, mean - half), 4), round(min(1.0, mean + half), 4)]


def summarize(trajectories: list[Trajectory]) -> dict:
    n = len(trajectories)
    wins = sum(t.success for t in trajectories)
    per_domain: dict[str, list[int]] = {}
    for t in trajectories:
        for domain in task_domains(t.task):
            counts = per_domain.setdefault(domain, [0, 0])
            counts[0] += int(t.success)
            counts[1] += 1
    return {
        "success_rate": round(wins / n, 4) if n else 0.0,
        "reward_mean": round(sum(t.reward for t in trajectories) / n, 4) if n else 0.0,
        "n": n,
        "ci95": wilson_interval(wins, n),
        "reward_ci95": mean_interval([t.reward for t in trajectories]),
        # a cross-domain task counts in each of its domains, so the domains' n add up to more than n
        "by_domain": {d: {"success_rate": round(w / k, 4), "n": k} for d, (w, k) in sorted(per_domain.items())},
    }


@dataclass(frozen=True)
class EvalShard:
    """One independent piece of an evaluation: an environment, a split (optionally with experience in context)
    and a decoding mode. Its requests and sampling seed depend on nothing else, so shards can run anywhere, in
    any order (flows/evaluate_sharded.py maps them as Prefect tasks) and assemble into the same results."""

    env: str
    split: str
    experience: bool
    mode: str

    @property
    def variant(self) -> str:
        return f"{self.split}+experience" if self.experience else self.split


def eval_shards(params: Params) -> list[EvalShard]:
    """Every shard of `params.eval`, in the order the results list them: a plugin env's only on the splits it
    has, and never with experience (no oracle successes to show)."""
    ev = params.eval
    registry.use_config(params.envs)
    return [
        EvalShard(env, split, experience, mode)
        for env in params.envs.mix
        for split in ev.splits
        if split in registry.env_splits(env)
        for experience in ((False, True) if ev.with_experience and registry.has_pretraining(env) else (False,))
        for mode in ev.modes
    ]


@lru_cache(maxsize=8)
def _experience_pool(env_name: str, seed: int, worlds_key: str):
    pool_class = CodegenExperiencePool if env_name == "codegen" else ExperiencePool
    worlds = json.loads(worlds_key)
    n = max(400, 40 * len(worlds))  # enough oracle successes per world that every template has a few
    return pool_class(make_tasks(env_name, "train", n, seed + 2 * EVAL_SEED_OFFSET, worlds))


def batch_tasks(params: Params, env: str, split: str) -> list[Task]:
    """The tasks of batch `eval.batch` of `env`'s `split`: instances [k·n, (k+1)·n) of its seeded stream.

    How many batches a split has: a built-in's streams are unbounded (instance i exists for every i: a batch never
    runs out); a task file's held-out split holds the file's tasks and never repeats (lopd_core/envs/task_files.py),
    so it has count // n full batches. Batch 0 (the report's) may be short, as it always was: n then counts the
    distinct tasks there are. A later batch (a gate's: flows/gate.py) must be full, else this raises a ConfigError
    naming the split and the fix: a batch that wrapped round to earlier tasks would replay tasks an earlier decision
    read, which is what fresh batches exist to prevent, and a warning in an unattended cycle is read by no one."""
    registry.use_config(params.envs)
    worlds = WorldSplit.from_config(params.envs).for_split(split)
    n, batch = params.eval.n_per_split, params.eval.batch
    tasks = make_tasks(env, split, (batch + 1) * n, params.seed + EVAL_SEED_OFFSET, worlds)
    if batch and len(tasks) < (batch + 1) * n:
        raise ConfigError(
            f"eval.batch {batch} needs tasks {batch * n}..{(batch + 1) * n - 1} of {env}'s {split!r} split, which "
            f"holds {len(tasks)}: at eval.n_per_split = {n} that is {max(len(tasks) // n - 1, 0)} gate batch(es) "
            "after the report's batch 0, and `lopd cycle` plays each cycle's gate on a batch no earlier cycle read. "
            f"Add held-out tasks to the environment's task file, lower eval.n_per_split (at most "
            f"{len(tasks) // (batch + 1)} fits this batch), or start a new lineage (another cycle.dir)"
        )
    return tasks[batch * n :]


def check_batch(params: Params) -> None:
    """Raise `batch_tasks`'s ConfigError now, before any work, where a plugin's split cannot fill `eval.batch`
    (the built-ins' streams never run out: not drawn here)."""
    registry.use_config(params.envs)
    for env in params.envs.mix:
        if registry.has_pretraining(env):
            continue
        for split in params.eval.splits:
            if split in registry.env_splits(env):
                batch_tasks(params, env, split)


def shard_requests(params: Params, shard: EvalShard) -> list[RolloutRequest]:
    registry.use_config(params.envs)
    worlds = WorldSplit.from_config(params.envs).for_split(shard.split)
    tasks = batch_tasks(params, shard.env, shard.split)
    if not shard.experience:
        return [RolloutRequest(t) for t in tasks]
    # `+experience` measures how well the policy reads its world's conventions from oracle successes in
    # context (an evaluation only: no training stage sees these).
    pool = _experience_pool(shard.env, params.seed, json.dumps(worlds))
    rng = random.Random(params.seed)  # a fresh rng per split
    return [RolloutRequest(t, experiences=tuple(pool.sample(t, params.eval.num_experiences, rng))) for t in tasks]


def eval_sampling(params: Params, mode: str) -> Sampling:
    """The evaluation's sampling in `mode`: greedy, or sampled at eval.temperature."""
    return Sampling.from_rollout(params.rollout, 0.0 if mode == "greedy" else params.eval.temperature)


def evaluate_shard(model, tokenizer, params: Params, shard: EvalShard, log=print) -> dict:
    """{success_rate, reward_mean, n, ci95, outcomes} of one shard; `outcomes`: its per-task rows, which
    `assemble` leaves out of the results and `shard_outcomes` gathers."""
    ro = params.rollout
    sampling = eval_sampling(params, shard.mode)
    trajs = rollout(
        model,
        make_chat(tokenizer),
        shard_requests(params, shard),
        sampling=sampling,
        batch_size=ro.batch_size,
        seed=params.seed,
    )
    summary = summarize(trajs)
    log(
        f"eval {shard.env}/{shard.variant}/{shard.mode}: success {summary['success_rate']:.3f} "
        f"{summary['ci95']} reward {summary['reward_mean']:.3f} (n={summary['n']})"
    )
    return {**summary, "outcomes": outcome_rows(shard.env, shard.variant, shard.mode, trajs, params.eval.batch)}


def assemble(shards: list[EvalShard], summaries: list[dict]) -> dict:
    """{env: {split: {mode: summary}}} from shards and their summaries (any order in, the shards' order out)."""
    results: dict = {}
    for shard, summary in zip(shards, summaries):
        cell = {k: v for k, v in summary.items() if k != "outcomes"}
        results.setdefault(shard.env, {}).setdefault(shard.variant, {})[shard.mode] = cell
    return results


def shard_outcomes(summaries: list[dict]) -> list[dict]:
    """The per-task rows of every shard, in the shards' order."""
    return [row for summary in summaries for row in summary.get("outcomes", [])]


def evaluate(model, tokenizer, params: Params, log=print) -> dict:
    """Every shard in this process, one after the other."""
    shards = eval_shards(params)
    return assemble(shards, [evaluate_shard(model, tokenizer, params, s, log=log) for s in shards])


def evaluate_stage(
    model, tokenizer, params: Params, log=print, *, shard_summaries: list[dict] | None = None
) -> tuple[dict, list[dict]]:
    """The evaluate stage's results, as eval.json holds them: every environment of the mix (`evaluate`) and a
    section per benchmark of `eval.benchmarks` (none by default); and the per-task rows of the environments
    (lopd_core/outcomes.py). The evaluate stage's driver (lopd_core/drivers/evaluate.py) calls this one function.
    `shard_summaries`: the summaries of `eval_shards(params)`, in that order, when they were rolled out elsewhere
    (`lopd evaluate --task-runner`); None: rolled out here. `model` may then be None when no benchmark is named."""
    from lopd_core.bench.suite import run_benchmarks

    shards = eval_shards(params)
    if shard_summaries is None:
        shard_summaries = [evaluate_shard(model, tokenizer, params, s, log=log) for s in shards]
    results = assemble(shards, shard_summaries)
    results.update(run_benchmarks(model, tokenizer, params, log=log))
    return results, shard_outcomes(shard_summaries)


def summary_table(results: dict) -> str:
    """eval.json as a compact text table: one line per environment, split and mode (success, its interval,
    reward, n), then one line per benchmark section with its top-level numbers. What `lopd evaluate` prints
    after its summary line; the file itself holds everything."""
    from lopd_core.export import eval_rows

    rows = eval_rows(results)
    lines = []
    if rows:
        width = max(len(f"{env} {split}") for env, split, _, _ in rows)
        lines.append(
            f"{'environment split':<{width}}  {'mode':<7}  {'success':>7}  {'ci95':<15}  {'reward':>6}  {'n':>5}"
        )
        for env, split, mode, cell in rows:
            low, high = (cell.get("ci95") or [math.nan, math.nan])[:2]
            lines.append(
                f"{env + ' ' + split:<{width}}  {mode:<7}  {cell['success_rate']:>7.3f}  "
                f"[{low:.3f}, {high:.3f}]  {cell.get('reward_mean', math.nan):>6.3f}  {cell.get('n', 0):>5}"
            )
    cells = {id(cell) for *_, cell in rows}
    for name, section in results.items():
        if isinstance(section, dict) and not any(id(c) in cells for c in _cells(section)):
            numbers = [
                f"{k} {v:.4g}" for k, v in section.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            ]
            lines.append(
                f"{name}: " + (", ".join(numbers) if numbers else f"{len(section)} entries") + " (see the file)"
            )
    return "\n".join(lines)


def _cells(section: dict) -> list:
    return [cell for modes in section.values() if isinstance(modes, dict) for cell in modes.values()]


def write_metrics(results: dict, path: str | Path) -> Path:
    """Write eval.json atomically; only a regular file or a missing path is written (lopd_core/outputs.py)."""
    from lopd_core.outputs import write_file

    write_file(path, json.dumps(results, indent=2, sort_keys=True))
    return Path(path)
