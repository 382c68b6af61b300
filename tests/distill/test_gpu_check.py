"""scripts/gpu_check.sh and scripts/gpu_check.py: without CUDA the check stops at its preflight with a clear
message and exit 3; `--cpu` runs the in-process checks on the CPU (slow tier). The tests marked gpu run the
check's main claims on a CUDA device and skip cleanly without one."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
import torch
from _float_paths import assert_same_play

from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.model.head import head_logits
from lopd_core.rollout import engine
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

ROOT = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_without_cuda_the_check_stops_at_preflight(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "LOPD_PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 3
    assert "no usable CUDA device" in done.stderr and "--cpu" in done.stderr
    preflight = json.loads((tmp_path / "preflight.json").read_text())
    assert preflight["ok"] is False and preflight["cuda_available"] is False and preflight["missing"] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preflight.json"]  # nothing else was started


@pytest.mark.slow
def test_cpu_dry_run_of_the_in_process_checks(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_check.py"),
            "--cpu",
            "--model",
            str(tmp_path / "none"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    checks = json.loads((tmp_path / "checks.json").read_text())
    assert checks["ok"]
    assert {"env", "rollout_cuda", "rollout_bf16", "lopd_step_full", "lopd_step_lora", "lopd_step_lora_bf16"} <= set(
        checks
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seeded", [False, True], ids=["batch-stream", "row-streams"])
def test_shared_prefill_on_cuda_plays_the_unshared_ids(tiny_model, tiny_tokenizer, seeded):
    model = copy.deepcopy(tiny_model).to("cuda")
    codec = ChatCodec(tiny_tokenizer)
    requests = [
        RolloutRequest(t, sample_index=g) for t in make_tasks("toolworld", "train", 3, seed=7) for g in range(4)
    ]
    sampling = Sampling(temperature=1.0, max_new_tokens=12, max_context=768)
    seeds = list(range(len(requests))) if seeded else None

    def play(shared: bool):
        with mock.patch.object(engine, "generate_turn", partial(engine.generate_turn, share_prompts=shared)):
            return rollout(
                model,
                codec,
                requests,
                sampling=sampling,
                batch_size=len(requests),
                seed=3,
                seeds=seeds,
                keep_cache=False,
            )  # the path that calls generate_turn every turn

    # Shared and unshared prefills are two float paths: each play's sampling log-probs equal a full forward
    # pass's to 1e-4 (teacher-forced); sampled ids are not compared across the paths (tests/_float_paths.py).
    assert_same_play(model, play(True), play(False), sampling)


@pytest.mark.gpu
@needs_cuda
def test_bf16_head_on_cuda_is_float32_accurate(tiny_model):
    half = copy.deepcopy(tiny_model).to(device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(0)
    hidden = (4 * torch.randn(64, half.config.hidden_size, device="cuda")).to(torch.bfloat16)
    exact = hidden.double() @ half.lm_head.weight.double().T
    assert (head_logits(half, hidden).double() - exact).abs().max() < 1e-4
