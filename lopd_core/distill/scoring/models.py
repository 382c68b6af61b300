"""Student and teacher weights: one copy in LoRA mode, two in full fine-tuning.

* `full`: the student trains all its weights; the teacher is a frozen copy of the base taken at the start.
* `lora`: the student is the base with a LoRA adapter; the teacher is the same module with the adapter
  disabled — one copy of the weights in memory, and the teacher is exactly the frozen base θ̄.

`TeacherView.active()` yields the causal LM to use as the teacher (adapter disabled inside the block in LoRA
mode); `student_lm` is the causal LM the student is scored and sampled with. Both expose `.model` and
`.lm_head`, which the scoring code uses to compute logits only at action positions.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext

import torch

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def freeze(module: torch.nn.Module) -> torch.nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module.eval()


class TeacherView:
    """The frozen base, either a separate module or the student with its adapter switched off."""

    def __init__(self, lm, *, adapter_owner=None):
        self.lm = lm
        self.adapter_owner = adapter_owner  # the PEFT model whose adapter must be disabled, if any

    @contextmanager
    def active(self):
        ctx = self.adapter_owner.disable_adapter() if self.adapter_owner is not None else nullcontext()
        with ctx:
            yield self.lm


def make_student_and_teacher(base, *, mode: str, lora_rank: int = 8, teacher=None):
    """Return (trainable module, student causal LM, TeacherView) for `mode` in {"full", "lora"}.

    `teacher`: separate frozen weights for the teacher (same tokenizer), when θ̄ is not the student's start;
    in LoRA mode that costs the second copy the adapter otherwise saves."""
    if teacher is not None:
        trainable, student, _ = make_student_and_teacher(base, mode=mode, lora_rank=lora_rank)
        return trainable, student, TeacherView(freeze(teacher))
    if mode == "full":
        teacher = freeze(copy.deepcopy(base))
        base.train()
        return base, base, TeacherView(teacher)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        freeze(base)
        peft_model = get_peft_model(
            base, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules=LORA_TARGETS)
        )
        lm = peft_model.base_model.model  # the causal LM with LoRA layers injected
        return peft_model, lm, TeacherView(lm, adapter_owner=peft_model)
    raise ValueError(f"lopd.student_mode: got {mode!r}, expected 'full' or 'lora'")


def export_student(trainable, student_lm, tokenizer, out_dir) -> None:
    """Save the student as a plain Hugging Face checkpoint (LoRA merged into a copy of the weights)."""
    if hasattr(trainable, "merge_and_unload"):
        merged = copy.deepcopy(trainable).merge_and_unload()
        merged.save_pretrained(out_dir)
    else:
        student_lm.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def replicated_copy(trainable, student_lm, state_dict: dict):
    """(trainable, student causal LM) rebuilt unsharded from a sharded student's whole `state_dict` (gathered
    by `sharding.whole_state_dict`): what rank 0 exports, through `export_student` like a replicated run."""
    dtype = next(iter(state_dict.values())).dtype
    base = type(student_lm)(student_lm.config).to(dtype)
    if hasattr(trainable, "peft_config"):  # the same adapter, then merged by export_student
        from peft import get_peft_model

        copy_ = get_peft_model(base, trainable.peft_config["default"])
        copy_.load_state_dict(state_dict)
        return copy_, copy_.base_model.model
    base.load_state_dict(state_dict)
    return base, base
