"""`lopd distill`: the LOPD training loop (DESIGN §3), one step at a time, resumable.

`Distiller` owns the models, the optimizers and the run's state; each step function takes what it reads: the
phase's frozen `StepSetup` (the resolved method, the student loss, the knobs it reads) and the `StepModels`
(inputs.py), and the `DistillState` it advances. Per step, in this order (`Distiller.step`, then
`Distiller.update`):
  1. roll out B tasks × G samples with the current student (token in, token out);
  2. retrieve J experiences per task, compose latents c_φ, score the student's tokens with the latent teacher
     and keep its top-k log-probs and ids;
  3. student update: reverse KL(p_S ‖ p_T) on the teacher's top-k + tail (or full / sampled), token mean;
  4. composer update through the frozen teacher: KL(sg[p_S,old] ‖ p_T,φ) + β·(m − δ̄) + λ·anchor;
  5. dual ascent: β ← max(0, β + η_β·(m − δ̄)).

Where each part lives (docs/architecture.md walks one step through them):
  trainer.py          the models, the optimizers, the method's phases, step 1 (rollouts)
  reference.py        steps 2-5 read top to bottom: start reading here; what runs in the simple configuration
  update.py           steps 2-5 with named optimisations (micro-batches, one teacher pass for steps 2 and 4, ...),
                      step 2a (what the teacher reads: latents, text, nothing) among them
  composer_step.py    φ's side of update.py's update, after θ's step: the reading term, the anchor, φ's step
  inputs.py           the step's typed inputs: `StepSetup`, `StepModels`; build.py builds the models
  dashboard.py        the step's row of plots/distill.csv and its diagnostics
  replay.py           `lopd.replay_share`: a share of each step's tasks from earlier worlds, read without experience
  margin_pricing.py   `lopd.margin: auto` priced before (or at) step 1
  checkpoints.py      what a checkpoint holds and when a resume is refused
  loop.py             `run_distill`: steps, CSVs, checkpoints, divergence alarms (it calls the trainer)

Everything a step needs is derived from (seed, step): its tasks are a fixed slice of the training stream and
its sampling generator is seeded by the step, so a run resumed from a checkpoint prints the same numbers as an
uninterrupted one. A non-finite loss or gradient norm skips that update (counted, never applied).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lopd_core import distributed as D
from lopd_core import methods as M
from lopd_core.config import Params
from lopd_core.distill.composer.composer import Composer
from lopd_core.distill.loop import checkpoints as C
from lopd_core.distill.loop import teacher_refresh as R
from lopd_core.distill.loop import trace_source as TS
from lopd_core.distill.loop.build import build_models, check_processes, check_top_k, splice_room
from lopd_core.distill.update import anneal as AN
from lopd_core.distill.update import margin as MG
from lopd_core.distill.update import margin_pricing as P
from lopd_core.distill.update import replay as RP
from lopd_core.distill.update import update as U
from lopd_core.distill.update.dashboard import UpdateResult
from lopd_core.distill.update.inputs import Retriever, StepSetup
from lopd_core.distill.update.reference import reference_update
from lopd_core.distill.update.state import DistillState
from lopd_core.envs import Task
from lopd_core.envs.mix import deployment_tasks
from lopd_core.model.chat import make_chat
from lopd_core.rollout.engine import RolloutRequest, Sampling, ServedBackend, rollout


def sample_seed(seed: int, step: int, task_index: int, sample_index: int) -> int:
    """The sampling seed of one trajectory: a function of where it sits in the run, not of which process or
    batch plays it (a fixed mixing of the four integers into 63 bits)."""
    x = seed
    for v in (step, task_index, sample_index):
        x = (x * 1_000_003 + v + 0x9E3779B97F4A7C15) % (1 << 63)
    return x


class Distiller:
    """Owns the models, optimizers and state of one distillation run, and calls the step's functions with them."""

    def __init__(
        self,
        params: Params,
        base,
        tokenizer,
        retriever: Retriever,
        *,
        composer: Composer,
        method: M.MethodSpec | None = None,
        initial_rollouts: int = 0,
        teacher_base=None,
        pricing: MG.PricingSource | None = None,
        log=print,
    ):
        """`method`: the method resolved once by the distill driver (`methods.resolve_method`); None resolves
        params' own (a Distiller built by hand, as the tests and benchmarks build one)."""
        D.setup()  # joins the process group under `accelerate launch`; a no-op in one process
        check_processes(params.lopd)
        params.lopd.check()  # the rules across keys, also for a section built by hand
        check_top_k(params.lopd, base)
        torch.manual_seed(params.seed)
        self.params, self.cfg = params, params.lopd
        self.log = log if D.is_main() else (lambda *_a, **_k: None)  # one voice, not one per rank
        # The method (LOPD, a baseline or an ablation: methods.py) picks the teacher's context and weights and
        # the student's loss; the rest of the loop is shared by all of them. A two-phase method (lopd_then_grpo)
        # trains `then` from baselines.switch_fraction of lopd.steps on; which phase a step trains is a function
        # of the step (`_enter_phase`), so a resume lands in the right one.
        method = M.resolve_method(self.cfg, params.baselines) if method is None else method
        self.phases = M.method_phases(method, self.cfg, params.baselines)
        self.codec = make_chat(tokenizer)
        self.splice_room = splice_room(params, self.phases, composer.num_queries)
        # lopd.replay_share: a share of each step's tasks from earlier worlds, read without experience (replay.py)
        cfg = self.cfg
        self.replay = RP.ReplayStream(
            params.envs, cfg.replay_worlds, per_step=cfg.replay_per_step, steps=cfg.steps, seed=params.seed
        )
        self.models = build_models(
            params,
            self.phases,
            base,
            tokenizer,
            retriever=retriever,
            composer=composer,
            teacher_base=teacher_base,
            is_replay=self.replay.is_replay,
        )
        self.state = DistillState(beta=self.cfg.beta_init, rollouts=initial_rollouts)
        self._use_phase(0)
        self._task_blocks: dict[int, list[Task]] = {}
        # lopd_gated_refresh: what scores a policy in the held-out check (tests inject a cheaper one)
        self.refresh_scorer: Callable[[Any], R.CheckScore] = self._held_out_score
        self._check_tasks: list[Task] | None = None
        self.pricing = pricing  # what `lopd.margin: auto` is priced on (`price_margin`); None: the first step
        # lopd.trajectories: traces | both: the served traces a step reads (trace_source.py)
        self.traces = (
            None
            if self.cfg.trajectories == "rollouts"
            else TS.TraceStream(self.cfg.traces, params.seed, max_tokens=params.rollout.max_context - self.splice_room)
        )

    # ---- what the step functions read, by name (the models and the phase's setup own them) ------------------
    trainable = property(lambda self: self.models.trainable)
    student = property(lambda self: self.models.student)
    teacher = property(lambda self: self.models.teacher)
    composer = property(lambda self: self.models.composer)
    encoder = property(lambda self: self.models.encoder)
    ema_lm = property(lambda self: self.models.ema)
    opt_theta = property(lambda self: self.models.opt_theta)
    opt_phi = property(lambda self: self.models.opt_phi)
    sharding = property(lambda self: self.models.sharding)
    tokenizer = property(lambda self: self.models.tokenizer)
    method = property(lambda self: self.setup.method)
    student_loss = property(lambda self: self.setup.student_loss)
    teacher_pass = property(lambda self: self.setup.teacher_pass)
    phase = property(lambda self: self.setup.phase)

    @property
    def margin(self) -> float | None:
        """The margin m this run trains with: the method's own (0 for lopd_no_margin), else `lopd.margin`, or with
        `lopd.margin: auto` the priced one (None until `price_margin` or the first step has priced it)."""
        return self.setup.margin(self.state)

    # ---- one step -------------------------------------------------------------------------------------
    def step_tasks(self, step: int) -> list[Task]:
        """Every rank's tasks of `step` (0-based): a fixed slice of the training stream, with the step's replay
        tasks (`lopd.replay_share`, replay.py) spread among them.

        The stream comes in blocks of `lopd.steps` steps, block b drawn with its own seed (block 0 is the
        stream a run of lopd.steps draws); the replay stream likewise, with seeds of its own. A run asked for more
        steps (`run_distill(steps=...)`) thus gets fresh tasks instead of running past the end, and a block is the
        same whatever the run's length, so resuming changes nothing."""
        per_step = self.cfg.tasks_per_step - self.replay.per_step  # fresh tasks of the deployment worlds
        block, within = divmod(step, self.cfg.steps)
        if block not in self._task_blocks:  # envs interleaved: every step draws the mix
            self._task_blocks[block] = deployment_tasks(
                self.params.envs, "train", self.cfg.steps * per_step, self.params.seed + 17 + 1_000_003 * block
            )
        fresh = self._task_blocks[block][within * per_step : (within + 1) * per_step]
        return RP.with_replay(fresh, self.replay.step_tasks(block, within))

    def step(self) -> UpdateResult:
        """One full step: roll out this step's tasks (or take served traces: `lopd.trajectories`,
        trace_source.py), then `update` on the trajectories. The result carries this rank's trajectories
        (`UpdateResult.trajectories`, what a growing bank adds)."""
        cfg = self.cfg
        started = time.perf_counter()
        s = self.state.step
        if self.student_loss.anneal_window and self.state.teacher_level is None:
            self._measure_teacher()  # lopd_rl_annealed: the level its distillation weight is held against
        with self.sharding.gathered():  # rank-dependent numbers of passes from here on (sharding.py)
            if cfg.trajectories != "rollouts":
                out = self._trace_step(started)
            else:
                # Under `accelerate launch` each rank takes its contiguous slice of the step's tasks (all G
                # samples of a task on one rank, so group advantages stay local); `update` reduces across ranks.
                mine = D.shard_range(cfg.tasks_per_step)
                tasks = self.step_tasks(s)[mine.start : mine.stop]
                trajs = self.rollout_tasks(tasks, s * cfg.tasks_per_step + mine.start)
                self.state.rollouts += cfg.tasks_per_step * cfg.samples_per_task  # every rank's, not only this one's
                out = self.update(tasks, trajs, started=started)
                # replayed tasks are not the deployment world's experience: they never join a growing bank
                out.trajectories = [t for t in out.trajectories if not self.replay.is_replay(t.task)]
        if self.method.teacher.refresh == "gated" and self.state.step % self.params.baselines.refresh_check_every == 0:
            self._refresh_check(out)  # (never sharded: build.shard refuses a gated refresh)
        return out

    def _trace_step(self, started: float) -> UpdateResult:
        """Steps 1-5 with the step's served traces in place of (some of) its rollouts (trace_source.py). Every
        trajectory, rolled out or read from a trace, is charged to `rollouts`; under `accelerate launch` each rank
        takes its contiguous slice of the rolled-out tasks and of the traces. The batch is read as groups of one."""
        cfg, s = self.cfg, self.state.step
        self.traces.check_tokenizer(self.tokenizer)  # before any rollout or update is spent (once per stream)
        n_traces = TS.trace_count(cfg.tasks_per_step, cfg.samples_per_task, cfg.trajectories)
        rolled = cfg.tasks_per_step - n_traces // cfg.samples_per_task  # tasks rolled out (0 with `traces`)
        mine = D.shard_range(rolled)
        tasks = self.step_tasks(s)[mine.start : mine.stop] if rolled else []
        trajs = self.rollout_tasks(tasks, s * cfg.tasks_per_step + mine.start) if tasks else []
        theirs = D.shard_range(n_traces)
        served = self.traces.take(s, n_traces)[theirs.start : theirs.stop]
        per_trajectory = [t for t in tasks for _ in range(cfg.samples_per_task)] + [t.task for t in served]
        self.state.rollouts += cfg.tasks_per_step * cfg.samples_per_task  # traces are charged as rollouts
        return self.update(per_trajectory, trajs + served, started=started, group_size=1)

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
        sampling = self.rollout_sampling(served=ServedBackend.from_settings(ro))
        return rollout(
            self.student,
            self.codec,
            requests,
            sampling=sampling,
            batch_size=ro.batch_size,
            seed=self.params.seed * 1_000_003 + s,
            seeds=seeds,
        )

    def update(
        self, tasks: list[Task], trajs: list, *, started: float | None = None, group_size: int | None = None
    ) -> UpdateResult:
        """Steps 2-5 on trajectories of `tasks` (samples_per_task each, in task order; `group_size` 1: a batch
        holding served traces, each its own group). The simple configuration runs reference.py's update, any
        other update.py's, the same update with named optimisations (`StepSetup.runs_reference`). Also what
        benchmarks/step_cost.py times against a plain policy-gradient update."""
        started = time.perf_counter() if started is None else started
        self._enter_phase()
        setup = self.setup if group_size is None else replace(self.setup, samples_per_task=group_size)
        run = reference_update if setup.runs_reference else U.update
        with self.sharding.gathered():
            return run(setup, self.models, self.state, tasks, trajs, started=started, log=self.log)

    # ---- the margin priced (`lopd.margin: auto`, margin_pricing.py) ------------------------------------
    def price_margin(self) -> None:
        with self.sharding.gathered():
            P.price_margin(self.setup, self.models, self.state, self.pricing, self.log)

    # ---- beyond the teacher's ceiling: phases and the gated teacher refresh (methods.py) -----------------
    def _use_phase(self, index: int) -> None:
        self.setup = StepSetup.of(
            self.params, self.phases[index], index, splice_room=self.splice_room, processes=D.world_size()
        )

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

    def rollout_sampling(self, *, served) -> Sampling:
        """The rollouts' sampling (the `rollout` section), room left for the latents' splice; `served`: the
        OpenAI-compatible backend that plays them, None in-process."""
        ro = self.params.rollout
        return Sampling(
            temperature=ro.temperature,
            top_p=ro.top_p,
            max_new_tokens=ro.max_new_tokens,
            max_context=ro.max_context - self.splice_room,
            max_observation_tokens=ro.max_observation_tokens,
            served=served,
        )

    def _measure_teacher(self) -> None:
        """lopd_rl_annealed: the latent teacher plays `baselines.anneal_check_n` train-split tasks once, sampled
        as the rollouts are (anneal.py); its episodes are counted apart from the training rollouts."""
        tasks = deployment_tasks(
            self.params.envs, "train", self.params.baselines.anneal_check_n, self.params.seed + R.REFRESH_SEED_OFFSET
        )
        sampling = self.rollout_sampling(served=None)  # the teacher plays in-process, with its latents
        with self.sharding.gathered():
            self.state.teacher_level = AN.teacher_level(self.models, tasks, sampling, seed=self.params.seed)
        self.state.check_episodes += len(tasks)
        self.log(
            f"distill: the latent teacher's level (anneal): success {self.state.teacher_level:.3f} on "
            f"{len(tasks)} train tasks"
        )

    def _held_out_score(self, lm) -> R.CheckScore:
        """The refresh check's score of `lm`: greedy, no experience, on the check's fixed train-split tasks."""
        if self._check_tasks is None:
            self._check_tasks = R.check_tasks(self.params)
        self.state.check_episodes += len(self._check_tasks)
        return R.greedy_score(lm, self.codec, self._check_tasks, self.params.rollout, seed=self.params.seed)

    def _refresh_check(self, out: UpdateResult) -> None:
        R.refresh_check(self.models, self.state, self.params.baselines, self.refresh_scorer, out, log=self.log)

    # ---- checkpoints (checkpoints.py) -------------------------------------------------------------------
    def checkpoint_path(self) -> Path:
        return Path(self.cfg.out_dir) / "checkpoint.pt"

    def save_checkpoint(self) -> Path:
        return C.save_checkpoint(self.models, self.state, self.params, self.checkpoint_path())

    def load_checkpoint(self) -> bool:
        state = C.load_checkpoint(self.models, self.params, self.checkpoint_path(), self.log)
        if state is not None:
            self.state = state
        return state is not None

    def check_steps(self, total: int) -> None:
        C.check_steps(self.state, total, self.checkpoint_path(), self.cfg.resume_mismatch, self.log)
