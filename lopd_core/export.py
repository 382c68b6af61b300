"""`lopd export`: the trained student as a clean Hugging Face checkpoint that needs nothing of LOPD to run.

The deployed student is a plain causal LM: no bank, retriever, composer or latent tokens are involved at
inference (they only shaped its training). The export therefore holds exactly what `from_pretrained` reads —
weights (LoRA merged when the source is an adapter), tokenizer with its chat template, a generation config —
plus a model card (README.md) with the evaluation numbers and the lineage needed to reproduce it, and the same
lineage as `lineage.json` for machines.
"""

from __future__ import annotations

import json
from pathlib import Path

from lopd_core.config import RolloutConfig
from lopd_core.outputs import publish_folder

# Left in every export: a later `lopd export` may replace a folder holding it, and no other non-empty folder.
EXPORT_MARKER = ".lopd-export"


def _load_merged(source: Path):
    """The model at `source`, with a LoRA adapter merged into its base when `source` is an adapter folder."""
    if (source / "adapter_config.json").exists():
        from peft import AutoPeftModelForCausalLM

        return AutoPeftModelForCausalLM.from_pretrained(source).merge_and_unload()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source)


def _generation_config(model, tokenizer, rollout: RolloutConfig):
    from transformers import GenerationConfig

    sampled = rollout.temperature > 0
    return GenerationConfig(
        max_new_tokens=rollout.max_new_tokens,
        do_sample=sampled,
        temperature=rollout.temperature if sampled else None,
        top_p=rollout.top_p if sampled else None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )


def eval_rows(results: dict | None) -> list[tuple[str, str, str, dict]]:
    """Flatten metrics/eval.json ({env: {split: {mode: cell}}}) into (env, split, mode, cell) rows.

    Benchmark sections merged into the same file (humaneval, bfcl, acebench) have other shapes and are skipped."""
    rows = []
    for env, splits in (results or {}).items():
        if not isinstance(splits, dict):
            continue
        for split, modes in splits.items():
            if not isinstance(modes, dict):
                continue
            for mode, cell in modes.items():
                if isinstance(cell, dict) and "success_rate" in cell:
                    rows.append((env, split, mode, cell))
    return rows


def _pct(cell: dict | None) -> str:
    if not cell:
        return "–"
    low, high = cell.get("ci95", [None, None])
    ci = f" [{100 * low:.1f}, {100 * high:.1f}]" if low is not None else ""
    return f"{100 * cell['success_rate']:.1f} %{ci}"


def model_card(name: str, student_eval: dict | None, base_eval: dict | None, lineage: dict) -> str:
    """README.md of the export: what the model is, how to load it, its numbers and where it came from."""
    base_cells = {(e, s, m): c for e, s, m, c in eval_rows(base_eval)}
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [lopd, tool-use, agent, self-distillation]",
        "---",
        "",
        f"# {name}",
        "",
        (
            "A tool-using agent policy trained by Latent On-Policy Self-Distillation (LOPD). It is a plain causal "
            "language model: no experience bank, retriever, composer or latent tokens are needed to run it."
        ),
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained(PATH)",
        "tokenizer = AutoTokenizer.from_pretrained(PATH)  # chat template included",
        "```",
        "",
        "## Evaluation (held-out tasks)",
        "",
        "Success rate with its Wilson 95 % interval and mean reward (fraction of the task's checks passed).",
        "",
        "| env | split | mode | student success | student reward | base success | base reward | n |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for env, split, mode, cell in eval_rows(student_eval):
        base = base_cells.get((env, split, mode))
        base_reward = f"{base['reward_mean']:.3f}" if base else "–"
        lines.append(
            f"| {env} | {split} | {mode} | {_pct(cell)} | {cell['reward_mean']:.3f} | {_pct(base)} | "
            f"{base_reward} | {cell['n']} |"
        )
    if not student_eval:
        lines.append("| – | – | – | not evaluated | | | | |")
    lines += ["", "## Lineage", "", "| what | value |", "|---|---|"]
    for key, value in lineage.items():
        lines.append(f"| {key} | `{value}` |")
    lines.append("")
    return "\n".join(lines)


def export_checkpoint(
    source: str | Path,
    out_dir: str | Path,
    *,
    rollout: RolloutConfig,
    student_eval: dict | None = None,
    base_eval: dict | None = None,
    lineage: dict | None = None,
    name: str = "lopd-student",
) -> Path:
    """Write the clean checkpoint of `source` to `out_dir`, replaced as a whole so that no stale file survives.

    `out_dir` must be missing, empty or a previous export (outputs.publish_folder): a folder of anything else is
    refused before any work, never emptied."""
    from transformers import AutoTokenizer

    from lopd_core.outputs import check_folder

    source, out = Path(source), Path(out_dir)
    if not (source / "config.json").exists() and not (source / "adapter_config.json").exists():
        raise FileNotFoundError(f"no model to export at {source}: run `lopd distill` first (or pass --model)")
    check_folder(out, EXPORT_MARKER, "an export")  # before loading the model: a refusal costs nothing
    model = _load_merged(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    lineage = dict(lineage or {})

    def fill(staging: Path) -> None:
        model.generation_config = _generation_config(model, tokenizer, rollout)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "lineage.json").write_text(json.dumps(lineage, indent=2, default=str))
        (staging / "README.md").write_text(model_card(name, student_eval, base_eval, lineage))

    return publish_folder(out, EXPORT_MARKER, "an export", fill)
