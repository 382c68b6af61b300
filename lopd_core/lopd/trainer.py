"""`lopd distill`: the LOPD training loop (DESIGN §3), one step at a time, resumable.

Per step, in this order:
  1. roll out B tasks × G samples with the current student (token in, token out);
  2. retrieve J experiences per task, compose latents c_φ, score the student's tokens with the latent teacher
     and keep its top-k log-probs and ids;
  3. student update: reverse KL(p_S ‖ p_T) on the teacher's top-k + tail (or full / sampled), token mean;
  4. composer update through the frozen teacher: KL(sg[p_S,old] ‖ p_T,φ) + β·(m − δ̄) + λ·anchor;
  5. dual ascent: β ← max(0, β + η_β·(m − δ̄)).
Steps 2 and 4 share one teacher forward: it is run with the composer's graph attached, step 2 takes a
detached copy of what it needs and step 4 back-propagates through the same activations afterwards (the
composer has not changed in between, so this is exactly the specified order, one teacher pass cheaper).

Everything a step needs is derived from (seed, step): its tasks are a fixed slice of the training stream and
its sampling generator is seeded by the step, so a run resumed from a checkpoint prints the same numbers as an
uninterrupted one. A non-finite loss or gradient norm skips that update (counted, never applied).
"""

from __future__ import annotations

import copy
import csv
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lopd_core.config import Params
from lopd_core.envs import Task, make_tasks
from lopd_core.lopd import losses as L
from lopd_core.lopd.composer import Composer, ExperienceEncoder, compose_latents, mean_embedding_norm
from lopd_core.lopd.models import export_student, make_student_and_teacher
from lopd_core.lopd.teacher import Framing, action_logits, build_batch, teacher_topk
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

CSV_COLUMNS = [
    "step", "rollouts", "reward_mean", "success_rate", "distill_loss", "kl_phi", "delta", "beta", "anchor",
    "student_entropy", "teacher_entropy", "topk_mass", "grad_norm_theta", "grad_norm_phi", "latent_norm_ratio",
    "step_seconds",
]
DIAGNOSTIC_COLUMNS = [
    "step", "margin_success", "margin_failure", "latent_norm", "embedding_norm", "skipped_updates",
    "encoder_cache_hits", "rollout_s", "teacher_s", "student_s", "composer_s",
]

Retriever = Callable[[list[Task]], list[list[str]]]  # tasks -> experience texts per task


@dataclass
class DistillState:
    step: int = 0  # steps completed
    beta: float = 0.0
    rollouts: int = 0  # trajectories sampled so far (including the bank's seed rollouts)
    skipped_updates: int = 0
    history: list[dict] = field(default_factory=list)


def load_composer(path: str | Path, lm_width: int, cfg, embedding_norm: float) -> Composer:
    composer = Composer(lm_width, num_queries=cfg.num_queries, hidden_size=cfg.hidden_size,
                        num_layers=cfg.num_layers, num_heads=cfg.num_heads, embedding_norm=embedding_norm)
    if path and Path(path).exists():
        composer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return composer


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits, dim=-1)
    return -(lp.exp() * lp).sum(-1)


def _grad_norm(params, max_norm: float) -> float:
    return float(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm))


class Distiller:
    """Holds the models, optimizers and state of one distillation run."""

    def __init__(self, params: Params, base, tokenizer, retriever: Retriever, *, composer: Composer,
                 initial_rollouts: int = 0, log=print):
        torch.manual_seed(params.seed)
        self.params, self.cfg, self.log = params, params.lopd, log
        self.codec = ChatCodec(tokenizer)
        self.tokenizer = tokenizer
        self.framing = Framing.from_tokenizer(tokenizer)
        self.trainable, self.student, self.teacher = make_student_and_teacher(
            base, mode=self.cfg.student_mode, lora_rank=self.cfg.lora_rank)
        self.encoder = ExperienceEncoder(self.teacher, tokenizer, max_tokens=params.composer.max_experience_tokens)
        self.composer = composer.train()
        self.anchor_composer = copy.deepcopy(composer).eval().requires_grad_(False)  # φ0, fixed
        self._anchor_cache: dict[str, torch.Tensor] = {}  # experience text -> φ0's (K, D) latents
        self.embedding_norm = mean_embedding_norm(self.student)
        self.retriever = retriever
        self.opt_theta = torch.optim.AdamW([p for p in self.trainable.parameters() if p.requires_grad],
                                           lr=self.cfg.lr_student, weight_decay=0.0)
        self.opt_phi = torch.optim.AdamW(self.composer.parameters(), lr=self.cfg.lr_composer, weight_decay=0.0)
        self.state = DistillState(beta=self.cfg.beta_init, rollouts=initial_rollouts)
        self.task_stream = make_tasks("toolworld", "train", self.cfg.steps * self.cfg.tasks_per_step,
                                      params.seed + 17)

    # ---- one step -------------------------------------------------------------------------------------
    def step(self) -> dict:
        """One full step: roll out this step's tasks, then `update` on the trajectories."""
        cfg, ro = self.cfg, self.params.rollout
        started = time.perf_counter()
        s = self.state.step
        tasks = self.task_stream[s * cfg.tasks_per_step:(s + 1) * cfg.tasks_per_step]

        # 1. Rollouts with the current student.
        requests = [RolloutRequest(t, sample_index=g) for t in tasks for g in range(cfg.samples_per_task)]
        sampling = Sampling(temperature=cfg.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens,
                            max_context=ro.max_context)
        trajs = rollout(self.student, self.codec, requests, sampling=sampling, batch_size=ro.batch_size,
                        seed=self.params.seed * 1_000_003 + s)
        self.state.rollouts += len(trajs)
        return self.update(tasks, trajs, started=started)

    def update(self, tasks: list[Task], trajs: list, *, started: float | None = None) -> dict:
        """Steps 2-5 on trajectories of `tasks` (samples_per_task each, in task order). Also what
        benchmarks/step_cost.py times against a plain policy-gradient update."""
        cfg = self.cfg
        started = time.perf_counter() if started is None else started
        t_rollout = time.perf_counter()
        ids = [t.token_ids for t in trajs]
        masks = [t.action_mask for t in trajs]
        rewards = torch.tensor([t.reward for t in trajs])
        successes = torch.tensor([t.success for t in trajs])
        groups = torch.tensor([i // cfg.samples_per_task for i in range(len(trajs))])

        # 2. Retrieve, compose, score with the latent teacher (graph kept for step 4).
        per_task = self.retriever(tasks)
        experiences = [per_task[i // cfg.samples_per_task] for i in range(len(trajs))]
        latents = compose_latents(self.composer, self.encoder, experiences)
        with self.teacher.active() as teacher_lm:
            tbatch = build_batch(teacher_lm, ids, masks, latents, self.framing)
            t_logits = action_logits(teacher_lm, tbatch)  # (N, V), differentiable w.r.t. φ
        top = teacher_topk(t_logits, tbatch.action_ids, cfg.top_k)
        t_teacher = time.perf_counter()

        # 3. Student update.
        sbatch = build_batch(self.student, ids, masks)
        s_logits = action_logits(self.student, sbatch)  # (N, V)
        if cfg.student_loss == "topk":
            per_token = L.reverse_kl_topk(s_logits, top.logprobs, top.ids)
        elif cfg.student_loss == "full":
            per_token = L.reverse_kl_full(s_logits, t_logits.detach())
        else:
            s_action_lp = torch.log_softmax(s_logits, -1).gather(-1, sbatch.action_ids[:, None]).squeeze(-1)
            per_token = L.reverse_kl_sampled(s_action_lp, top.action_logprobs)
        if cfg.importance_weight:
            s_action_lp = torch.log_softmax(s_logits.detach(), -1).gather(-1, sbatch.action_ids[:, None])
            sample_lp = torch.tensor([lp for t in trajs for lp, m in zip(t.sample_logprobs[1:], t.action_mask[1:])
                                      if m])
            per_token = per_token * L.truncated_importance_weight(s_action_lp.squeeze(-1), sample_lp,
                                                                  cap=cfg.importance_cap)
        distill_loss = per_token.mean()  # token mean over the batch: every sampled action counts once
        s_old = s_logits.detach()
        self.opt_theta.zero_grad(set_to_none=True)
        distill_loss.backward()
        grad_theta = _grad_norm(self.trainable.parameters(), cfg.max_grad_norm)
        if math.isfinite(distill_loss.item()) and math.isfinite(grad_theta):
            self.opt_theta.step()
        else:
            self.state.skipped_updates += 1
            self.log(f"distill: step {self.state.step + 1}: non-finite student loss/gradient, update skipped")
        t_student = time.perf_counter()

        # 4. Composer update through the frozen teacher.
        p_lp, p_tail = L.topk_support_logprobs(s_old, top.ids)
        q_lp, q_tail = L.topk_support_logprobs(t_logits, top.ids)
        kl_phi = L.support_kl(p_lp, p_tail, q_lp, q_tail).mean()
        t_action_lp = torch.log_softmax(t_logits, -1).gather(-1, tbatch.action_ids[:, None]).squeeze(-1)
        s_action_old = torch.log_softmax(s_old, -1).gather(-1, sbatch.action_ids[:, None]).squeeze(-1)
        adv = L.advantages(rewards, kind=cfg.advantage, successes=successes, group_ids=groups)
        delta = L.privileged_margin_delta(t_action_lp, s_action_old, adv, tbatch.token_traj_index, len(trajs))
        counts = torch.bincount(tbatch.token_traj_index, minlength=len(trajs))
        delta_bar = L.token_weighted_mean(delta, counts)
        anchor_latents = self.anchor_latents(experiences)
        flat = torch.cat(latents) if latents else torch.zeros(0)
        anchor = L.anchor_loss(flat, torch.cat(anchor_latents)) if flat.numel() else torch.zeros(())
        beta_used = self.state.beta
        loss_phi = L.composer_loss(kl_phi, delta_bar, beta=beta_used, margin=cfg.margin, anchor=anchor,
                                   anchor_weight=cfg.anchor_weight)
        self.opt_phi.zero_grad(set_to_none=True)
        loss_phi.backward()
        grad_phi = _grad_norm(self.composer.parameters(), cfg.max_grad_norm)
        if math.isfinite(loss_phi.item()) and math.isfinite(grad_phi):
            self.opt_phi.step()
        else:
            self.state.skipped_updates += 1
            self.log(f"distill: step {self.state.step + 1}: non-finite composer loss/gradient, update skipped")
        t_composer = time.perf_counter()

        # 5. Dual ascent on β with this step's δ̄.
        d_bar = float(delta_bar.detach())
        if math.isfinite(d_bar):
            self.state.beta = L.dual_ascent(beta_used, margin=cfg.margin, delta_bar=d_bar, lr=cfg.beta_lr)
        self.state.step += 1

        # Dashboard numbers (detached).
        with torch.no_grad():
            gap = t_action_lp.detach() - s_action_old
            per_traj_gap = torch.zeros(len(trajs)).index_add_(0, tbatch.token_traj_index, gap) / counts.clamp(min=1)
            latent_norm = float(flat.detach().norm(dim=-1).mean()) if flat.numel() else 0.0
            row = {
                "step": self.state.step, "rollouts": self.state.rollouts,
                "reward_mean": float(rewards.mean()), "success_rate": float(successes.float().mean()),
                "distill_loss": float(distill_loss), "kl_phi": float(kl_phi), "delta": d_bar, "beta": beta_used,
                "anchor": float(anchor), "student_entropy": float(_entropy(s_old).mean()),
                "teacher_entropy": float(top.entropy.mean()), "topk_mass": float(top.logprobs.exp().sum(-1).mean()),
                "grad_norm_theta": grad_theta, "grad_norm_phi": grad_phi,
                "latent_norm_ratio": latent_norm / max(self.embedding_norm, 1e-8),
                "step_seconds": time.perf_counter() - started,
            }
            diag = {
                "step": self.state.step,
                "margin_success": float(per_traj_gap[successes].mean()) if successes.any() else float("nan"),
                "margin_failure": float(per_traj_gap[~successes].mean()) if (~successes).any() else float("nan"),
                "latent_norm": latent_norm, "embedding_norm": self.embedding_norm,
                "skipped_updates": self.state.skipped_updates, "encoder_cache_hits": self.encoder.hits,
                "rollout_s": t_rollout - started, "teacher_s": t_teacher - t_rollout,
                "student_s": t_student - t_teacher, "composer_s": t_composer - t_student,
            }
        return {"row": row, "diagnostics": diag}

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
        path = self.checkpoint_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "state": asdict(self.state),
            "trainable": {k: v for k, v in self.trainable.state_dict().items()},
            "composer": self.composer.state_dict(),
            "opt_theta": self.opt_theta.state_dict(),
            "opt_phi": self.opt_phi.state_dict(),
            "rng_torch": torch.get_rng_state(),
            "data_position": self.state.step * self.cfg.tasks_per_step,
        }
        tmp = path.with_suffix(".tmp")
        torch.save(payload, tmp)
        tmp.replace(path)  # atomic: a crash mid-write leaves the previous checkpoint intact
        return path

    def load_checkpoint(self) -> bool:
        path = self.checkpoint_path()
        if not path.exists():
            return False
        payload = torch.load(path, map_location="cpu", weights_only=False)
        self.trainable.load_state_dict(payload["trainable"])
        self.composer.load_state_dict(payload["composer"])
        self.opt_theta.load_state_dict(payload["opt_theta"])
        self.opt_phi.load_state_dict(payload["opt_phi"])
        torch.set_rng_state(payload["rng_torch"])
        self.state = DistillState(**payload["state"])
        return True


def _write_rows(path: Path, columns: list[str], rows: list[dict]) -> None:
    """Rewrite the CSV with `rows` (atomic), so a resumed run never duplicates or loses a step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    tmp.replace(path)


def run_distill(distiller: Distiller, *, steps: int | None = None, resume: bool = True,
                stop_after: int | None = None) -> DistillState:
    """Train to `steps` (default lopd.steps); resume from the last checkpoint when there is one.
    `stop_after` ends the process early (tests of resumption)."""
    cfg = distiller.cfg
    total = steps or cfg.steps
    if resume and distiller.load_checkpoint():
        distiller.log(f"distill: resumed at step {distiller.state.step} (β={distiller.state.beta:.3f})")
    csv_path = Path(cfg.csv)
    diag_path = csv_path.with_name(csv_path.stem + "_diagnostics.csv")
    history = distiller.state.history
    while distiller.state.step < total:
        out = distiller.step()
        history.append(out)
        _write_rows(csv_path, CSV_COLUMNS, [h["row"] for h in history])
        _write_rows(diag_path, DIAGNOSTIC_COLUMNS, [h["diagnostics"] for h in history])
        r = out["row"]
        distiller.log(f"distill: step {r['step']}/{total} reward {r['reward_mean']:.3f} success "
                      f"{r['success_rate']:.3f} loss {r['distill_loss']:.4f} δ̄ {r['delta']:+.4f} β {r['beta']:.3f} "
                      f"({r['step_seconds']:.1f}s)")
        if distiller.state.step % cfg.checkpoint_every == 0 or distiller.state.step == total:
            distiller.save_checkpoint()
        if stop_after is not None and distiller.state.step >= stop_after:
            break
    return distiller.state


def export(distiller: Distiller, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    export_student(distiller.trainable, distiller.student, distiller.tokenizer, out)
    torch.save(distiller.composer.state_dict(), out.parent / "composer.pt")
    return out
