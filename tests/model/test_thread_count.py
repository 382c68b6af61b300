"""The base is the same whatever the machine's thread count (issue #37): a build at one thread and one at two
diverged in the last digits from the first steps on, and a published figure must name the weights it was
measured on. `model.threads` pins every stage's CPU threads, so the environment's count (OMP_NUM_THREADS, the
machine's cores) no longer enters the numbers.

Two short builds of the default width in fresh processes, at OMP_NUM_THREADS 1 and 2: the same weights bit for
bit, both at the pinned count; and with the pin off (`model.threads=0`) each build runs at the environment's count,
which is what made the two builds of the issue diverge (a 30-step build is too short to show the divergence
itself: it appeared after hundreds of steps). Slow tier: four short builds, about a minute."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = """
import hashlib, sys
from pathlib import Path
import lopd_core
from lopd_core.config import load_params
from lopd_core.model.base_build import build_base
out, threads = Path(sys.argv[1]), sys.argv[2]
(out.parent / "p.yaml").write_text("seed: 0\\n")
params = load_params(out.parent / "p.yaml", ["model.warmstart.demos=300", "model.warmstart.drills=100",
    "model.warmstart.max_steps=30", f"model.threads={threads}"])
build_base(params, out, log=lambda m: None)
import torch
print(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest(), torch.get_num_threads())
"""


def _build(tmp_path: Path, name: str, omp: int, threads: int) -> tuple[str, int]:
    folder = tmp_path / name
    folder.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": str(omp), "MKL_NUM_THREADS": str(omp), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", BUILD, str(folder / "base"), str(threads)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    digest, used = out.stdout.strip().splitlines()[-1].split()
    return digest, int(used)


@pytest.mark.slow
def test_the_base_is_the_same_at_any_thread_count(tmp_path):
    one, two = _build(tmp_path, "pinned1", 1, 2), _build(tmp_path, "pinned2", 2, 2)
    assert one == two and one[1] == 2  # the pin, not the environment, sets the count: the same weights
    # without the pin the environment's count is the build's (what made two builds diverge by step 600)
    assert _build(tmp_path, "free1", 1, 0)[1] == 1 and _build(tmp_path, "free2", 2, 0)[1] == 2
