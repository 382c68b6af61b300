"""`lopd distill`: the LOPD training loop (DESIGN §3), one step at a time, resumable.

Per step, in this order (`Distiller.step`, then `Distiller.update`):
  1. roll out B tasks × G samples with the current student (token in, token out);
  2. retrieve J experiences per task, compose latents c_φ, score the student's tokens with the latent teacher
     and keep its top-k log-probs and ids;
  3. student update: reverse KL(p_S ‖ p_T) on the teacher's top-k + tail (or full / sampled), token mean;
  4. composer update through the frozen teacher: KL(sg[p_S,old] ‖ p_T,φ) + β·(m − δ̄) + λ·anchor;
  5. dual ascent: β ← max(0, β + η_β·(m − δ̄)).
Steps 2 and 4 share one teacher forward: it is run with the composer's graph attached, step 2 takes a
detached copy of what it needs and step 4 back-propagates through the same activations afterwards (the
composer has not changed in between, so this is exactly the specified order, one teacher pass cheaper).
Steps 2-4 run in micro-batches of `lopd.micro_batch` trajectories with gradients accumulated (`update`): peak
memory is one chunk's teacher and student graphs rather than the whole batch's, and the optimizer steps are
still taken once, in the order above, on exactly the whole-batch gradients. The containers and arithmetic of
a step are in step.py; this module holds the models, the optimizers and the order.

Everything a step needs is derived from (seed, step): its tasks are a fixed slice of the training stream and
its sampling generator is seeded by the step, so a run resumed from a checkpoint prints the same numbers as an
uninterrupted one. A non-finite loss or gradient norm skips that update (counted, never applied).

A checkpoint holds tensors and plain data only and is read with `weights_only=True` (nothing in it is unpickled
as an object). It records the settings it was made under (`resume_settings`), and a resume under other ones is
refused, each differing key listed, as is one whose checkpoint is past the steps asked for: either would
silently mix two runs in one set of curves (`lopd.resume_mismatch: warn` resumes anyway, saying so).
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import math
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lopd_core import distributed as D
from lopd_core.config import ConfigError, Params
from lopd_core.envs import Task
from lopd_core.envs.mix import deployment_tasks
from lopd_core.errors import StateError, TrainingDiverged
from lopd_core.lopd import losses as L
from lopd_core.lopd import margin as MG
from lopd_core.lopd import methods as M
from lopd_core.lopd import step as S
from lopd_core.lopd import teacher_refresh as R
from lopd_core.lopd.composer import Composer, ExperienceEncoder, compose_latents, mean_embedding_norm
from lopd_core.lopd.models import export_student, make_student_and_teacher
from lopd_core.lopd.step import StepResult, chunk_group, micro_batches
from lopd_core.lopd.teacher import Framing, action_logits, build_batch
from lopd_core.model.chat import make_chat
from lopd_core.outputs import OutputPathError
from lopd_core.outputs import _reason as output_reason
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

CSV_COLUMNS = [
    "step", "rollouts", "reward_mean", "success_rate", "distill_loss", "kl_phi", "delta", "beta",
    "margin", "delta_success", "delta_failure", "anchor", "student_entropy", "teacher_entropy", "topk_mass",
    "grad_norm_theta", "grad_norm_phi", "latent_norm_ratio", "step_seconds", "phase", "teacher_refreshes",
]
DIAGNOSTIC_COLUMNS = [
    "step", "margin_success", "margin_failure", "latent_norm", "embedding_norm", "skipped_updates",
    "encoder_cache_hits", "rollout_s", "teacher_s", "student_s", "composer_s", "refresh_student", "refresh_teacher",
]

Retriever = Callable[[list[Task]], list[list[str]]]  # tasks -> experience texts per task

# What a checkpoint must agree with to be resumed: the settings that shape a run's numbers (the distill stage's
# reads in tasks/stage_params.py, less where things are). Free to change on a resume: lopd.steps (a longer run
# continues a shorter one; a checkpoint past it is refused apart), where outputs go, how often checkpoints are
# written, the memory schedule of a chunk (the same gradients either way) and resume_mismatch itself; where a
# plugin's tools run and how long a step may take (the same episodes either way).
RESUME_SETTINGS = ("seed", "model.dtype", "lopd", "baselines", "rollout", "composer", "envs", "bank.top_j",
                   "bank.allow_self_retrieval", "bank.same_world", "bank.ef_search", "bank.refresh_every",
                   "bank.min_reward")
RESUME_FREE = frozenset({"lopd.steps", "lopd.out_dir", "lopd.csv", "lopd.checkpoint_every", "lopd.resume_mismatch",
                         "lopd.max_skipped_share", "lopd.low_memory", "lopd.teacher_micro_batch",
                         "lopd.share_prompt", "envs.isolate_tools", "envs.step_timeout_s"})
CHECKPOINT_KEYS = ("state", "trainable", "composer", "opt_theta", "opt_phi", "rng_torch")
START_OVER = "rerun with --fresh to start over (`lopd distill --fresh`, or delete the file)"
NOT_RECORDED = "(not recorded)"


class CheckpointError(StateError):
    """A checkpoint that cannot be resumed as it is: unreadable, made under other settings, or past the steps
    asked for. The message names the file and how to go on."""


@dataclass
class DistillState:
    step: int = 0  # steps completed
    beta: float = 0.0
    rollouts: int = 0  # trajectories sampled so far (including the bank's seed rollouts)
    skipped_updates: int = 0
    history: list[dict] = field(default_factory=list)
    margin: float | None = None  # m priced for `lopd.margin: auto` (margin.py); None: not priced (or m is a number)
    margin_pricing: dict = field(default_factory=dict)  # how it was priced (PricedMargin.summary)
    # lopd_gated_refresh (teacher_refresh.py): refreshes of θ̄ so far, the teacher base's last check score (None:
    # not measured yet), every check's figures, and the episodes the checks played (not training rollouts)
    teacher_refreshes: int = 0
    refresh_teacher_score: dict | None = None
    refresh_checks: list[dict] = field(default_factory=list)
    check_episodes: int = 0


@dataclass
class TeacherContext:
    """What the teacher reads in its latent slot this step, per trajectory (step 2a)."""

    latents: torch.Tensor | None  # (U, K, D) detached leaf, one row per distinct experience: grads gather here
    slots: list[list[int]]  # per trajectory, the rows of `latents` it reads (J each; none without experience)
    texts: list[str]  # the distinct experience texts, in `latents` order
    text_context: list[str | None] | None  # per trajectory, the text a baseline's teacher reads instead
    signal: torch.Tensor | None  # (B,) 0 where the teacher has no context and so no signal (SDPO), else None
    n_signal: int  # action tokens of the trajectories with signal, every rank's: the student loss's denominator
    composed: torch.Tensor | None  # (U, K, D) the resampler's output with its graph, when kept from the start
    encoded: tuple[torch.Tensor, torch.Tensor] | None  # the experiences' encoder states, to run it again


@dataclass
class ComposerStep:
    """Step 4's figures for the row."""

    anchor: float  # mean((c_φ − c_φ0)²) over every rank's latents
    grad_norm: float
    latent_norm: float  # mean norm of a latent vector, every rank's


def load_composer(path: str | Path, lm_width: int, cfg, embedding_norm: float) -> Composer:
    composer = Composer(lm_width, num_queries=cfg.num_queries, hidden_size=cfg.hidden_size,
                        num_layers=cfg.num_layers, num_heads=cfg.num_heads, embedding_norm=embedding_norm)
    if path and Path(path).exists():
        composer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return composer


def check_top_k(lopd, model) -> None:
    """lopd.top_k against the model's vocabulary: checked as soon as the model is loaded (`run_lopd`), before
    anything else could fail first and hide the setting behind another error."""
    vocab = model.get_output_embeddings().weight.shape[0]
    if lopd.student_loss == "topk" and lopd.top_k >= vocab:
        raise ConfigError(f"lopd.top_k: got {lopd.top_k}, expected fewer than the model's vocabulary "
                          f"({vocab}); for the whole distribution set lopd.student_loss=full")


def sample_seed(seed: int, step: int, task_index: int, sample_index: int) -> int:
    """The sampling seed of one trajectory: a function of where it sits in the run, not of which process or
    batch plays it (a fixed mixing of the four integers into 63 bits)."""
    x = seed
    for v in (step, task_index, sample_index):
        x = (x * 1_000_003 + v + 0x9E3779B97F4A7C15) % (1 << 63)
    return x


def _grad_norm(params, max_norm: float) -> float:
    return float(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm))


@contextmanager
def _timed(sums: S.StepSums, phase: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        sums.seconds[phase] += time.perf_counter() - started


def resume_settings(params: Params) -> dict[str, Any]:
    """The settings a checkpoint records, flat: dotted key -> plain value (a list or mapping is one value)."""
    out: dict[str, Any] = {}
    for dotted in RESUME_SETTINGS:
        node = params
        for part in dotted.split("."):
            node = getattr(node, part)
        _flatten_settings(node, dotted, out)
    return out


def _flatten_settings(value, dotted: str, out: dict[str, Any]) -> None:
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _flatten_settings(getattr(value, f.name), f"{dotted}.{f.name}", out)
    elif dotted not in RESUME_FREE:
        out[dotted] = plain_data(value, dotted)


def settings_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One `key: old → new` line per setting that differs between a checkpoint and this run."""
    keys = sorted(set(recorded) | set(current))
    return [f"{k}: {recorded.get(k, NOT_RECORDED)!r} → {current.get(k, NOT_RECORDED)!r}" for k in keys
            if recorded.get(k, NOT_RECORDED) != current.get(k, NOT_RECORDED)]


def plain_data(value, where: str = "checkpoint"):
    """`value` as `torch.load(weights_only=True)` reads it back: tensors, str, int, float, bool, None, and lists,
    tuples and dicts of them; numpy scalars become Python numbers. Anything else is refused, naming where it sits,
    so a checkpoint that could only be read by unpickling objects is never written."""
    if value is None or isinstance(value, (torch.Tensor, str, bool, int, float)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: plain_data(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain_data(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise TypeError(f"{where}: a {type(value).__name__} cannot go into a checkpoint read with weights_only=True; "
                    "store it as tensors or plain data (dict, list, str, int, float, bool, None)")


def _load_failure(exc: Exception) -> str:
    """What torch.load found wrong with the file, in one line (without its advice on weights_only)."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1].split("Check the documentation", 1)[0]
    reason = " ".join(text.split())
    return f"{type(exc).__name__}: {reason[:160]}"


def read_checkpoint(path: Path) -> dict:
    """A checkpoint's contents as tensors and plain data (weights_only: no object is unpickled), or a
    CheckpointError naming the file when it is truncated, overwritten or not a checkpoint of this trainer."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001  damaged bytes fail in torch's zip reader or unpickler with any of
        # RuntimeError, UnpicklingError, EOFError, IndexError, KeyError, UnicodeDecodeError, struct.error ...
        raise CheckpointError(f"{path}: unreadable checkpoint ({_load_failure(exc)}); {START_OVER}") from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(payload, dict) or k not in payload]
    if missing:
        raise CheckpointError(f"{path}: not a `lopd distill` checkpoint (no {', '.join(missing)}); {START_OVER}")
    return payload


class Distiller:
    """Holds the models, optimizers and state of one distillation run."""

    def __init__(self, params: Params, base, tokenizer, retriever: Retriever, *, composer: Composer,
                 initial_rollouts: int = 0, teacher_base=None, pricing: MG.PricingSource | None = None,
                 log=print):
        D.setup()  # joins the process group under `accelerate launch`; a no-op in one process
        if D.world_size() > params.lopd.tasks_per_step:
            raise ValueError(f"lopd.tasks_per_step: got {params.lopd.tasks_per_step}, expected at least the "
                             f"number of processes ({D.world_size()}): every rank needs a task per step")
        params.lopd.check()  # the rules across keys, also for a section built by hand
        check_top_k(params.lopd, base)
        torch.manual_seed(params.seed)
        self.params, self.cfg = params, params.lopd
        self.log = log if D.is_main() else (lambda *_a, **_k: None)  # one voice, not one per rank
        # The method (LOPD, a baseline or an ablation: lopd_core/lopd/methods.py) picks the teacher's context and
        # weights and the student's loss; the rest of the loop is shared by all of them. Resolved once: its
        # margin and anchor weight are the ones this run trains with (and the reports draw).
        self.method = M.resolve_method(self.cfg, params.baselines)
        self.student_loss = S.StudentLoss.resolve(self.method, self.cfg, params.baselines)
        self.teacher_pass = self.method.needs_teacher_pass
        # A two-phase method (lopd_then_grpo) trains `then` from baselines.switch_fraction of lopd.steps on; which
        # phase a step trains is a function of the step (`_enter_phase`), so a resume lands in the right one.
        self._phases = M.method_phases(self.method, self.cfg, params.baselines)
        self._phase = 0
        # Trade compute for peak memory (`lopd.low_memory`, see `_chunk_low_memory`); fixed for the run.
        self._low_memory = self.cfg.low_memory
        self.codec = make_chat(tokenizer)
        self.tokenizer = tokenizer
        self.framing = Framing.from_tokenizer(tokenizer)
        # `teacher_base`: other frozen teacher weights than the student's start (`lopd cycle` with
        # cycle.refresh_teacher false keeps the first base as teacher); None: θ̄ is the student's start.
        self.trainable, self.student, self.teacher = make_student_and_teacher(
            base, mode=self.cfg.student_mode, lora_rank=self.cfg.lora_rank, teacher=teacher_base)
        self.encoder = ExperienceEncoder(self.teacher, tokenizer, max_tokens=params.composer.max_experience_tokens)
        self.composer = composer.train().requires_grad_(self.method.composer_trainable)
        self.ema_lm = M.ema_copy(self.student) if self.method.teacher_weights == "ema" else None
        self.anchor_composer = copy.deepcopy(composer).eval().requires_grad_(False)  # φ0, fixed
        self._anchor_cache: dict[str, torch.Tensor] = {}  # experience text -> φ0's (K, D) latents
        self.embedding_norm = mean_embedding_norm(self.student)
        self.retriever = retriever
        self.opt_theta = torch.optim.AdamW([p for p in self.trainable.parameters() if p.requires_grad],
                                           lr=self.cfg.lr_student, weight_decay=0.0)
        self.opt_phi = torch.optim.AdamW(self.composer.parameters(), lr=self.cfg.lr_composer, weight_decay=0.0)
        self.state = DistillState(beta=self.cfg.beta_init, rollouts=initial_rollouts)
        self._task_blocks: dict[int, list[Task]] = {}
        # lopd_gated_refresh: what scores a policy in the held-out check (tests inject a cheaper one)
        self.refresh_scorer: Callable[[Any], R.CheckScore] = self._held_out_score
        self._check_tasks: list[Task] | None = None
        self.pricing = pricing  # what `lopd.margin: auto` is priced on (`price_margin`); None: the first step
        # Positions the teacher splices into a trajectory (its latents and their frame), reserved in the student's
        # rollouts so that no teacher pass reads more than rollout.max_context (text contexts are cut to fit).
        self.splice_room = max(3 + params.bank.top_j * composer.num_queries if m.needs_composer else 0
                               for m in self._phases)
        if params.rollout.max_context - self.splice_room < params.rollout.max_new_tokens + 1:
            raise ConfigError(f"rollout.max_context: got {params.rollout.max_context}, expected more than the "
                              f"teacher's {self.splice_room} spliced positions (bank.top_j × composer.num_queries + 3) "
                              f"plus rollout.max_new_tokens ({params.rollout.max_new_tokens})")

    @property
    def margin(self) -> float | None:
        """The margin m this run trains with: the method's own (0 for lopd_no_margin), else `lopd.margin`, or with
        `lopd.margin: auto` the priced one (None until `price_margin` or the first step has priced it)."""
        return self.method.margin if self.method.margin is not None else self.state.margin

    @property
    def low_memory(self) -> bool:
        return self._low_memory

    # ---- one step -------------------------------------------------------------------------------------
    def step_tasks(self, step: int) -> list[Task]:
        """Every rank's tasks of `step` (0-based): a fixed slice of the training stream.

        The stream comes in blocks of `lopd.steps` steps, block b drawn with its own seed (block 0 is the
        stream a run of lopd.steps draws). A run asked for more steps (`run_distill(steps=...)`) thus gets fresh
        tasks instead of running past the end, and a block is the same whatever the run's length, so resuming
        changes nothing."""
        per_step = self.cfg.tasks_per_step
        block, within = divmod(step, self.cfg.steps)
        if block not in self._task_blocks:  # envs interleaved: every step draws the mix
            self._task_blocks[block] = deployment_tasks(self.params.envs, "train", self.cfg.steps * per_step,
                                                        self.params.seed + 17 + 1_000_003 * block)
        return self._task_blocks[block][within * per_step:(within + 1) * per_step]

    def step(self) -> StepResult:
        """One full step: roll out this step's tasks, then `update` on the trajectories."""
        cfg, ro = self.cfg, self.params.rollout
        started = time.perf_counter()
        s = self.state.step
        # Under `accelerate launch` each rank takes its contiguous slice of the step's tasks (all G samples of
        # a task on one rank, so group advantages stay local); `update` reduces across ranks.
        mine = D.shard_range(cfg.tasks_per_step)
        tasks = self.step_tasks(s)[mine.start:mine.stop]

        # 1. Rollouts with the current student. Each trajectory's sampling stream is seeded by (seed, step,
        # task index in the stream, sample), so any number of ranks samples what one process samples.
        first = s * cfg.tasks_per_step + mine.start
        requests = [RolloutRequest(t, sample_index=g) for t in tasks for g in range(cfg.samples_per_task)]
        seeds = [sample_seed(self.params.seed, s, first + i // cfg.samples_per_task, i % cfg.samples_per_task)
                 for i in range(len(requests))]
        sampling = Sampling(temperature=ro.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens,
                            max_context=ro.max_context - self.splice_room,
                            max_observation_tokens=ro.max_observation_tokens)
        trajs = rollout(self.student, self.codec, requests, sampling=sampling, batch_size=ro.batch_size,
                        seed=self.params.seed * 1_000_003 + s, seeds=seeds)
        self.state.rollouts += cfg.tasks_per_step * cfg.samples_per_task  # every rank's, not only this one's
        self.last_trajectories = trajs  # this rank's, for a growing bank (growing_bank.py)
        out = self.update(tasks, trajs, started=started)
        if self.method.teacher_refresh == "gated" and self.state.step % self.params.baselines.refresh_check_every == 0:
            self._refresh_check(out)
        return out

    def update(self, tasks: list[Task], trajs: list, *, started: float | None = None) -> StepResult:
        """Steps 2-5 on trajectories of `tasks` (samples_per_task each, in task order). Also what
        benchmarks/step_cost.py times against a plain policy-gradient update.

        The batch is processed in chunks of `lopd.micro_batch` trajectories (0 = one chunk): per chunk, the
        teacher forward (graph to the latents), the student forward and backward, then the composer's chunk
        loss backward through the teacher, after which both graphs are gone. Gradients accumulate; the student
        optimizer steps only after every chunk, then the composer (after its own backward through the
        resampler), then β — the order of DESIGN §3. Every chunk's sum is divided by a whole-batch count known
        up front (step.py), so the accumulated gradients, δ̄, the KL and the entropies equal the whole-batch
        ones (up to float summation order). The composer's s_old is the student's detached logits of the same
        chunk, taken before any optimizer step, so it is the pre-update student, as specified.
        """
        started = time.perf_counter() if started is None else started
        self._enter_phase()
        t_update = time.perf_counter()
        device = self.composer.queries.device
        batch = S.rollout_batch(trajs, samples_per_task=self.cfg.samples_per_task, advantage=self.cfg.advantage,
                                group_std_eps=None if self.student_loss.kind in ("topk", "full", "sampled")
                                and self.student_loss.rl_weight == 0
                                else self.params.baselines.group_std_eps, device=device)
        sums = S.StepSums.zeros(len(batch), device)
        with _timed(sums, "teacher"):
            context = self._teacher_context(tasks, trajs, batch)  # 2a. latents once per distinct experience
        beta = self.state.beta  # the β of this step's composer loss (the row's `beta`)

        chunks = self._chunks(batch.token_ids)
        picked = self._composer_chunks(len(chunks))
        scale = S.composer_scale(batch, chunks, picked)
        self.opt_theta.zero_grad(set_to_none=True)
        for c, chunk in enumerate(chunks):  # 2-4 on each micro-batch, gradients accumulated
            self._run_chunk(batch, context, chunk, sums, beta=beta, scale=scale, train_composer=c in picked)
        totals = sums.reduced()
        if self.margin is None:  # `lopd.margin: auto` with nothing stored to price on: this step's successes
            self._price_on_batch(batch, sums)

        with _timed(sums, "student"):
            grad_theta = self._step_student(totals["distill"])  # 3. once, on the accumulated gradient
        with _timed(sums, "composer"):
            composer = self._step_composer(context, totals, beta)  # 4. anchor + latents' gradient, one backward
        delta_bar = totals["delta"]
        if self.method.composer_trainable and math.isfinite(delta_bar):  # 5. β only acts on a composer that learns
            self.state.beta = L.dual_ascent(beta, margin=self.margin, delta_bar=delta_bar, lr=self.cfg.beta_lr)
        self.state.step += 1
        return self._result(batch, sums, totals, beta=beta, grad_theta=grad_theta, composer=composer,
                            started=started, rollout_s=t_update - started)

    # ---- the margin priced (`lopd.margin: auto`, margin.py) ----------------------------------------------
    def price_margin(self) -> None:
        """Price m before the first step when `lopd.margin` is `auto`: on the stored successes of `pricing` (the
        bank's seed rollouts), scored by the initial teacher with φ0's latents against the initial student. With
        none, the first step prices it on its own successes (`update`). A no-op when m is a number, the method's
        own, or already priced: a resumed run keeps the checkpoint's m."""
        if self.margin is not None:
            return
        if not self.method.needs_composer:
            self._set_margin(MG.price(math.nan, 0, self.cfg.margin_fraction, "none"),
                             f"distill: margin: auto: lopd.method={self.method.name!r} has no latent teacher to "
                             "price m on; m = 0")
            return
        rows = list(self.pricing.trajectories) if self.pricing is not None else []
        if not rows:
            self.log("distill: margin: auto: no stored seed successes to price m on; step 1 prices it on its own "
                     "successful rollouts")
            return
        retriever = self.pricing.retriever or self.retriever
        gap, n = self._seed_gap(rows, retriever)
        self._set_margin(MG.price(gap, n, self.cfg.margin_fraction, "bank seed successes"))

    def _seed_gap(self, rows: list[MG.PricingTrajectory], retriever: Retriever) -> tuple[float, int]:
        """The mean over `rows` (every rank's share of them) of each one's mean log p_T,φ0(a) − log p_S(a) at its
        action tokens, and how many rows had action tokens; no gradient, in micro-batches of the run's size. Rows
        too long to hold the teacher's splice within rollout.max_context are left out (the bank's rollouts did not
        reserve room for it)."""
        rows = [r for r in rows if len(r.token_ids) + self.splice_room <= self.params.rollout.max_context]
        part = rows[D.shard_range(len(rows)).start:D.shard_range(len(rows)).stop]
        total, n = 0.0, 0
        if part:
            device = self.composer.queries.device
            experiences = retriever([r.task for r in part])
            latents = [x.to(device) for x in self.anchor_latents(experiences)]  # φ0's, cached per text
            ids, masks = [r.token_ids for r in part], [r.action_mask for r in part]
            with torch.no_grad():
                for chunk in micro_batches([len(i) for i in ids], self.cfg.micro_batch):
                    c_ids, c_masks = [ids[i] for i in chunk], [masks[i] for i in chunk]
                    with self._teacher_lm() as lm:
                        scores = S.score_teacher(lm, c_ids, c_masks, [latents[i] for i in chunk],
                                                 [tuple(experiences[i]) for i in chunk], framing=self.framing,
                                                 share_prompt=self.cfg.share_prompt, top_k=self.cfg.top_k,
                                                 temperature=self.method.teacher_temperature)
                    sbatch = build_batch(self.student, c_ids, c_masks)
                    s_lp = torch.log_softmax(action_logits(self.student, sbatch), dim=-1)  # (n, V)
                    if not torch.equal(sbatch.action_ids, scores.action_ids):
                        raise RuntimeError("margin pricing: teacher and student disagree on the action tokens")
                    gap = scores.action_logprobs - s_lp.gather(-1, sbatch.action_ids[:, None]).squeeze(-1)  # (n,)
                    sums = torch.zeros(len(chunk), device=gap.device).index_add_(0, scores.token_traj_index,
                                                                                 gap.float())
                    counts = torch.bincount(scores.token_traj_index, minlength=len(chunk))
                    total += float((sums / counts.clamp(min=1))[counts > 0].sum())
                    n += int((counts > 0).sum())
        total, n = D.global_sum([total, n])
        return (total / n if n else math.nan), int(n)

    def _price_on_batch(self, batch: S.RolloutBatch, sums: S.StepSums) -> None:
        """`lopd.margin: auto` with nothing stored to price on: this step's successes (the first step's, whose
        teacher pass ran with φ0's latents against the initial student, the same gap as on stored ones)."""
        if not self.method.needs_composer or not self.teacher_pass:
            self.price_margin()
            return
        counts = torch.tensor(D.gather_lists(batch.token_counts.tolist()))
        gaps = torch.tensor(D.gather_lists((sums.gap.cpu() / batch.token_counts.clamp(min=1)).tolist()))
        successes = torch.tensor(D.gather_lists(batch.successes.tolist()), dtype=torch.bool)
        gap, n = MG.mean_over_successes(gaps, counts, successes)
        self._set_margin(MG.price(gap, n, self.cfg.margin_fraction, f"step {self.state.step + 1} successes"))

    def _set_margin(self, priced: MG.PricedMargin, message: str | None = None) -> None:
        self.state.margin, self.state.margin_pricing = priced.margin, priced.summary()
        self.log(message or priced.message())

    # ---- beyond the teacher's ceiling: phases and the gated teacher refresh (methods.py) -----------------
    def _enter_phase(self) -> None:
        """Train this step's phase (`methods.phase_at`): from the switch on, `lopd_then_grpo` trains GRPO on the
        same student — its loss, its teacher (none: no teacher pass without a reference KL) and no composer step.
        A function of the step, so a run resumed past the switch is in the second phase from its first step."""
        index = M.phase_at(self._phases[0], self.state.step, self.cfg, self.params.baselines)
        if index == self._phase:
            return
        self._phase = index
        self.method = self._phases[index]
        self.student_loss = S.StudentLoss.resolve(self.method, self.cfg, self.params.baselines)
        self.teacher_pass = self.method.needs_teacher_pass
        self.log(f"distill: step {self.state.step + 1}: phase {index}: {self._phases[0].name} trains "
                 f"{self.method.name} from here (baselines.switch_fraction={self.params.baselines.switch_fraction:g})")

    def _held_out_score(self, lm) -> R.CheckScore:
        """The refresh check's score of `lm`: greedy, no experience, on the check's fixed train-split tasks."""
        if self._check_tasks is None:
            self._check_tasks = R.check_tasks(self.params)
        self.state.check_episodes += len(self._check_tasks)
        return R.greedy_score(lm, self.codec, self._check_tasks, self.params.rollout, seed=self.params.seed)

    def _refresh_check(self, out: StepResult) -> None:
        """The held-out check of `lopd_gated_refresh` after this step, and θ̄ ← student where the student is ahead
        (teacher_refresh.py). The teacher base is scored once; after a refresh its score is the student's."""
        b = self.params.baselines
        student = self.refresh_scorer(self.student)
        if self.state.refresh_teacher_score is None:
            with self.teacher.active() as lm:
                teacher = self.refresh_scorer(lm)
        else:
            teacher = R.CheckScore(**self.state.refresh_teacher_score)
        refreshed = R.should_refresh(student, teacher, metric=b.refresh_metric, min_gain=b.refresh_min_gain)
        if refreshed:
            if R.refresh_teacher_weights(self.trainable, self.student, self.teacher):
                self.opt_theta.state.clear()  # a fresh adapter: the old one's moments do not apply
            self.encoder.cache.clear()  # encodings and φ0's latents of the old base
            self._anchor_cache.clear()
            self.state.teacher_refreshes += 1
        self.state.refresh_teacher_score = (student if refreshed else teacher).to_dict()
        check = {"step": self.state.step, "metric": b.refresh_metric, "student": student.to_dict(),
                 "teacher": teacher.to_dict(), "refreshed": refreshed}
        self.state.refresh_checks.append(check)
        out.row["teacher_refreshes"] = self.state.teacher_refreshes
        out.diagnostics.update(refresh_student=student.value(b.refresh_metric),
                               refresh_teacher=teacher.value(b.refresh_metric))
        self.log(f"distill: step {self.state.step}: teacher refresh check ({student.n} held-out train tasks, greedy, "
                 f"{b.refresh_metric}): student {student.value(b.refresh_metric):.3f} vs teacher base "
                 f"{teacher.value(b.refresh_metric):.3f} -> "
                 + (f"refreshed (θ̄ ← student, refresh {self.state.teacher_refreshes})" if refreshed else
                    f"kept (needs a gain > {b.refresh_min_gain:g})"))

    def _refreshed_teacher_weights(self) -> dict | None:
        """The teacher's weights for the checkpoint where they are a separate copy that a refresh changed (None
        otherwise: the start's θ̄ is rebuilt from the base, and LoRA's one copy is in the trainable state)."""
        if self.state.teacher_refreshes == 0 or self.teacher.adapter_owner is not None:
            return None
        return self.teacher.lm.state_dict()

    # ---- steps 2-4 on a chunk -------------------------------------------------------------------------
    def _run_chunk(self, batch: S.RolloutBatch, context: TeacherContext, chunk: list[int], sums: S.StepSums, *,
                   beta: float, scale: S.ComposerScale, train_composer: bool) -> None:
        """Steps 2-4 on one chunk, gradients accumulated. A function so that every tensor of the chunk
        (logits, log-probs, padded inputs) is released when it returns, before the next chunk starts."""
        with _timed(sums, "student"):
            sbatch = build_batch(self.student, *batch.rows(chunk))
        graph = self.method.needs_composer and self.method.composer_trainable and train_composer
        if not self.teacher_pass:  # GRPO without a reference KL: the student alone
            with _timed(sums, "student"):
                self._student_backward(batch, context, chunk, sbatch, None, sums, keep_old=True)
        elif self.low_memory:
            self._chunk_low_memory(batch, context, chunk, sbatch, sums, beta=beta, scale=scale, graph=graph)
        else:
            with _timed(sums, "teacher"):
                scores = self._score_teacher(batch, context, chunk, sums, graph=graph)
            with _timed(sums, "student"):
                targets = scores.targets(keep_logits=self.student_loss.reads_teacher_logits)
                s_old = self._student_backward(batch, context, chunk, sbatch, targets, sums, keep_old=True)
            with _timed(sums, "composer"):
                self._composer_backward(batch, chunk, scores, s_old, sums, beta=beta, scale=scale)

    def _chunk_low_memory(self, batch, context, chunk, sbatch, sums, *, beta, scale, graph) -> None:
        """The low-memory order (`lopd.low_memory`): s_old from a no-grad student forward first, so each teacher
        pass (`lopd.teacher_micro_batch` consecutive rows; 0 = the whole chunk) is consumed by the composer's
        backward before the next, and the student's graph is built only after the last. Peak memory is the
        larger of the two graphs rather than both, for one more student forward per chunk (and one more
        resampler forward, `_teacher_context`). The chunk's action tokens are ordered row by row, so a pass's
        tokens are a contiguous slice of the student's."""
        with _timed(sums, "student"), torch.no_grad():
            s_lp_old = torch.log_softmax(action_logits(self.student, sbatch), dim=-1)  # (n, V)
        size = self.cfg.teacher_micro_batch or len(chunk)
        targets, offset = [], 0
        for k in range(0, len(chunk), size):
            part = chunk[k:k + size]
            with _timed(sums, "teacher"):
                scores = self._score_teacher(batch, context, part, sums, graph=graph)
            n = scores.action_ids.shape[0]
            with _timed(sums, "composer"):
                part_lp_old = s_lp_old[offset:offset + n]  # (n, V) this pass's tokens
                sums.add_student_entropy(part_lp_old)
                s_old = S.StudentOld.of(part_lp_old, scores.topk_ids, scores.action_ids)
                self._composer_backward(batch, part, scores, s_old, sums, beta=beta, scale=scale)
            offset += n
            targets.append(scores.targets(keep_logits=self.student_loss.reads_teacher_logits))
            del scores  # its graph is consumed: not alive through the next pass
        if offset != sbatch.action_ids.shape[0]:
            raise RuntimeError("teacher passes and the student chunk disagree on the action tokens")
        del s_lp_old  # the composer is done with it: not alive through the student's backward
        with _timed(sums, "student"):
            self._student_backward(batch, context, chunk, sbatch, S.StudentTargets.cat(targets), sums,
                                   keep_old=False)

    def _score_teacher(self, batch: S.RolloutBatch, context: TeacherContext, rows: list[int], sums: S.StepSums,
                       *, graph: bool) -> S.TeacherScores:
        """Step 2 on `rows` with this method's teacher weights and context; the graph to the latents is kept
        when `graph` (for step 4). The baselines' teachers read text or nothing in the same slot."""
        ids, masks = batch.rows(rows)
        with self._teacher_lm() as lm, nullcontext() if graph else torch.no_grad():
            if self.method.needs_composer:
                ctx = [self._row_latents(context, i) for i in rows]
                keys = [tuple(context.slots[i]) for i in rows]  # equal slots: the same latent rows
            elif context.text_context is not None:
                ctx = self._context_embeddings(lm, [context.text_context[i] for i in rows], [len(r) for r in ids])
                keys = [(context.text_context[i], c.shape[0]) for i, c in zip(rows, ctx)]  # the text as cut
            else:
                ctx = keys = None
            self._check_teacher_rows(ids, ctx)
            scores = S.score_teacher(lm, ids, masks, ctx, keys, framing=self.framing,
                                     share_prompt=self.cfg.share_prompt, top_k=self.cfg.top_k,
                                     temperature=self.method.teacher_temperature,
                                     keep_logits=self.student_loss.reads_teacher_logits)
        sums.add_teacher(scores)
        return scores

    def _student_backward(self, batch: S.RolloutBatch, context: TeacherContext, chunk: list[int], sbatch,
                          targets: S.StudentTargets | None, sums: S.StepSums, *, keep_old: bool):
        """Step 3 on a chunk: forward, loss (its share of the batch's token mean), backward. With `keep_old` (the
        low-memory order took them earlier), adds the pre-update student's entropy to the sums and returns its
        detached log-probs where the composer's loss reads them (on the teacher's top-k ids; None without a
        teacher), so no (n, V) tensor outlives this call."""
        device = sbatch.action_ids.device
        s_logits = action_logits(self.student, sbatch)  # (n, V)
        rows = torch.tensor(chunk, dtype=torch.long, device=device)[sbatch.token_traj_index]  # (n,) trajectory
        per_token = S.student_token_loss(
            s_logits, sbatch.action_ids, targets, self.student_loss,
            pg_advantage=None if batch.pg_advantage is None else batch.pg_advantage[rows],
            sample_logprobs=(batch.action_sample_logprobs(chunk, device)
                             if self.student_loss.reads_sample_logprobs else None))
        if context.signal is not None:
            per_token = per_token * context.signal[rows]
        share = per_token.sum() / context.n_signal
        share.backward()
        sums.shares["distill"] += float(share.detach())
        if not keep_old:
            return None
        s_lp_old = torch.log_softmax(s_logits.detach(), dim=-1)  # (n, V), freed on return
        sums.add_student_entropy(s_lp_old)
        return None if targets is None else S.StudentOld.of(s_lp_old, targets.topk_ids, sbatch.action_ids)

    def _composer_backward(self, batch: S.RolloutBatch, rows: list[int], scores: S.TeacherScores,
                           s_old: S.StudentOld, sums: S.StepSums, *, beta: float, scale: S.ComposerScale) -> None:
        """Step 4 on the rows of one teacher pass: KL(sg[p_S,old] ‖ p_T,φ) and −β·δ̄ (their shares of the batch's
        means), backward through the frozen teacher to the latent leaf; the teacher's graph is gone afterwards.
        Only passes that kept a graph (chunks picked for the composer) back-propagate, rescaled to the batch."""
        rows_t = torch.tensor(rows, dtype=torch.long, device=scores.action_ids.device)
        terms = S.composer_terms(scores, s_old, batch.advantage[rows_t])
        kl_share = terms.kl_tokens.sum() / batch.n_tokens
        delta_share = terms.delta.sum() / batch.n_scored  # δ̄ = Σ_τ δ(τ) / trajectories
        if kl_share.requires_grad:  # (the β·m constant has no gradient)
            (scale.kl * kl_share - beta * scale.delta * delta_share).backward()
        sums.add_composer(terms, rows_t[scores.token_traj_index], float(kl_share.detach()), float(delta_share.detach()))

    # ---- step 2a, 3, 4 and the row --------------------------------------------------------------------
    def _teacher_context(self, tasks: list[Task], trajs: list, batch: S.RolloutBatch) -> TeacherContext:
        """Retrieve, and compose latents once per distinct experience text: the G samples of a task (and tasks
        sharing a bank row) read the same texts, and the resampler treats each experience independently. The
        chunks' teacher backward stops at a detached leaf; its accumulated gradient is pushed through the
        resampler once, after the last chunk (`_step_composer`)."""
        spec, group = self.method, self.cfg.samples_per_task
        per_task = self.retriever(tasks) if spec.uses_bank else [[] for _ in tasks]
        # Baselines whose teacher reads text (or nothing) instead of latents: the composer reads nothing.
        text_context = M.text_contexts(spec, tasks, trajs, per_task, group)  # (B,) or None
        experiences = [per_task[i // group] if spec.needs_composer else [] for i in range(len(trajs))]
        # A trajectory without a context (SDPO's groups without a success) gives no signal: its tokens leave
        # the student loss and its normaliser. (Decided by the method, so every rank takes the same branch.)
        signal, n_signal = None, batch.n_tokens
        if spec.teacher_context == "sibling":
            has = torch.tensor([c is not None for c in text_context])
            signal = has.float().to(self.composer.queries.device)
            n_signal = max(int(D.global_sum([int(batch.token_counts[has].sum())])[0]), 1)
        texts = list(dict.fromkeys(t for ex in experiences for t in ex))
        slot = {t: i for i, t in enumerate(texts)}
        context = TeacherContext(None, [[slot[t] for t in ex] for ex in experiences], texts, text_context, signal,
                                 n_signal, None, None)
        if texts:
            device = self.composer.queries.device
            states, state_mask = self.encoder.encode(texts)
            context.encoded = (states.to(device), state_mask.to(device))
            if self.low_memory or not spec.composer_trainable:  # graph rebuilt at the end (or never: φ = φ0)
                with torch.no_grad():
                    context.latents = self.composer(*context.encoded)
            else:
                context.composed = self.composer(*context.encoded)  # (U, K, D), graph to φ
                context.latents = context.composed.detach()
            context.latents.requires_grad_(spec.composer_trainable)
        return context

    def _step_student(self, distill_loss: float) -> float:
        """The student's optimizer step on the accumulated gradient (summed over ranks: identical steps
        everywhere); returns the gradient norm before clipping."""
        D.sum_gradients(self.trainable.parameters())
        grad = _grad_norm(self.trainable.parameters(), self.cfg.max_grad_norm)
        if math.isfinite(distill_loss) and math.isfinite(grad):
            self.opt_theta.step()
            if self.ema_lm is not None:  # SDPO's EMA teacher follows the student
                M.update_ema(self.ema_lm, self.student, self.params.baselines.ema_decay)
        else:
            self.state.skipped_updates += 1
            self.log(f"distill: step {self.state.step + 1}: non-finite student loss/gradient, update skipped")
        return grad

    def _step_composer(self, context: TeacherContext, totals: dict[str, float], beta: float) -> ComposerStep:
        """The composer's step: the anchor term plus the latents' accumulated gradient, one backward through
        the resampler, then the optimizer step (skipped when non-finite)."""
        width = self.composer.proj_out.out_features
        flat = torch.zeros((0, width), device=self.composer.queries.device)  # (Σ J_τ·K, D) the step's latents
        anchor = torch.zeros(())
        self.opt_phi.zero_grad(set_to_none=True)
        order = [s for ss in context.slots for s in ss]  # per trajectory, as the teacher read them
        anchor_share = len(order) / max(D.global_sum([len(order)])[0], 1)  # this rank's rows of the anchor's mean
        if context.latents is not None and self.method.composer_trainable:  # (φ = φ0: frozen-composer ablation)
            # low memory: the same forward again (φ unchanged, deterministic), now with a graph
            composed = context.composed if context.composed is not None else self.composer(*context.encoded)
            flat = composed[order].reshape(-1, width)
            anchor_u = self.anchor_latents([[t] for t in context.texts])  # φ0's (K, D) per distinct text
            anchor_target = torch.stack(anchor_u)[order].reshape(-1, width).to(flat.device)
            anchor = anchor_share * L.anchor_loss(flat, anchor_target)
            tensors, grads = [self.method.anchor_weight * anchor], [None]
            if context.latents.grad is not None:
                tensors.append(composed)
                grads.append(context.latents.grad)
            torch.autograd.backward(tensors, grads)
        elif context.latents is not None:  # φ = φ0: nothing to learn, but the dashboard still shows their scale
            flat = context.latents[order].reshape(-1, width)
        anchor_v = D.global_sum([float(anchor.detach())])[0]
        D.sum_gradients(self.composer.parameters())
        loss_phi = float(L.composer_loss(torch.tensor(totals["kl"]), torch.tensor(totals["delta"]), beta=beta,
                                         margin=self.margin, anchor=anchor_v,
                                         anchor_weight=self.method.anchor_weight))
        grad = _grad_norm(self.composer.parameters(), self.cfg.max_grad_norm)
        if math.isfinite(loss_phi) and math.isfinite(grad):
            self.opt_phi.step()
        else:
            self.state.skipped_updates += 1
            self.log(f"distill: step {self.state.step + 1}: non-finite composer loss/gradient, update skipped")
        with torch.no_grad():
            norm_sum, norm_rows = D.global_sum([float(flat.detach().norm(dim=-1).sum()), flat.shape[0]])
        return ComposerStep(anchor_v, grad, norm_sum / norm_rows if norm_rows else 0.0)

    def _result(self, batch: S.RolloutBatch, sums: S.StepSums, totals: dict[str, float], *, beta: float,
                grad_theta: float, composer: ComposerStep, started: float, rollout_s: float) -> StepResult:
        """The dashboard row (detached, whole-batch figures: every rank's trajectories, in rank = task order)
        and the diagnostics, from the sums the chunks accumulated."""
        counts = batch.token_counts.clamp(min=1)
        rewards = torch.tensor(D.gather_lists(batch.rewards.tolist()), dtype=torch.float32)
        successes = torch.tensor(D.gather_lists(batch.successes.tolist()), dtype=torch.bool)
        per_traj_gap = torch.tensor(D.gather_lists((sums.gap.cpu() / counts).tolist()))
        per_traj_kl = D.gather_lists((sums.kl.cpu() / counts).tolist())
        # δ(τ) = A(τ) · its mean gap, the δ̄ terms: its parts on successes and failures (margin.delta_parts)
        advantage = torch.tensor(D.gather_lists(batch.advantage.cpu().tolist()))
        all_counts = torch.tensor(D.gather_lists(batch.token_counts.tolist()))
        delta_success, delta_failure = MG.delta_parts(advantage * per_traj_gap, all_counts, successes)
        n = batch.n_tokens
        row = {
            "step": self.state.step, "rollouts": self.state.rollouts,
            "reward_mean": float(rewards.mean()), "success_rate": float(successes.float().mean()),
            "distill_loss": totals["distill"], "kl_phi": totals["kl"], "delta": totals["delta"], "beta": beta,
            "margin": self.margin, "delta_success": delta_success, "delta_failure": delta_failure,
            "anchor": composer.anchor, "student_entropy": totals["student_entropy"] / n,
            "teacher_entropy": totals["teacher_entropy"] / n, "topk_mass": totals["topk_mass"] / n,
            "grad_norm_theta": grad_theta, "grad_norm_phi": composer.grad_norm,
            "latent_norm_ratio": composer.latent_norm / max(self.embedding_norm, 1e-8),
            "step_seconds": time.perf_counter() - started,
            "phase": self._phase, "teacher_refreshes": self.state.teacher_refreshes,
        }
        if not self.teacher_pass:  # no teacher: its columns have no value rather than a misleading 0
            row.update(kl_phi=math.nan, delta=math.nan, teacher_entropy=math.nan, topk_mass=math.nan,
                       delta_success=math.nan, delta_failure=math.nan)
        diag = {
            "step": self.state.step,
            "margin_success": float(per_traj_gap[successes].mean()) if successes.any() else float("nan"),
            "margin_failure": float(per_traj_gap[~successes].mean()) if (~successes).any() else float("nan"),
            "latent_norm": composer.latent_norm, "embedding_norm": self.embedding_norm,
            "skipped_updates": self.state.skipped_updates, "encoder_cache_hits": self.encoder.hits,
            "rollout_s": rollout_s, "teacher_s": sums.seconds["teacher"],
            "student_s": sums.seconds["student"], "composer_s": sums.seconds["composer"],
            "refresh_student": math.nan, "refresh_teacher": math.nan,  # filled on a step that ran the check
        }
        # Per trajectory: mean over its action tokens of log p_T,φ − log p_S,old, what δ(τ) weighs by A(τ)
        # (benchmarks/probes/margin_probe.py reads it to price margins and advantages).
        return StepResult(row, diag, per_traj_gap.tolist(), per_traj_kl)

    # ---- helpers --------------------------------------------------------------------------------------
    def _row_latents(self, context: TeacherContext, i: int) -> torch.Tensor:
        """(J·K, D) the latents trajectory i's teacher reads; zero rows (no block) when it retrieved nothing."""
        width = self.composer.proj_out.out_features
        if not context.slots[i]:
            return torch.zeros((0, width), device=self.composer.queries.device)
        return context.latents[context.slots[i]].reshape(-1, width)

    def _teacher_lm(self):
        """The teacher's weights for this method: the frozen base θ̄, the live student or its EMA."""
        if self.method.teacher_weights == "frozen_base":
            return self.teacher.active()
        return nullcontext(self.ema_lm if self.method.teacher_weights == "ema" else self.student)

    def _context_embeddings(self, lm, texts: list[str | None], lengths: list[int] | None = None
                            ) -> list[torch.Tensor]:
        """Text contexts as (L, D) embeddings for the latent slot: spliced there they are exactly the same
        conversation with the text in its first user turn. None or "" (no context) is zero rows: no block, the
        plain conversation (teacher.embed_row). With the rows' `lengths`, a text is cut to what fits beside its
        row within rollout.max_context (nothing: no block)."""
        embed = lm.get_input_embeddings()
        limit = self.params.composer.max_experience_tokens * self.params.bank.top_j
        out = []
        for k, text in enumerate(texts):
            room = limit if lengths is None else min(limit, self.params.rollout.max_context - lengths[k] - 3)
            ids = self.tokenizer(text or "", add_special_tokens=False)["input_ids"][:max(room, 0)]
            out.append(embed(torch.tensor(ids, dtype=torch.long, device=embed.weight.device)))
        return out

    def _check_teacher_rows(self, ids: list[list[int]], ctx: list[torch.Tensor] | None) -> None:
        """No teacher pass reads more than rollout.max_context positions (the student's rollouts leave room for
        the splice, `splice_room`); a longer row is a trajectory from elsewhere, named rather than scored."""
        limit = self.params.rollout.max_context
        for k, row in enumerate(ids):
            spliced = 0 if ctx is None or ctx[k].shape[0] == 0 else ctx[k].shape[0] + 3
            if len(row) + spliced > limit:
                raise ValueError(f"a trajectory of {len(row)} tokens with the teacher's {spliced} spliced positions "
                                 f"exceeds rollout.max_context={limit}: roll it out with max_context reduced by "
                                 f"Distiller.splice_room ({self.splice_room})")

    def _composer_chunks(self, n_chunks: int) -> set[int]:
        """Which chunks train the composer this step (`lopd.composer_fraction`), seeded by (seed, step)."""
        return S.composer_chunks(n_chunks, self.cfg.composer_fraction, self.params.seed * 1_000_003 + self.state.step)

    def _chunks(self, ids: list[list[int]]) -> list[list[int]]:
        return micro_batches([len(i) for i in ids], self.cfg.micro_batch,
                             chunk_group(self.cfg.samples_per_task, self.cfg.share_prompt))

    def anchor_latents(self, experiences: list[list[str]]) -> list[torch.Tensor]:
        """c_φ0 per task, from φ0's latents cached per experience text (φ0 never changes in a run)."""
        missing = list(dict.fromkeys(t for texts in experiences for t in texts if t not in self._anchor_cache))
        if missing:
            with torch.no_grad():
                fresh = compose_latents(self.anchor_composer, self.encoder, [[t] for t in missing])
            self._anchor_cache.update(zip(missing, fresh))
        width = self.composer.proj_out.out_features
        return [torch.cat([self._anchor_cache[t] for t in texts]) if texts else torch.zeros((0, width))
                for texts in experiences]

    # ---- checkpoints ----------------------------------------------------------------------------------
    def checkpoint_path(self) -> Path:
        return Path(self.cfg.out_dir) / "checkpoint.pt"

    def save_checkpoint(self) -> Path:
        """Rank 0 writes the one checkpoint (every rank holds the same full state); the others wait for it."""
        path = self.checkpoint_path()
        if not D.is_main():
            D.barrier()
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = plain_data({
            "state": asdict(self.state),
            "settings": resume_settings(self.params),  # what a resume must agree with (`load_checkpoint`)
            "trainable": {k: v for k, v in self.trainable.state_dict().items()},
            "composer": self.composer.state_dict(),
            "opt_theta": self.opt_theta.state_dict(),
            "opt_phi": self.opt_phi.state_dict(),
            "rng_torch": torch.get_rng_state(),
            "data_position": self.state.step * self.cfg.tasks_per_step,
            "ema": self.ema_lm.state_dict() if self.ema_lm is not None else None,  # SDPO's EMA teacher
            "teacher": self._refreshed_teacher_weights(),  # lopd_gated_refresh: a separate θ̄ once refreshed
        })
        tmp = path.with_suffix(".tmp")
        try:  # into a file object: a full disk is then an OSError naming its cause, not torch's "unexpected pos"
            with open(tmp, "wb") as f:
                torch.save(payload, f)
            tmp.replace(path)  # atomic: a crash mid-write leaves the previous checkpoint intact
        except OSError as exc:
            tmp.unlink(missing_ok=True)  # what was half-written goes; the previous checkpoint stays
            raise OutputPathError(f"cannot write the checkpoint {path}: {output_reason(exc)}; the previous "
                                  "checkpoint (if any) is intact: free space and rerun to resume") from None
        D.barrier()
        return path

    def load_checkpoint(self) -> bool:
        """Resume from the checkpoint when there is one; refuse (CheckpointError) one that is unreadable or was
        made under other settings (`lopd.resume_mismatch: warn` resumes the latter anyway, saying so)."""
        path = self.checkpoint_path()
        if not path.exists():
            return False
        payload = read_checkpoint(path)
        recorded = payload.get("settings")
        if recorded is None:
            self._mismatch(f"{path}: the checkpoint records no settings (written before checkpoints recorded "
                           "them), so a resume under other ones cannot be ruled out")
        else:
            differences = settings_differences(recorded, resume_settings(self.params))
            if differences:
                self._mismatch(f"{path}: the checkpoint was made under other settings (checkpoint → this run):",
                               differences)
        try:
            self._restore(payload)
        except (KeyError, RuntimeError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: the checkpoint does not fit this run's models ({_load_failure(exc)}); "
                                  f"{START_OVER}") from None
        return True

    def _restore(self, payload: dict) -> None:
        self.trainable.load_state_dict(payload["trainable"])
        self.composer.load_state_dict(payload["composer"])
        self.opt_theta.load_state_dict(payload["opt_theta"])
        self.opt_phi.load_state_dict(payload["opt_phi"])
        if self.ema_lm is not None and payload.get("ema") is not None:
            self.ema_lm.load_state_dict(payload["ema"])
        if payload.get("teacher") is not None:  # a refreshed separate θ̄ (LoRA with one copy: in `trainable`)
            self.teacher.lm.load_state_dict(payload["teacher"])
        torch.set_rng_state(payload["rng_torch"])
        self.state = DistillState(**payload["state"])

    def check_steps(self, total: int) -> None:
        """A resumed checkpoint past the `total` steps asked for would pass its student off as a shorter run's."""
        if self.state.step > total:
            self._mismatch(f"{self.checkpoint_path()}: the checkpoint is at step {self.state.step}, past the "
                           f"{total} steps asked for (lopd.steps)",
                           fix=f"set lopd.steps to {self.state.step} or more to keep it")

    def _mismatch(self, message: str, details: list[str] = (), fix: str = "") -> None:
        """Refuse a resume that would mix two runs, or (lopd.resume_mismatch: warn) say so and go on."""
        text = message + "".join(f"\n  {d}" for d in details) + ("\n" if details else "; ")
        if self.cfg.resume_mismatch == "error":
            fixes = [f for f in (fix, START_OVER) if f]
            raise CheckpointError(f"{text}{', '.join(fixes)}, or set lopd.resume_mismatch=warn to resume anyway")
        self.log(f"distill: warning: {text}resuming anyway (lopd.resume_mismatch=warn)")


def _write_rows(path: Path, columns: list[str], rows: list[dict]) -> None:
    """Rewrite the CSV with `rows` (atomic), so a resumed run never duplicates or loses a step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    try:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            for r in rows:
                writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputPathError(f"cannot write the training curves {path}: {output_reason(exc)}") from None


DIVERGENCE_WINDOW = 20  # steps of reverse KL the alert compares against
DIVERGENCE_FACTOR = 10.0  # a KL this many times its recent median is a teacher pushed away, not a learning one


def margin_by_divergence(recent_kl: list[float], kl: float, delta: float, margin: float) -> bool:
    """Does this step meet δ̄ ≥ m only because the composer pushed the teacher away from the student?

    With most trajectories failing, A(τ) < 0 on most of the batch, and any teacher that differs from the student
    scores the student's own samples lower, so δ̄ rises with the reverse KL alone (README, "The privileged
    margin, β and `lopd.advantage`"). The sign of it: the margin met while the KL jumps to many times its recent
    median. Needs a full window of history, so the first steps (KL still falling from φ0) never alert.
    """
    if len(recent_kl) < DIVERGENCE_WINDOW or margin <= 0 or delta < margin:
        return False
    typical = sorted(recent_kl[-DIVERGENCE_WINDOW:])[DIVERGENCE_WINDOW // 2]
    return math.isfinite(kl) and kl > DIVERGENCE_FACTOR * max(typical, 1e-6)


def check_divergence(distiller: Distiller, total_steps: int) -> None:
    """Fail as soon as the skipped updates exceed the allowed share of the whole run's updates (from then on
    the run cannot end under it), before a diverged model is checkpointed or exported."""
    per_step = 2 if any(spec.composer_trainable for spec in distiller._phases) else 1
    allowed = distiller.cfg.max_skipped_share * total_steps * per_step
    skipped = distiller.state.skipped_updates
    if skipped > allowed:
        raise TrainingDiverged(
            f"distill: {skipped} of {distiller.state.step * per_step} updates so far were skipped as non-finite "
            f"(lopd.max_skipped_share={distiller.cfg.max_skipped_share:g} of {total_steps * per_step}): training "
            f"diverged; lower lopd.lr_student / lopd.lr_composer and rerun with --fresh")


def run_distill(distiller: Distiller, *, steps: int | None = None, resume: bool = True,
                stop_after: int | None = None, on_step=None) -> DistillState:
    """Train to `steps` (default lopd.steps; more draws further blocks of the task stream, `step_tasks`); resume
    from the last checkpoint when there is one. `stop_after` ends the process early (tests of resumption).
    `on_step(distiller, result)` runs after each step, before its checkpoint (the growing bank's refresh)."""
    cfg = distiller.cfg
    total = steps or cfg.steps
    if resume and distiller.load_checkpoint():
        distiller.check_steps(total)
        distiller.log(f"distill: resumed at step {distiller.state.step} (β={distiller.state.beta:.3f}"
                      + (f", m={distiller.margin:.4g}" if distiller.margin is not None else "") + ")")
    distiller.price_margin()  # `lopd.margin: auto`, before step 1 (a resumed run keeps the checkpoint's m)
    csv_path = Path(cfg.csv)
    diag_path = csv_path.with_name(csv_path.stem + "_diagnostics.csv")
    history = distiller.state.history
    while distiller.state.step < total:
        out = distiller.step()
        if on_step is not None:
            on_step(distiller, out)
        history.append({"row": out.row, "diagnostics": out.diagnostics})  # (checkpointed: no per-trajectory lists)
        if D.is_main():  # rows are already whole-batch figures, equal on every rank
            _write_rows(csv_path, CSV_COLUMNS, [h["row"] for h in history])
            _write_rows(diag_path, DIAGNOSTIC_COLUMNS, [h["diagnostics"] for h in history])
        r = out.row
        distiller.log(f"distill: step {r['step']}/{total} reward {r['reward_mean']:.3f} success "
                      f"{r['success_rate']:.3f} loss {r['distill_loss']:.4f} δ̄ {r['delta']:+.4f} β {r['beta']:.3f} "
                      f"({r['step_seconds']:.1f}s)")
        recent = [h["row"]["kl_phi"] for h in history[-DIVERGENCE_WINDOW - 1:-1] if math.isfinite(h["row"]["kl_phi"])]
        if distiller.method.composer_trainable and margin_by_divergence(recent, r["kl_phi"], r["delta"],
                                                                        distiller.margin):
            distiller.log(f"distill: step {r['step']}: warning: δ̄ {r['delta']:.3f} ≥ m = {distiller.margin:.4g} only "
                          f"because the teacher moved away from the student (reverse KL {r['kl_phi']:.3f}, over "
                          f"{DIVERGENCE_FACTOR:g}× its median of the last {DIVERGENCE_WINDOW} steps): the student "
                          "is being distilled toward a worse teacher; lopd.advantage=group removes this incentive "
                          "(DESIGN §3)")
        check_divergence(distiller, total)
        if distiller.state.step % cfg.checkpoint_every == 0 or distiller.state.step == total:
            distiller.save_checkpoint()
        if stop_after is not None and distiller.state.step >= stop_after:
            break
    return distiller.state


def export(distiller: Distiller, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    if D.is_main():  # replicas are identical: one copy on disk
        out.mkdir(parents=True, exist_ok=True)
        export_student(distiller.trainable, distiller.student, distiller.tokenizer, out)
        torch.save(distiller.composer.state_dict(), out.parent / "composer.pt")
    D.barrier()
    return out
