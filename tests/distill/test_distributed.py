"""Data parallelism through the real launcher: `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo)
gives the same cold start and the same LOPD steps as one process — losses, δ̄, β, gradient norms — and a
checkpoint written by the 2-process run resumes in 1 process to the numbers of an uninterrupted 1-process run.

Why it can hold exactly (up to float summation order): each rank takes its slice of the step's tasks, every
trajectory's sampling stream is seeded by its place in the run (not by the rank's batch), every loss is a
rank's share of the whole batch's token mean, and gradients are summed over ranks (lopd_core/distributed.py).
The tolerance below covers float32 sums taken in a different order (batched logits of other widths, a sum of
two partial sums); observed differences are printed.

Slow tier: six launches of the CLI (each imports torch/transformers/chromadb); about a minute or two on 2 cores.
"""

import csv
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core import distributed as D

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = Path(sys.executable).with_name("accelerate")

TINY = [
    "rollout.max_new_tokens=20",
    "rollout.max_context=512",
    "bank.seed_tasks=2",
    "bank.samples_per_task=1",
    "coldstart.oracle_tasks=12",
    "envs.pretrain_worlds=2",
    "composer.num_queries=4",
    "composer.num_layers=1",
    "composer.num_heads=2",
    "coldstart.steps=2",
    "coldstart.batch_size=4",
    "coldstart.fit_steps=0",  # distillation from φ0 itself: what is compared is the sharded step, not the fit
    "lopd.steps=3",
    "lopd.tasks_per_step=4",
    "lopd.samples_per_task=2",
    "lopd.micro_batch=3",
    "lopd.checkpoint_every=1",
    # the paper's LOPD at its constant m: φ trains and β moves, so their agreement across ranks says something
    "lopd.method=lopd",
    "lopd.margin=0.05",
]
COMPARED = [
    "distill_loss",
    "kl_phi",
    "delta",
    "beta",
    "anchor",
    "reward_mean",
    "success_rate",
    "student_entropy",
    "teacher_entropy",
    "topk_mass",
    "grad_norm_theta",
    "grad_norm_phi",
    "latent_norm_ratio",
    "rollouts",
]
RTOL, ATOL = 1e-3, 1e-5  # float32 sums in another order, through 3 AdamW steps


def test_shards_cover_every_item_once():
    assert D.world_size() == 1 and D.is_main()
    assert D.shard_range(5) == range(5)
    assert D.global_sum([2, 3.5]) == [2.0, 3.5]
    # the slicing rule for 3 ranks over 7 items, worked by hand: 0..1, 2..3, 4..6
    assert [range(r * 7 // 3, (r + 1) * 7 // 3) for r in range(3)] == [range(2), range(2, 4), range(4, 7)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lopd(work: Path, *args: str, procs: int = 1, sets: list[str] = ()) -> subprocess.CompletedProcess:
    """`lopd ARGS` in `work`, through `accelerate launch` when procs > 1 (the command users run)."""
    cli = ["-m", "lopd_cli.main", *args]
    for s in [*TINY, f"model.name_or_path={work / 'model'}", *sets]:
        cli += ["--set", s]
    if procs > 1:
        cmd = [
            str(ACCELERATE),
            "launch",
            "--multi_gpu",
            "--num_processes",
            str(procs),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(_free_port()),
            *cli,
        ]
    else:
        cmd = [sys.executable, *cli]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    started = time.perf_counter()
    res = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600, check=False)
    print(f"{' '.join(args)} ×{procs}: {time.perf_counter() - started:.1f}s")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


def _compare(label: str, ref: list[dict], got: list[dict], columns: list[str]) -> float:
    assert len(ref) == len(got)
    worst = 0.0
    for a, b in zip(ref, got):
        for c in columns:
            diff = abs(a[c] - b[c])
            worst = max(worst, diff / max(abs(a[c]), 1e-12) if diff > ATOL else 0.0)
            assert b[c] == pytest.approx(a[c], rel=RTOL, abs=ATOL), (
                f"{label} step {a['step']:.0f} {c}: {a[c]} vs {b[c]}"
            )
    print(f"{label}: worst relative difference {worst:.2e} over {len(ref)} steps")
    return worst


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_tokenizer):
    """A project folder with a saved tiny model and a seeded bank (1 process)."""
    from lopd_core.config import TinyModelConfig
    from lopd_core.model.loading import tiny_qwen3

    work = tmp_path_factory.mktemp("dist")
    shutil.copy(ROOT / "params.yaml", work / "params.yaml")
    torch.manual_seed(0)
    cfg = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    tiny_qwen3(cfg, tiny_tokenizer).save_pretrained(work / "model")
    tiny_tokenizer.save_pretrained(work / "model")
    _lopd(work, "bank")
    return work


@pytest.mark.slow
def test_two_processes_match_one(work):
    # Cold start: 1 process, then 2 processes on the same draws; φ0 and the logged losses agree.
    _lopd(work, "coldstart", sets=["coldstart.out=data/composer/phi0_1.pt", "lopd.csv=plots/one/distill.csv"])
    _lopd(work, "coldstart", procs=2, sets=["coldstart.out=data/composer/phi0.pt", "lopd.csv=plots/two/distill.csv"])
    cold = _compare(
        "coldstart",
        _rows(work / "plots/one/coldstart.csv"),
        _rows(work / "plots/two/coldstart.csv"),
        ["nll", "kl", "loss", "latent_norm_ratio", "grad_norm"],
    )
    phi1 = torch.load(work / "data/composer/phi0_1.pt", weights_only=True)
    phi2 = torch.load(work / "data/composer/phi0.pt", weights_only=True)
    assert phi1.keys() == phi2.keys()
    assert all(torch.equal(phi1[k], phi2[k]) for k in phi1 if not phi1[k].is_floating_point())  # how φ reads
    worst_phi = max(float((phi1[k] - phi2[k]).abs().max()) for k in phi1 if phi1[k].is_floating_point())
    print(f"coldstart: φ0 max |Δ| {worst_phi:.2e}")
    assert worst_phi < 1e-5

    # LOPD: 3 steps in 1 process; 2 steps in 2 processes (half the tasks each), then step 3 resumed from the
    # 2-process checkpoint in 1 process.
    _lopd(work, "distill", "--fresh", sets=["lopd.out_dir=data/lopd_one", "lopd.csv=plots/one/distill.csv"])
    two = ["lopd.out_dir=data/lopd_two", "lopd.csv=plots/two/distill.csv"]
    res = _lopd(work, "distill", "--fresh", "--stop-after", "2", procs=2, sets=two)
    assert res.stdout.count("distill: step 1/3") == 1  # rank 0 speaks, once
    res = _lopd(work, "distill", sets=two)
    assert "resumed at step 2" in res.stdout
    ref, got = _rows(work / "plots/one/distill.csv"), _rows(work / "plots/two/distill.csv")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert any(r["beta"] > 0 for r in ref)  # β moved, so its agreement says something
    worst = _compare("distill (steps 1-2: 2 processes; step 3: resumed in 1)", ref, got, COMPARED)
    print(f"tolerance rel {RTOL} abs {ATOL}; observed worst relative {max(worst, cold):.2e}")


@pytest.mark.slow
def test_fsdp2_under_accelerate_matches_one_process(work):
    """`lopd.sharding=fsdp2` through the real launcher: the cold start (frozen base sharded) and three distill
    steps (student and teacher sharded, a sharded checkpoint each step) on 2 processes give 1 process's rows, and
    the student rank 0 exports from the shards is the 1-process student."""
    from safetensors.torch import load_file

    fsdp = ["lopd.sharding=fsdp2"]
    _lopd(work, "coldstart", sets=["coldstart.out=data/composer/phi0_f1.pt", "lopd.csv=plots/f1/distill.csv"])
    _lopd(
        work, "coldstart", procs=2, sets=[*fsdp, "coldstart.out=data/composer/phi0.pt", "lopd.csv=plots/f2/distill.csv"]
    )
    _compare(
        "coldstart fsdp2",
        _rows(work / "plots/f1/coldstart.csv"),
        _rows(work / "plots/f2/coldstart.csv"),
        ["nll", "kl", "loss", "latent_norm_ratio", "grad_norm"],
    )
    _lopd(work, "distill", "--fresh", sets=["lopd.out_dir=data/f_one", "lopd.csv=plots/f1/distill.csv"])
    _lopd(work, "distill", "--fresh", procs=2, sets=[*fsdp, "lopd.out_dir=data/f_two", "lopd.csv=plots/f2/distill.csv"])
    assert len(list((work / "data/f_two/theta").iterdir())) == 1  # earlier steps' shards removed
    _compare(
        "distill fsdp2 (2 processes)",
        _rows(work / "plots/f1/distill.csv"),
        _rows(work / "plots/f2/distill.csv"),
        COMPARED,
    )
    one = load_file(work / "data/f_one/student/model.safetensors")
    two = load_file(work / "data/f_two/student/model.safetensors")
    assert one.keys() == two.keys()
    worst = max(float((one[k] - two[k]).abs().max()) for k in one)
    print(f"exported student max |Δ| {worst:.2e}")
    assert worst < 1e-5
