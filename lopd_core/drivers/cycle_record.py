"""What `lopd cycle` keeps of a cycle, assembled from what its stages returned: the champion a cycle starts from,
the lineage its exported student carries, the record history.json holds, the metrics of its parent run.

Why here and not in flows/cycle.py: the flow only orchestrates (which stage runs, in which MLflow run); what a
record holds is a function of the stages' summaries, the same whoever ran the stages, and testable without
Prefect or MLflow. Nothing here runs a stage: it reads only the files the summaries name (the distill CSV, the
bank's parquet) and writes only the student's eval.json merged with the teacher in play.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from lopd_core.config import Params
from lopd_core.distill.teacher.teacher_play import merge_teacher
from lopd_core.gate import Comparison, GateDecision, GuardResult
from lopd_core.jsonio import read_json, write_json
from lopd_core.methods import resolve_method
from lopd_core.settings.checks import CYCLE_REPLAY_SHARE, REPLAY_AUTO


@dataclass
class Champion:
    """What a cycle starts from. The base is generation 0 and has neither bank nor composer."""

    model: str
    bank: dict | None = None  # the bank summary of the cycle that produced it (bank_dir, index_dir, dvc_md5)
    composer: str | None = None  # φ trained with it; None: cold start needed
    eval: str | None = None  # its eval.json
    generation: int = 0
    cycle: int = 0  # the cycle that promoted it
    version: str | None = None  # its lopd-student version in the registry
    gate: dict | None = None  # the gate's decision that promoted it (gate_record)


@dataclass(frozen=True)
class CycleRun:
    """What is known of a cycle's run itself, not of its stages."""

    number: int
    commit: str  # the code it ran (git)
    parent_run: str | None  # its MLflow parent run; None when untracked
    base_hash: str  # the content of the first base's weights, shortened


@dataclass
class CycleStages:
    """The summaries the cycle's stage flows returned (flows/stage_flows.py), in the order they ran."""

    bank: dict
    coldstart: dict | None  # None: the champion carried its composer on
    fit: dict
    teacher: dict
    distill: dict
    champion_eval: dict
    student_eval: dict
    base_eval: dict  # the champion's own when the champion is the base
    gate_looks: list[dict] = field(default_factory=list)  # the evaluations of the gate's looks (fresh batches)

    def cached(self) -> dict[str, bool]:
        """Which stages reused a cached result (a cycle run again with nothing changed reuses them all)."""
        named = (
            ("bank", self.bank),
            ("coldstart", self.coldstart),
            ("fit", self.fit),
            ("teacher", self.teacher),
            ("distill", self.distill),
            ("champion_eval", self.champion_eval),
            ("student_eval", self.student_eval),
            *((f"gate_eval_{i + 1}", e) for i, e in enumerate(self.gate_looks)),
        )
        return {k: v["cached"] for k, v in named if v is not None}


def teacher_for(params: Params, champion: Champion, base: str) -> str | None:
    """The teacher's weights for this cycle's distillation: None (the champion the student starts from, one
    weight copy in LoRA mode) unless `cycle.refresh_teacher` is false and the champion is no longer the base."""
    return None if params.cycle.refresh_teacher or champion.model == base else base


def cycle_replay(params: Params) -> Params:
    """`params` with lopd.replay_share `auto` resolved for a cycle: CYCLE_REPLAY_SHARE where the cycle's steps roll
    out toolworld tasks and hold at least two (one replay task and one fresh one), else 0 (a step of served traces
    rolls out none; a world without pretraining worlds has nothing to replay). Why a cycle replays by default and
    a single run does not: a cycle's student becomes the next champion and is served in every world it knew, so
    what it forgets accumulates (measured: docs/results.md); a single run or a comparison asks about one world."""
    cfg = params.lopd
    if cfg.replay_share != REPLAY_AUTO:
        return params
    rolls_out_toolworld = "toolworld" in params.envs.mix and cfg.trajectories == "rollouts"
    share = CYCLE_REPLAY_SHARE if rolls_out_toolworld and cfg.tasks_per_step >= 2 else 0.0
    return replace(params, lopd=replace(cfg, replay_share=share))


def with_earlier_worlds(params: Params, history: list[dict]) -> Params:
    """`params` for a cycle's distillation: lopd.replay_share's `auto` resolved (cycle_replay), and
    lopd.replay_worlds extended by every toolworld world an earlier cycle deployed to (its record's
    `deploy_worlds`) and this one does not, so that replay (lopd_core/distill/update/replay.py) keeps them. Without
    replay, or without toolworld in the mix, the worlds are left as they are."""
    params = cycle_replay(params)
    cfg = params.lopd
    if cfg.replay_share == 0 or "toolworld" not in params.envs.mix:
        return params
    earlier = [w for r in history for w in r.get("deploy_worlds", []) if w not in params.envs.deploy_worlds]
    worlds = list(dict.fromkeys([*cfg.replay_worlds, *earlier]))
    return params if worlds == cfg.replay_worlds else replace(params, lopd=replace(cfg, replay_worlds=worlds))


# Far from the seeds a user or `lopd compare` picks (0, 1, 1000·t), so a retry never replays one of their runs.
RETRY_SEED_STRIDE = 7919


def retries_of_champion(history: list[dict]) -> int:
    """How many cycles in a row, at the end of `history`, left the champion in place (0 after a promotion or
    on the first cycle)."""
    retries = 0
    for record in reversed(history):
        if record.get("promoted"):
            break
        retries += 1
    return retries


def with_retry_seed(params: Params, history: list[dict]) -> Params:
    """`params` for the distillation of a cycle that starts again from the champion an earlier cycle did not
    replace: `seed` moved by RETRY_SEED_STRIDE per retry, so the student trains on a fresh task stream and fresh
    samples. Why: every input of that cycle is otherwise the one before's (the same champion, bank and φ), so
    its distillation, evaluation and gate were the earlier cycle's cached stages, replayed: a cycle that could
    not promote could never try again. The bank, φ's fit and the evaluations keep the run's seed: the gate's
    tasks and the guards' baselines stay comparable across retries."""
    retries = retries_of_champion(history)
    return params if retries == 0 else replace(params, seed=params.seed + RETRY_SEED_STRIDE * retries)


def gate_score(params: Params, results: dict | None) -> float:
    """The gate's point estimate from an eval.json: `gate_metric` under `gate_mode`, averaged over envs and
    `gate_splits` (the base's figure on the parent run; the decision itself reads per-task outcomes)."""
    g = params.cycle
    values = [
        splits[s][g.gate_mode][g.gate_metric]
        for splits in (results or {}).values()
        for s in g.gate_splits
        if s in splits and g.gate_mode in splits[s]
    ]
    if not values:
        raise ValueError(
            f"the evaluation has none of the gate's splits {g.gate_splits} in mode {g.gate_mode!r}: "
            "set eval.splits/eval.modes to include them"
        )
    return sum(values) / len(values)


def gate_record(
    decision: GateDecision, resolvable: tuple[float, int, float], *, batches: list[int] = (), n_per_split: int = 0
) -> dict:
    """What champion.json, history.json and the report keep of the gate's decision (lopd_core/gate.py): the point
    estimates under their old names (`champion`, `student`), the paired gain, its shown interval and n, the exact
    test's p-value and level, the guards (their values: the lineage's curve, and both comparisons), the reason,
    what the first look could resolve before the evaluation, and the fresh batches its looks played (`batches`,
    `tasks`: the instances [first, end) of each split, which the next cycle's gate starts after: flows/gate.py)."""
    record = {
        "champion": decision.champion,
        "student": decision.student,
        "test": decision.test,
        "reason": decision.reason,
        "looks": decision.looks,
        "resolvable_before": resolvable[0],
        "n_before": resolvable[1],
        "detectable_before": resolvable[2],
        "guards": [guard_record(g) for g in decision.guards],
    }
    if batches:
        record.update(
            batches=list(batches),
            n_per_split=n_per_split,
            tasks=[batches[0] * n_per_split, (batches[-1] + 1) * n_per_split],
        )
    if decision.interval is not None:
        iv = decision.interval
        record.update(gain=iv.gain, low=iv.low, high=iv.high, n=iv.n, level=iv.level, resampling=iv.resampling)
    if decision.gain_test is not None:
        record.update(p=decision.gain_test.p, alpha=decision.alpha, p_method=decision.gain_test.method)
    return record


def guard_record(guard: GuardResult) -> dict:
    """One guard of `gate_record`: its values and its comparison with the champion and with the root (None: not
    checked)."""

    def comparison(c: Comparison | None) -> dict | None:
        if c is None:
            return None
        return {"interval": asdict(c.interval), "p": c.test.p, "threshold": c.test.threshold, "failed": c.failed}

    return {
        "name": guard.name,
        "failed": guard.failed,
        "student": guard.student,
        "champion": guard.champion,
        "root": guard.root,
        "max_fall": guard.max_fall,
        "budget": guard.budget,
        "vs_champion": comparison(guard.vs_champion),
        "vs_root": comparison(guard.vs_root),
    }


def cycle_tags(number: int, commit: str, champion: Champion) -> dict:
    """The tags of a cycle's parent run, set when it opens."""
    return {
        "lopd.cycle": number,
        "git.commit": commit,
        "lopd.champion": champion.model,
        "lopd.champion_version": champion.version or "base",
    }


def student_eval_with_teacher(params: Params, number: int, eval_path: str, teacher: dict) -> str:
    """The student's eval.json with this cycle's teacher in play under each env and split, as a file of the
    cycle's own (the evaluation's folder is a cached stage result, shared by any cycle that made the same
    student)."""
    out = Path(params.cycle.dir) / "evals" / f"cycle-{number:03d}-student.json"
    write_json(out, merge_teacher(read_json(eval_path), teacher))
    return str(out)


def cycle_lineage(run: CycleRun, champion: Champion, stages: CycleStages, gate: dict, promoted: bool) -> dict:
    """The lineage the exported student's model card and lineage.json carry."""
    return {
        "cycle": run.number,
        "parent model": champion.model,
        "parent version": champion.version or "base",
        "base model content": run.base_hash,
        "bank DVC md5": stages.bank["dvc_md5"],
        "bank rows": stages.bank["bank_rows"],
        "git commit": run.commit,
        "mlflow cycle run": run.parent_run or "untracked",
        "distill steps": stages.distill["steps"],
        "gate": gate["reason"],
        "promoted": promoted,
    }


def cycle_record(
    params: Params, run: CycleRun, champion: Champion, stages: CycleStages, gate: dict, promoted: bool, exported: dict
) -> dict:
    """The record history.json keeps of one cycle (its `report` and `seconds` are added once known)."""
    distilled, fitted = stages.distill, stages.fit
    last, delta_mean = last_row(distilled["csv"])
    grown = distilled.get("grown_bank") or {}  # the bank the student's own successes grew (growing_bank.py)
    composer_from = ("the champion's" if stages.coldstart is None else "cold start φ0") + (
        f", fitted in the world on {fitted['targets']} trajectories" if fitted["fitted"] else ", not fitted"
    )
    new_champion = Champion(
        model=distilled["student"],
        bank={**stages.bank, **grown},
        composer=distilled["composer"],
        eval=stages.student_eval["eval"],
        generation=champion.generation + 1,
        cycle=run.number,
        version=exported["version"],
        gate=gate,
    )
    return {
        "cycle": run.number,
        "deploy_worlds": list(params.envs.deploy_worlds),  # what a later cycle replays (with_earlier_worlds)
        "promoted": promoted,
        "gate": gate,
        "champion_before": asdict(champion),
        "student": distilled["student"],
        "distill_seed": distilled.get("seed"),  # the run's seed, or a retry's own (with_retry_seed)
        "csv": distilled["csv"],
        "export": exported["export"],
        "version": exported["version"],
        "mlflow_run": run.parent_run,
        "eval": {e: getattr(stages, f"{e}_eval")["eval"] for e in ("base", "champion", "student")},
        "final_beta": float(last["beta"]),
        "final_delta": float(last["delta"]),
        "delta_mean": delta_mean,
        "bank": bank_census(grown.get("bank_dir") or stages.bank["bank_dir"], distilled.get("bank_added", 0)),
        # the m the run trained with (the resolved method's: 0 for lopd_no_margin), not the section's
        "margin": distilled.get("margin", resolve_method(params.lopd, params.baselines).margin),
        "cached": stages.cached(),
        "composer_from": composer_from,
        "teacher_in_play": stages.teacher["results"],
        "base_hash": run.base_hash,
        "new_champion": asdict(new_champion),
    }


def cycle_metrics(params: Params, record: dict, stages: CycleStages) -> dict[str, float]:
    """The metrics of a cycle's parent run: the gate's, the base's gate score, β and δ̄, the wall time."""
    gate = record["gate"]
    metrics = {"gate.champion": gate["champion"], "gate.student": gate["student"], "gate.looks": gate["looks"]}
    metrics.update({f"gate.{k}": gate[k] for k in ("gain", "low", "high", "n") if k in gate})
    return {
        **metrics,
        "gate.base": gate_score(params, stages.base_eval["results"]),
        "beta": record["final_beta"],
        "delta": record["final_delta"],
        "delta_mean": record["delta_mean"],
        "cycle_seconds": record["seconds"],
    }


def last_row(csv_path: str) -> tuple[dict, float]:
    """The distill CSV's last row, and δ̄ averaged over every step."""
    import pandas as pd

    frame = pd.read_csv(csv_path)
    return frame.iloc[-1].to_dict(), float(frame["delta"].mean())


def bank_census(bank_dir: str, added_in_distill: int = 0) -> dict:
    """Rows of the bank a cycle ends with, and its successes per tool domain (a cross-domain task counts in
    each of its domains; rows of other environments under the environment's name: `codegen`, a plugin's)."""
    import pandas as pd

    from lopd_core.envs import TEMPLATES

    path = Path(bank_dir) / "experience.parquet"
    frame = (
        pd.read_parquet(path, columns=["env", "template"])
        if path.exists()
        else pd.DataFrame({"env": [], "template": []})
    )
    by_domain: dict[str, int] = {}
    for (env, template), count in frame.value_counts(["env", "template"]).items():
        for domain in TEMPLATES[template].domains if env == "toolworld" and template in TEMPLATES else (env,):
            by_domain[domain] = by_domain.get(domain, 0) + int(count)
    return {"rows": len(frame), "by_domain": by_domain, "added_in_distill": int(added_in_distill)}
