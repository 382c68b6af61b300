"""The base is the same whatever the machine's thread count (issue #37): a build at one thread and one at two
diverged in the last digits from the first steps on, and a published figure must name the weights it was
measured on. `model.threads` pins every stage's CPU threads, so the environment's count (OMP_NUM_THREADS, the
machine's cores) no longer enters the numbers.

Two short builds of the default width in fresh processes, at OMP_NUM_THREADS 1 and 2: the same weights bit for
bit with the pin; and, so the check can fail, different weights with the pin off (`model.threads=0`), which is
what the pin is for. Slow tier: four short builds, about a minute."""

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
from lopd_core.model.warmstart import build_base
out, threads = Path(sys.argv[1]), sys.argv[2]
(out.parent / "p.yaml").write_text("seed: 0\\n")
params = load_params(out.parent / "p.yaml", ["model.warmstart.demos=300", "model.warmstart.drills=100",
    "model.warmstart.max_steps=30", f"model.threads={threads}"])
build_base(params, out, log=lambda m: None)
print(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
"""


def _build(tmp_path: Path, name: str, omp: int, threads: int) -> str:
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
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_the_base_is_the_same_at_any_thread_count(tmp_path):
    assert _build(tmp_path, "pinned1", 1, 2) == _build(tmp_path, "pinned2", 2, 2)
    # without the pin, the environment's count decides, and the weights differ: the pin is doing the work
    assert _build(tmp_path, "free1", 1, 0) != _build(tmp_path, "free2", 2, 0)
