"""Settings of distillation (`lopd`) and of the baselines and controls `lopd.method` selects (`baselines`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lopd_core.methods import (
    FORWARD_KL_METHODS,
    KL_MIX_METHODS,
    METHOD_NAMES,
    METHODS,
    POLICY_GRADIENT_METHODS,
    SAMPLED_KL_METHODS,
)
from lopd_core.settings.checks import (
    CYCLE_REPLAY_SHARE,
    MARGIN_AUTO,
    REPLAY_AUTO,
    Check,
    ConfigError,
    any_of,
    fraction,
    in_range,
    margin_value,
    non_negative,
    one_of,
    positive,
    replay_value,
)
from lopd_core.settings.envs import NAMED_WORLDS
from lopd_core.settings.fields import Section, setting

# The rules across keys read the method's row (methods.py imports nothing of the library, so the configuration
# reads it without loading the trainer); the table's method families are re-exported as lopd_core.config names.
__all__ = [
    "FORWARD_KL_METHODS",
    "KL_MIX_METHODS",
    "MARGIN_AUTO",
    "POLICY_GRADIENT_METHODS",
    "SAMPLED_KL_METHODS",
    "BaselinesConfig",
    "LopdConfig",
]


@dataclass(frozen=True)
class LopdConfig(Section):
    """Distillation: student θ, composer φ, dual ascent of β. Its rollouts sample as the `rollout` section says."""

    SECTION = "lopd"

    # The default keeps the cold-start composer (φ = φ0): on the embedded testbed training φ online did not beat it
    # (docs/results.md); `lopd` trains φ as the paper does.
    method: str = setting(
        "lopd_frozen_composer",
        check=Check(lambda v: v in METHODS, "one of " + ", ".join(map(repr, METHOD_NAMES))),  # a row is a method
        help="what the loop trains (lopd_core/methods.py): LOPD, a baseline or an ablation; "
        "lopd_frozen_composer keeps φ = φ0, lopd trains φ as the paper does. One of: " + " | ".join(METHOD_NAMES),
    )
    steps: int = setting(64, help="training steps", check=positive())
    tasks_per_step: int = setting(8, help="B: tasks rolled out per step", check=positive())
    samples_per_task: int = setting(4, help="G: samples per task", check=positive())
    replay_share: float | str = setting(
        REPLAY_AUTO,
        check=replay_value(),
        help="share of each step's tasks replayed from earlier worlds (round(share × tasks_per_step) tasks: training "
        "tasks of the pretraining worlds and of lopd.replay_worlds): there the teacher reads no experience, so the "
        "student keeps the frozen teacher base's behaviour (lopd_core/distill/update/replay.py); 0: off; auto: "
        f"{CYCLE_REPLAY_SHARE:g} in `lopd cycle` where its steps roll out toolworld tasks (continual cycles keep "
        "earlier worlds; chosen by measurement, docs/results.md), 0 in a single run or a comparison",
    )
    replay_worlds: list[str] = setting(
        factory=list,
        check=any_of(*NAMED_WORLDS),
        help="earlier deployment worlds replayed beside the pretraining worlds (lopd.replay_share > 0); `lopd cycle` "
        "adds every world an earlier cycle deployed to",
    )
    student_mode: str = setting(
        "full",
        help="full | lora (the teacher is the same weights with the adapter disabled)",
        check=one_of("full", "lora"),
    )
    lora_rank: int = setting(8, help="LoRA rank (student_mode: lora)", check=positive())
    lr_student: float = setting(3e-4, help="the student's learning rate", check=in_range(0.0, 1.0, open_low=True))
    lr_composer: float = setting(
        1e-4,
        help="the composer's learning rate: small, since a large one erases what φ0's latents carry within a short run",
        check=in_range(0.0, 1.0, open_low=True),
    )
    student_loss: str = setting(
        "topk",
        help="topk (teacher's top-k plus a tail bucket) | full (whole vocabulary) | sampled (the sampled token)",
        check=one_of("topk", "full", "sampled"),
    )
    top_k: int = setting(20, help="k of the teacher's top-k kept between phases", check=positive())
    kl_mix: float = setting(
        0.0,
        check=fraction(),
        help="w of the top-k loss (1 − w)·KL(p_S ‖ p_T) + w·KL(p_T ‖ p_S): 0 is the pure reverse KL (the paper's); "
        "left at 0, lopd_mixed_kl takes 0.5 and lopd_forward_kl 1",
    )
    importance_weight: bool = setting(
        False,
        help="truncated importance weight min(p_S / p_sample, importance_cap) on the sampled-token reverse "
        "KL (student_loss: sampled; Skill-SD's KL), for rollouts at temperature != 1 or top-p < 1",
    )
    importance_cap: float = setting(2.0, help="the importance weight's cap", check=positive())
    margin: float | str = setting(
        MARGIN_AUTO,
        check=margin_value(),
        help="m of the constraint δ̄ ≥ m, in nats per action token; auto: priced before the first step as "
        "margin_fraction × the gap log p_T,φ0 − log p_S on the bank's seed successes (0 if none), kept on resume; "
        "a method's own margin still wins (lopd_no_margin: 0)",
    )
    margin_fraction: float = setting(
        0.5, help="margin: auto only: the share of that gap m asks for", check=in_range(0.0, 1.0, open_low=True)
    )
    anchor_weight: float = setting(0.2, help="λ: pull of the latents toward φ0's", check=non_negative())
    text_kl_weight: float = setting(
        1.0,
        help="w of the composer's reading term w·KL(p_text || p_latent) beside the margin (lopd_core/distill/"
        "reading.py): φ keeps reading the growing bank as the text does; acts only where φ trains; 0: the paper's "
        "loss",
        check=non_negative(),
    )
    text_kl_rows: int = setting(
        8,
        help="trajectories per step the reading term is computed on (the first sample of each task)",
        check=positive(),
    )
    beta_lr: float = setting(0.5, help="η_β: step of β's dual ascent", check=non_negative())
    beta_init: float = setting(0.0, help="β_0", check=non_negative())
    advantage: str = setting(
        "continuous",
        check=one_of("continuous", "binary", "group"),
        help="A(τ) in δ: continuous (2r − 1, the paper's) | binary (success ±1) | group (r − the group's mean). "
        "continuous and binary give failures A < 0, so a mostly-failed batch lets the composer raise δ̄ by pushing "
        "the teacher off the student's failures (delta_failure in plots/distill.csv shows it); with group A sums to "
        "0 per task",
    )
    max_grad_norm: float = setting(1.0, help="gradient clipping", check=positive())
    micro_batch: int = setting(
        8,
        check=non_negative(),
        help="trajectories per forward/backward chunk, gradients accumulated to the whole batch's (0: the whole "
        "batch at once); only memory and speed depend on it",
    )
    composer_fraction: float = setting(
        1.0,
        check=fraction(),
        help="share of chunks whose teacher pass trains the composer (the rest are scored without a graph and "
        "still count in δ̄): an unbiased, noisier gradient for a cheaper step",
    )
    share_prompt: bool = setting(
        True,
        help="the teacher runs each task's prompt and latents once for its G samples "
        "(exact; false: every row from its first token)",
    )
    low_memory: bool = setting(
        False,
        help="trade compute for peak memory: s_old from an extra no-grad student "
        "forward, each teacher pass consumed at once (same gradients)",
    )
    teacher_micro_batch: int = setting(
        0,
        help="low_memory only: trajectories per teacher pass inside a chunk (0: the whole chunk)",
        check=non_negative(),
    )
    sharding: str = setting(
        "none",
        help="none (every rank holds full replicas) | fsdp2 (student and teacher "
        "weights, gradients and optimizer state sharded over ranks between steps; "
        "docs/scaling.md)",
        check=one_of("none", "fsdp2"),
    )
    checkpoint_every: int = setting(10, help="steps between checkpoints", check=positive())
    max_skipped_share: float = setting(
        0.25, help="more updates skipped as non-finite than this share: the stage fails as diverged", check=fraction()
    )
    resume_mismatch: str = setting(
        "error",
        help="a checkpoint made under other settings: error (refused; --fresh starts over) or warn (resumed)",
        check=one_of("error", "warn"),
    )
    trajectories: str = setting(
        "rollouts",
        check=one_of("rollouts", "traces", "both"),
        help="where a step's B×G trajectories come from: rollouts (the student samples them) | traces (the labeled "
        "served traces at lopd.traces, a seeded slice per step; each trace its own task) | both (the first half "
        "of the step's tasks rolled out, the other half's B×G/2 trajectories taken from the traces); traces are "
        "charged as rollouts",
    )
    traces: str = setting(
        "",
        help="served traffic the cycle learns from: a `lopd serve` store folder or its "
        "snapshot parquet file (read when lopd.trajectories or lopd.bank_source names traces)",
    )
    bank_source: str = setting(
        "rollouts",
        check=one_of("rollouts", "traces", "both"),
        help="what `lopd bank` adds (`lopd bank --source`): the successes of fresh rollouts | the labeled successes "
        "among the traces at lopd.traces (every trace charged as a rollout) | both",
    )
    out_dir: str = setting("data/lopd", help="student, composer and checkpoint")
    csv: str = setting("plots/distill.csv", help="one row per training step")

    def check(self) -> None:
        """Rules across keys: each key's own range is its field's."""
        student = METHODS[self.method].student  # the method's row says what its loss is (methods.py)
        sampled_kl = student.adds_sampled_kl or (student.distills and self.student_loss == "sampled")
        if self.importance_weight and not sampled_kl:
            why = (
                "GRPO's clipped ratio is already taken against the sampling log-probs"
                if not student.distills
                else f"lopd.student_loss={self.student_loss!r} is the exact KL at each visited state, which does not "
                "depend on the sampled token, so its ratio corrects nothing"
            )
            raise ConfigError(
                f"lopd.importance_weight: got true with lopd.method={self.method!r} and "
                f"lopd.student_loss={self.student_loss!r}, expected false: the weight applies to the "
                f"sampled-token reverse KL only (lopd.student_loss=sampled), and {why}"
            )
        self._check_kl_mix()
        self._check_traces()
        self._check_replay()
        if self.teacher_micro_batch > 0 and not self.low_memory:
            raise ConfigError(
                f"lopd.teacher_micro_batch: got {self.teacher_micro_batch} with lopd.low_memory=false, "
                "expected 0: teacher passes inside a chunk are part of the low-memory order "
                "(set lopd.low_memory=true)"
            )

    @property
    def replay_per_step(self) -> int:
        """Replay tasks per step: replay_share × tasks_per_step rounded half up (Python's round takes 0.5 to 0); none
        while the share is `auto` (resolved by `lopd cycle`, lopd_core/drivers/cycle_record.py: cycle_replay)."""
        if self.replay_share == REPLAY_AUTO:
            return 0
        return math.floor(self.replay_share * self.tasks_per_step + 0.5)

    def _check_replay(self) -> None:
        """A step that replays holds at least one replay task and one fresh task, all rolled out."""
        if self.replay_share in (0, REPLAY_AUTO):
            return
        if not 0 < self.replay_per_step < self.tasks_per_step:
            raise ConfigError(
                f"lopd.replay_share: got {self.replay_share:g} with lopd.tasks_per_step={self.tasks_per_step}, "
                f"expected a share that leaves at least one replay task and one fresh task per step (round(share × "
                f"tasks_per_step) is {self.replay_per_step})"
            )
        if self.trajectories != "rollouts":
            raise ConfigError(
                f"lopd.replay_share: got {self.replay_share:g} with lopd.trajectories={self.trajectories!r}, "
                "expected 0: replay tasks are rolled out, and a step of served traces rolls out few or none"
            )

    def _check_traces(self) -> None:
        """Traces are one per task, so a step that reads them has no groups of G samples of a task."""
        if (self.trajectories != "rollouts" or self.bank_source != "rollouts") and not self.traces:
            raise ConfigError(
                f"lopd.traces: got '' with lopd.trajectories={self.trajectories!r} and "
                f"lopd.bank_source={self.bank_source!r}, expected a trace store folder or snapshot file"
            )
        if self.trajectories == "rollouts":
            return
        if not METHODS[self.method].student.distills or self.advantage == "group":
            raise ConfigError(
                f"lopd.trajectories: got {self.trajectories!r} with lopd.method={self.method!r} and "
                f"lopd.advantage={self.advantage!r}, expected rollouts: a trace is its task's only "
                "sample, so group-relative advantages are 0 (use a distillation method and "
                "lopd.advantage continuous or binary)"
            )

    def _check_kl_mix(self) -> None:
        """lopd.kl_mix weighs the top-k distillation loss: meaningless with GRPO's loss or another student loss."""
        student = METHODS[self.method].student
        mixes = self.kl_mix > 0 or student.kl_mix > 0
        if mixes and not student.distills:
            raise ConfigError(
                f"lopd.kl_mix: got {self.kl_mix:g} with lopd.method={self.method!r}, expected 0: the "
                "forward/reverse mix weighs a distillation loss, and this method's loss is GRPO's"
            )
        if mixes and self.student_loss != "topk":
            raise ConfigError(
                f"lopd.student_loss: got {self.student_loss!r} with lopd.method={self.method!r} and "
                f"lopd.kl_mix={self.kl_mix:g}, expected 'topk': the forward KL is taken on the "
                "teacher's top-k + tail buckets (the sampled-token estimator has no forward form)"
            )
        if student.kl_mix == 1.0 and 0 < self.kl_mix < 1:
            raise ConfigError(
                f"lopd.kl_mix: got {self.kl_mix:g} with lopd.method={self.method!r}, expected 0 or 1: "
                "that method is the pure forward KL; for a mix use lopd.method=lopd_mixed_kl"
            )


@dataclass(frozen=True)
class BaselinesConfig(Section):
    """Knobs of the baselines and controls `lopd.method` selects (lopd_core/methods.py); their shared settings
    (rollouts, steps, learning rate) are the `lopd` section's."""

    SECTION = "baselines"

    grpo_clip: float = setting(0.2, help="PPO-clip ε", check=positive())
    grpo_kl: float = setting(0.0, help="weight of GRPO's KL to the frozen base (0: off)", check=non_negative())
    group_std_eps: float = setting(1e-4, help="GRPO's advantage (r − group mean) / (group std + eps)", check=positive())
    skill_kl: float = setting(
        0.1, help="Skill-SD: weight of the sampled-token reverse KL to the skill-reading teacher", check=non_negative()
    )
    sdpo_teacher: str = setting("ema", help="SDPO's teacher weights: ema | student", check=one_of("ema", "student"))
    ema_decay: float = setting(0.9, help="EMA teacher: θ_ema ← d·θ_ema + (1 − d)·θ", check=fraction())
    sharpen_temperature: float = setting(
        0.5, help="the sharpened-teacher control: the frozen base at this temperature, no context", check=positive()
    )
    rl_weight: float = setting(
        1.0,
        help="lopd_rl: LOPD's distillation loss + this weight × the GRPO term on the same rollouts",
        check=non_negative(),
    )
    rlsd_clip: float = setting(
        0.5,
        help="lopd_rlsd: each token's advantage is A × (p_T/p_S)^sign(A) of the sampled token, clipped to "
        "[1 − this, 1 + this]: the reward sets the sign, the teacher only the size",
        check=in_range(0.0, 1.0),
    )
    anneal_check_n: int = setting(
        32,
        help="lopd_rl_annealed: train-split tasks the latent teacher plays once at the start (sampled as the "
        "rollouts) to measure the level the student's success is held against",
        check=positive(),
    )
    anneal_window: int = setting(
        4, help="lopd_rl_annealed: steps of the student's own batch success averaged into its level", check=positive()
    )
    switch_fraction: float = setting(
        0.5,
        help="lopd_then_grpo: the share of lopd.steps trained as LOPD before the same student goes on with GRPO",
        check=fraction(),
    )
    refresh_check_every: int = setting(
        16,
        help="lopd_gated_refresh: steps between held-out checks of the student against the teacher base",
        check=positive(),
    )
    refresh_check_n: int = setting(
        16,
        help="lopd_gated_refresh: train-split tasks of the deployment worlds each "
        "check plays (greedy, no experience, the same set every time)",
        check=positive(),
    )
    refresh_min_gain: float = setting(
        0.0,
        help="lopd_gated_refresh: θ̄ ← student only where the student's metric beats the teacher base's by more",
        check=in_range(0.0, 1.0),
    )
    refresh_metric: str = setting(
        "success", help="lopd_gated_refresh: success | reward", check=one_of("success", "reward")
    )
