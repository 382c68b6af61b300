"""`lopd distill`: the LOPD training loop (DESIGN §3), one step at a time, resumable.

Per step, in this order (`Distiller.step`, then `Distiller.update`):
  1. roll out B tasks × G samples with the current student (token in, token out);
  2. retrieve J experiences per task, compose latents c_φ, score the student's tokens with the latent teacher
     and keep its top-k log-probs and ids;
  3. student update: reverse KL(p_S ‖ p_T) on the teacher's top-k + tail (or full / sampled), token mean;
  4. composer update through the frozen teacher: KL(sg[p_S,old] ‖ p_T,φ) + β·(m − δ̄) + λ·anchor;
  5. dual ascent: β ← max(0, β + η_β·(m − δ̄)).

Where each part lives:
  trainer.py          the models, the optimizers, the method's phases, step 1 (rollouts)
  reference.py        steps 2-5 read top to bottom, without the optimisations: start reading here
  update.py           steps 2-5 as run: micro-batches, one teacher pass shared by steps 2 and 4, low memory
  teacher_context.py  step 2a: what the teacher reads (latents, text, nothing) and with which weights
  dashboard.py        the step's row of plots/distill.csv and its diagnostics
  margin_pricing.py   `lopd.margin: auto` priced before (or at) step 1
  checkpoints.py      what a checkpoint holds and when a resume is refused
  loop.py             `run_distill`: steps, CSVs, checkpoints, divergence alarms

Everything a step needs is derived from (seed, step): its tasks are a fixed slice of the training stream and
its sampling generator is seeded by the step, so a run resumed from a checkpoint prints the same numbers as an
uninterrupted one. A non-finite loss or gradient norm skips that update (counted, never applied).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lopd_core import distributed as D
from lopd_core import methods as M
from lopd_core import sharding as SH
from lopd_core.config import ConfigError, Params
from lopd_core.distill import baselines as B
from lopd_core.distill import checkpoints as C
from lopd_core.distill import composer as CP
from lopd_core.distill import losses as L  # noqa: F401  re-exported: tests patch the losses through it
from lopd_core.distill import margin as MG
from lopd_core.distill import margin_pricing as P
from lopd_core.distill import step as S
from lopd_core.distill import teacher_refresh as R
from lopd_core.distill import trace_source as TS
from lopd_core.distill import update as U
from lopd_core.distill.checkpoints import (  # noqa: F401  re-exported
    RESUME_FREE,
    RESUME_SETTINGS,
    CheckpointError,
    DistillState,
    plain_data,
    read_checkpoint,
    resume_settings,
    settings_differences,
)
from lopd_core.distill.composer import Composer, ExperienceEncoder, compose_latents, mean_embedding_norm
from lopd_core.distill.dashboard import CSV_COLUMNS, DIAGNOSTIC_COLUMNS, ComposerStep, DashboardRow  # noqa: F401
from lopd_core.distill.loop import (  # noqa: F401  re-exported
    DIVERGENCE_FACTOR,
    DIVERGENCE_WINDOW,
    check_divergence,
    export,
    margin_by_divergence,
    run_distill,
)
from lopd_core.distill.loop import write_rows as _write_rows  # noqa: F401  re-exported
from lopd_core.distill.models import make_student_and_teacher
from lopd_core.distill.step import UpdateResult, chunk_group, micro_batches
from lopd_core.distill.teacher import Framing
from lopd_core.distill.teacher_context import TeacherContext  # noqa: F401  re-exported
from lopd_core.envs import Task
from lopd_core.envs.mix import deployment_tasks
from lopd_core.errors import TrainingDiverged  # noqa: F401  re-exported: callers catch it from here
from lopd_core.model.chat import make_chat
from lopd_core.rollout.engine import RolloutRequest, Sampling, ServedBackend, rollout

Retriever = Callable[[list[Task]], list[list[str]]]  # tasks -> experience texts per task


def load_composer(path: str | Path, model, cfg) -> Composer:
    """φ of the composer section (`cfg`) for `model`, loaded from `path`; a fresh one when there is no file (a
    method whose teacher reads no latents still owns a composer, unused)."""
    composer = CP.build_composer(cfg, model)
    if path and Path(path).exists():
        CP.load_weights(composer, path)
    return composer


def check_top_k(lopd, model) -> None:
    """lopd.top_k against the model's vocabulary: checked as soon as the model is loaded (`run_lopd`), before
    anything else could fail first and hide the setting behind another error."""
    vocab = model.get_output_embeddings().weight.shape[0]
    if lopd.student_loss == "topk" and lopd.top_k >= vocab:
        raise ConfigError(
            f"lopd.top_k: got {lopd.top_k}, expected fewer than the model's vocabulary "
            f"({vocab}); for the whole distribution set lopd.student_loss=full"
        )


def sample_seed(seed: int, step: int, task_index: int, sample_index: int) -> int:
    """The sampling seed of one trajectory: a function of where it sits in the run, not of which process or
    batch plays it (a fixed mixing of the four integers into 63 bits)."""
    x = seed
    for v in (step, task_index, sample_index):
        x = (x * 1_000_003 + v + 0x9E3779B97F4A7C15) % (1 << 63)
    return x


def splice_room(params: Params, phases, num_queries: int) -> int:
    """Positions the teacher splices into a trajectory (its latents and their frame), reserved in the student's
    rollouts so that no teacher pass reads more than rollout.max_context (text contexts are cut to fit)."""
    room = max(3 + params.bank.top_j * num_queries if m.needs_composer else 0 for m in phases)
    if params.rollout.max_context - room < params.rollout.max_new_tokens + 1:
        raise ConfigError(
            f"rollout.max_context: got {params.rollout.max_context}, expected more than the "
            f"teacher's {room} spliced positions (bank.top_j × composer.num_queries + 3) "
            f"plus rollout.max_new_tokens ({params.rollout.max_new_tokens})"
        )
    return room


class Distiller:
    """Holds the models, optimizers and state of one distillation run."""

    def __init__(
        self,
        params: Params,
        base,
        tokenizer,
        retriever: Retriever,
        *,
        composer: Composer,
        initial_rollouts: int = 0,
        teacher_base=None,
        pricing: MG.PricingSource | None = None,
        log=print,
    ):
        D.setup()  # joins the process group under `accelerate launch`; a no-op in one process
        if D.world_size() > params.lopd.tasks_per_step:
            raise ValueError(
                f"lopd.tasks_per_step: got {params.lopd.tasks_per_step}, expected at least the "
                f"number of processes ({D.world_size()}): every rank needs a task per step"
            )
        params.lopd.check()  # the rules across keys, also for a section built by hand
        check_top_k(params.lopd, base)
        torch.manual_seed(params.seed)
        self.params, self.cfg = params, params.lopd
        self.log = log if D.is_main() else (lambda *_a, **_k: None)  # one voice, not one per rank
        # The method (LOPD, a baseline or an ablation: methods.py) picks the teacher's context and weights and
        # the student's loss; the rest of the loop is shared by all of them. Resolved once: its margin and
        # anchor weight are the ones this run trains with (and the reports draw). A two-phase method
        # (lopd_then_grpo) trains `then` from baselines.switch_fraction of lopd.steps on; which phase a step
        # trains is a function of the step (`_enter_phase`), so a resume lands in the right one.
        self.phases = M.method_phases(M.resolve_method(self.cfg, params.baselines), self.cfg, params.baselines)
        self._use_phase(0)
        self._low_memory = self.cfg.low_memory  # trade compute for peak memory (update.py); fixed for the run
        self.codec, self.tokenizer, self.framing = make_chat(tokenizer), tokenizer, Framing.from_tokenizer(tokenizer)
        self._build_models(base, composer, teacher_base)
        self.retriever = retriever
        self.state = DistillState(beta=self.cfg.beta_init, rollouts=initial_rollouts)
        self._task_blocks: dict[int, list[Task]] = {}
        # lopd_gated_refresh: what scores a policy in the held-out check (tests inject a cheaper one)
        self.refresh_scorer: Callable[[Any], R.CheckScore] = self._held_out_score
        self._check_tasks: list[Task] | None = None
        self.pricing = pricing  # what `lopd.margin: auto` is priced on (`price_margin`); None: the first step
        self.splice_room = splice_room(params, self.phases, composer.num_queries)
        # lopd.trajectories: traces | both: the served traces a step reads (trace_source.py)
        self.traces = (
            None
            if self.cfg.trajectories == "rollouts"
            else TS.TraceStream(self.cfg.traces, params.seed, max_tokens=params.rollout.max_context - self.splice_room)
        )

    def _build_models(self, base, composer: Composer, teacher_base) -> None:
        """θ (the student), θ̄ (the frozen teacher; `teacher_base`: other weights than the student's start, as
        `lopd cycle` with cycle.refresh_teacher false keeps the first base), φ and φ0, and their optimizers."""
        self.trainable, self.student, self.teacher = make_student_and_teacher(
            base, mode=self.cfg.student_mode, lora_rank=self.cfg.lora_rank, teacher=teacher_base
        )
        self.encoder = ExperienceEncoder(
            self.teacher, self.tokenizer, max_tokens=self.params.composer.max_experience_tokens
        )
        self.composer = composer.train().requires_grad_(self.method.composer.trainable)
        if composer.encoder_lora is not None:  # fixed here: the encoder's states are cached (encoder_lora.py)
            composer.encoder_lora.requires_grad_(False)
        self.ema_lm = B.ema_copy(self.student) if self.method.teacher.weights == "ema" else None
        self.anchor_composer = copy.deepcopy(composer).eval().requires_grad_(False)  # φ0, fixed
        self._anchor_cache: dict[tuple[str, str], torch.Tensor] = {}  # (query, experience) -> φ0's (K, D) latents
        self.embedding_norm = mean_embedding_norm(self.student)
        self.sharding = self._shard()  # before the optimizer: it must hold the sharded parameters
        self.opt_theta = torch.optim.AdamW(
            [p for p in self.trainable.parameters() if p.requires_grad], lr=self.cfg.lr_student, weight_decay=0.0
        )
        self.opt_phi = torch.optim.AdamW(self.composer.parameters(), lr=self.cfg.lr_composer, weight_decay=0.0)

    def _shard(self) -> SH.Sharding:
        """`lopd.sharding: fsdp2`: the student's causal LM and a separate teacher copy sharded (sharding.py)."""
        if self.cfg.sharding == "none":
            return SH.Sharding([])
        unsupported = [m.name for m in self.phases if m.teacher.weights == "ema" or m.teacher.refresh == "gated"]
        if unsupported:
            raise ConfigError(
                f"lopd.sharding: got 'fsdp2' with lopd.method={self.cfg.method!r}, expected 'none': "
                f"the teacher of {', '.join(unsupported)} copies the student's weights, which a "
                "sharded student does not hold whole"
            )
        ro = self.params.rollout
        if ro.backend == "openai" and ro.sync == "reload":
            raise ConfigError(
                "lopd.sharding: got 'fsdp2' with rollout.backend='openai' and rollout.sync='reload', "
                "expected 'none': the reload saves the student whole from one process, which a "
                "sharded student is not (rollout.sync=none keeps the servers' weights as they are)"
            )
        SH.setup()
        teacher = [] if self.teacher.adapter_owner is not None else SH.shard_lm(self.teacher.lm)
        return SH.Sharding(SH.shard_lm(self.student), teacher)

    @property
    def margin(self) -> float | None:
        """The margin m this run trains with: the method's own (0 for lopd_no_margin), else `lopd.margin`, or with
        `lopd.margin: auto` the priced one (None until `price_margin` or the first step has priced it)."""
        own = self.method.composer.margin
        return own if own is not None else self.state.margin

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
            self._task_blocks[block] = deployment_tasks(
                self.params.envs, "train", self.cfg.steps * per_step, self.params.seed + 17 + 1_000_003 * block
            )
        return self._task_blocks[block][within * per_step : (within + 1) * per_step]

    def step(self) -> UpdateResult:
        """One full step: roll out this step's tasks (or take served traces: `lopd.trajectories`,
        trace_source.py), then `update` on the trajectories. The result carries this rank's trajectories
        (`UpdateResult.trajectories`, what a growing bank adds)."""
        cfg = self.cfg
        started = time.perf_counter()
        s = self.state.step
        with self.sharding.gathered():  # rank-dependent numbers of passes from here on (sharding.py)
            if cfg.trajectories != "rollouts":
                out = TS.trace_step(self, started)
            else:
                # Under `accelerate launch` each rank takes its contiguous slice of the step's tasks (all G
                # samples of a task on one rank, so group advantages stay local); `update` reduces across ranks.
                mine = D.shard_range(cfg.tasks_per_step)
                tasks = self.step_tasks(s)[mine.start : mine.stop]
                trajs = self.rollout_tasks(tasks, s * cfg.tasks_per_step + mine.start)
                self.state.rollouts += cfg.tasks_per_step * cfg.samples_per_task  # every rank's, not only this one's
                out = self.update(tasks, trajs, started=started)
        if self.method.teacher.refresh == "gated" and self.state.step % self.params.baselines.refresh_check_every == 0:
            self._refresh_check(out)  # (never sharded: `_shard` refuses a gated refresh)
        return out

    def rollout_tasks(self, tasks: list[Task], first: int) -> list:
        """1. Rollouts of `tasks` × G with the current student; `first` is the first task's index in the stream.
        Each trajectory's sampling stream is seeded by (seed, step, task index in the stream, sample), so any
        number of ranks samples what one process samples."""
        cfg, ro, s = self.cfg, self.params.rollout, self.state.step
        requests = [RolloutRequest(t, sample_index=g) for t in tasks for g in range(cfg.samples_per_task)]
        seeds = [
            sample_seed(self.params.seed, s, first + i // cfg.samples_per_task, i % cfg.samples_per_task)
            for i in range(len(requests))
        ]
        sampling = Sampling(
            temperature=ro.temperature,
            top_p=ro.top_p,
            max_new_tokens=ro.max_new_tokens,
            max_context=ro.max_context - self.splice_room,
            max_observation_tokens=ro.max_observation_tokens,
            served=ServedBackend.from_settings(ro),
        )
        return rollout(
            self.student,
            self.codec,
            requests,
            sampling=sampling,
            batch_size=ro.batch_size,
            seed=self.params.seed * 1_000_003 + s,
            seeds=seeds,
        )

    def update(self, tasks: list[Task], trajs: list, *, started: float | None = None) -> UpdateResult:
        """Steps 2-5 on trajectories of `tasks` (samples_per_task each, in task order), as update.py runs them
        (reference.py is the same update without the optimisations). Also what benchmarks/step_cost.py times
        against a plain policy-gradient update."""
        started = time.perf_counter() if started is None else started
        self._enter_phase()
        with self.sharding.gathered():
            return U.update(self, tasks, trajs, started=started)

    # ---- the margin priced (`lopd.margin: auto`, margin_pricing.py) ------------------------------------
    def price_margin(self) -> None:
        with self.sharding.gathered():
            P.price_margin(self)

    def price_on_batch(self, batch: S.RolloutBatch, sums: S.StepSums) -> None:
        P.price_on_batch(self, batch, sums)

    # ---- beyond the teacher's ceiling: phases and the gated teacher refresh (methods.py) -----------------
    def _use_phase(self, index: int) -> None:
        self.phase = index
        self.method = self.phases[index]
        self.student_loss = S.StudentLoss.resolve(self.method, self.cfg, self.params.baselines)
        self.teacher_pass = self.method.needs_teacher_pass

    def _enter_phase(self) -> None:
        """Train this step's phase (`methods.phase_at`): from the switch on, `lopd_then_grpo` trains GRPO on the
        same student — its loss, its teacher (none: no teacher pass without a reference KL) and no composer step.
        A function of the step, so a run resumed past the switch is in the second phase from its first step."""
        index = M.phase_at(self.phases[0], self.state.step, self.cfg, self.params.baselines)
        if index == self.phase:
            return
        self._use_phase(index)
        self.log(
            f"distill: step {self.state.step + 1}: phase {index}: {self.phases[0].name} trains "
            f"{self.method.name} from here (baselines.switch_fraction={self.params.baselines.switch_fraction:g})"
        )

    def _held_out_score(self, lm) -> R.CheckScore:
        """The refresh check's score of `lm`: greedy, no experience, on the check's fixed train-split tasks."""
        if self._check_tasks is None:
            self._check_tasks = R.check_tasks(self.params)
        self.state.check_episodes += len(self._check_tasks)
        return R.greedy_score(lm, self.codec, self._check_tasks, self.params.rollout, seed=self.params.seed)

    def _refresh_check(self, out: UpdateResult) -> None:
        R.refresh_check(self, out)

    # ---- helpers --------------------------------------------------------------------------------------
    def _composer_chunks(self, n_chunks: int) -> set[int]:
        """Which chunks train the composer this step (`lopd.composer_fraction`), seeded by (seed, step)."""
        return S.composer_chunks(n_chunks, self.cfg.composer_fraction, self.params.seed * 1_000_003 + self.state.step)

    def _chunks(self, ids: list[list[int]]) -> list[list[int]]:
        return micro_batches(
            [len(i) for i in ids], self.cfg.micro_batch, chunk_group(self.cfg.samples_per_task, self.cfg.share_prompt)
        )

    def queries_of(self, tasks: list[Task]) -> list[str] | None:
        """What φ reads in front of each task's experiences: its instruction for a query-conditioned composer,
        else None (composer.py)."""
        return [t.instruction for t in tasks] if self.composer.reads_query else None

    def anchor_latents(self, experiences: list[list[str]], queries: list[str] | None = None) -> list[torch.Tensor]:
        """c_φ0 per task, from φ0's latents cached per experience (and query: `queries_of`; φ0 never changes in a
        run)."""
        units = [(q, t) for q, texts in zip(queries or [""] * len(experiences), experiences) for t in texts]
        missing = list(dict.fromkeys(u for u in units if u not in self._anchor_cache))
        if missing:
            with torch.no_grad():
                fresh = compose_latents(
                    self.anchor_composer,
                    self.encoder,
                    [[t] for _, t in missing],
                    None if queries is None else [q for q, _ in missing],
                )
            self._anchor_cache.update(zip(missing, fresh))
        width = self.composer.proj_out.out_features
        out, start = [], 0
        for texts in experiences:
            rows = [self._anchor_cache[u] for u in units[start : start + len(texts)]]
            out.append(torch.cat(rows) if rows else torch.zeros((0, width)))
            start += len(texts)
        return out

    def clear_anchor_cache(self) -> None:
        """φ0's latents are of the teacher base's encodings: dropped when a refresh replaces the base."""
        self._anchor_cache.clear()

    # ---- checkpoints (checkpoints.py) -------------------------------------------------------------------
    def checkpoint_path(self) -> Path:
        return Path(self.cfg.out_dir) / "checkpoint.pt"

    def save_checkpoint(self) -> Path:
        return C.save_checkpoint(self, self.checkpoint_path())

    def load_checkpoint(self) -> bool:
        return C.load_checkpoint(self, self.checkpoint_path())

    def check_steps(self, total: int) -> None:
        C.check_steps(self, total)
