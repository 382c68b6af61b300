"""`lopd base`: build the embedded base policy — demonstrations, tokenizer, tiny Qwen3, warm start — and save it
as a standard Hugging Face directory. A recipe of three steps: `warm_start_data` (what the base learns from),
`train_warm_start` (lopd_core/model/warmstart.py: how), `publish_base` (the folder, swapped in whole).

Seeded once, at the start (torch and the batch order's generator), so the same params build the same base.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig

from lopd_core.config import Params
from lopd_core.envs.mix import mix_counts, pretraining_mix
from lopd_core.envs.toolworld.worlds import WorldSplit
from lopd_core.model.chat import ChatCodec, TrajectoryIds
from lopd_core.model.codegen_demos import build_codegen_demos
from lopd_core.model.demos import build_demos, encode_demo
from lopd_core.model.drills import build_drills, encode_drill
from lopd_core.model.loading import pin_threads, tiny_qwen3
from lopd_core.model.tokenizer import train_tokenizer
from lopd_core.model.warmstart import first_action, train_warm_start
from lopd_core.outputs import check_folder, publish_folder

# Left in every built base: a later `lopd base` may replace a folder holding it, and no other non-empty folder.
BASE_MARKER = ".lopd-base"
# What a base folder holds (the last two: the cycle's stage summary and cache key).
BASE_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "build_report.json",
    "_stage.json",
    "_key.json",
}


def _earlier_base(folder: Path, names: set[str]) -> bool:
    """A base built before the marker existed: nothing but a base's files, among them a build report that names
    the warm start (a plain Hugging Face folder of the user's has the same file names, never this report)."""
    if not names <= BASE_FILES or "build_report.json" not in names:
        return False
    try:
        return "demos" in json.loads((folder / "build_report.json").read_text())
    except (OSError, ValueError):
        return False


@dataclass
class BaseBuildReport:
    demos: int
    drills: int  # drills and first-action cuts mixed in (drills.py)
    demo_tokens: int
    action_tokens: int
    parameters: int
    steps: int
    epochs_done: float
    final_loss: float
    seconds_demos: float
    seconds_train: float
    seconds_total: float
    out_dir: str


@dataclass(frozen=True)
class WarmStartData:
    """What the base learns from: its tokenizer, and the encoded demonstrations, drills and first-action cuts."""

    tokenizer: object
    codec: ChatCodec
    demos: list[TrajectoryIds]
    drills: list[TrajectoryIds]  # drills and first-action cuts, mixed in with the demonstrations

    @property
    def demo_tokens(self) -> int:
        return sum(len(s) for s in self.demos)

    @property
    def action_tokens(self) -> int:
        return sum(sum(s.action_mask) for s in self.demos)


def warm_start_data(params: Params) -> WarmStartData:
    """Demonstrations per env in the proportions of the mix's pretraining part (a plugin environment has no oracle
    or pretraining worlds, so its share goes to the built-ins rather than being dropped), a tokenizer trained on
    them, and the drills."""
    ws, tiny = params.model.warmstart, params.model.tiny
    counts = mix_counts(pretraining_mix(params.envs.mix), ws.demos)
    pretrain = WorldSplit.from_config(params.envs).pretrain
    demos = build_demos(
        n=counts.get("toolworld", 0),
        experience_fraction=ws.experience_fraction,
        max_experiences=ws.max_experiences,
        convention_noise=ws.convention_noise,
        slip=ws.slip,
        seed=params.seed,
        worlds=pretrain,
    )
    if counts.get("codegen"):  # appended: the toolworld part (and its first-action cuts) stay as they were
        demos += build_codegen_demos(
            n=counts["codegen"],
            experience_fraction=ws.experience_fraction,
            max_experiences=ws.max_experiences,
            noise=ws.convention_noise,
            slip=ws.slip,
            seed=params.seed + 1,
            worlds=pretrain,
        )
    tokenizer = train_tokenizer((d.text() for d in demos), tiny.vocab_size)
    codec = ChatCodec(tokenizer)
    seqs = [encode_demo(d, codec) for d in demos]
    seqs = [s for s in seqs if len(s) <= tiny.max_positions]
    # Drills and first-action cuts are mixed in: pack_batches groups them by length, so their short batches
    # interleave with the demonstrations' all through training (run first as a block, they were forgotten).
    drills = [encode_drill(d, codec) for d in build_drills((d.text() for d in demos), ws.drills, params.seed)]
    drills += [first_action(s) for s in seqs[: ws.drills]]
    return WarmStartData(tokenizer, codec, seqs, drills)


def build_base(params: Params, out_dir: str | Path, log=print) -> BaseBuildReport:
    """Build the embedded base into `out_dir`, swapped in whole once saved (lopd_core/outputs.py): a missing or
    empty folder or an earlier base is replaced; any other folder is refused before the minutes of training."""
    check_folder(out_dir, BASE_MARKER, "a base", _earlier_base)
    t0 = time.perf_counter()
    pin_threads(params.model)  # the same base whatever the machine's cores (model.threads)
    torch.manual_seed(params.seed)
    rng = random.Random(params.seed)
    data = warm_start_data(params)
    t_demos = time.perf_counter() - t0
    log(
        f"base: {len(data.demos)} demonstrations, {data.demo_tokens} tokens ({data.action_tokens} supervised), "
        f"vocab {len(data.tokenizer)}, built in {t_demos:.1f}s"
    )
    model = tiny_qwen3(params.model.tiny, data.tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    trained = train_warm_start(
        model, data.demos + data.drills, data.codec.pad_id, data.tokenizer, params.model.warmstart, rng, log
    )
    report = BaseBuildReport(
        demos=len(data.demos),
        drills=len(data.drills),
        demo_tokens=data.demo_tokens,
        action_tokens=data.action_tokens,
        parameters=n_params,
        steps=trained.steps,
        epochs_done=trained.epochs_done,
        final_loss=trained.final_loss,
        seconds_demos=round(t_demos, 1),
        seconds_train=round(trained.seconds, 1),
        seconds_total=round(time.perf_counter() - t0, 1),
        out_dir=str(out_dir),
    )
    publish_base(model, data, report, out_dir)
    return report


def publish_base(model, data: WarmStartData, report: BaseBuildReport, out_dir: str | Path) -> None:
    """The trained base as a Hugging Face folder: weights, greedy generation defaults that stop at the end of a
    turn, the tokenizer, the build report."""
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=data.codec.im_end_id, pad_token_id=data.codec.pad_id, do_sample=False, max_new_tokens=64
    )

    def fill(staging: Path) -> None:
        model.save_pretrained(staging)
        data.tokenizer.save_pretrained(staging)
        (staging / "build_report.json").write_text(json.dumps(asdict(report), indent=2))

    publish_folder(out_dir, BASE_MARKER, "a base", fill, _earlier_base)
