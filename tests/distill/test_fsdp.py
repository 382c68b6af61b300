"""FSDP2 sharding (`lopd.sharding: fsdp2`, lopd_core/sharding.py) gives the one-process update.

Two processes on gloo run three sharded LOPD updates (full fine-tuning and LoRA) and three GRPO updates on a fixed
batch, each rank its slice of the tasks (fsdp_worker.py); this process runs the same updates unsharded, and the
dashboard rows, β, the final student θ and composer φ agree within float tolerance. The sharded checkpoint written
after update 2 by the two processes is resumed in one process, unsharded here and sharded (a one-rank group)
in a launch, and update 3 lands on the uninterrupted run's numbers; so does the one-process run's replicated
checkpoint resumed sharded. The student rank 0 exports from the shards
(LoRA merged) is the one-process run's.

Why it can hold (up to float summation order): each rank's losses are its share of the whole batch's token
means, FSDP's reduce-scatter is a SUM (divide factor 1), so the sharded gradient is the whole-batch one.
"""

import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core import sharding as SH
from lopd_core.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
WORKER = Path(__file__).with_name("fsdp_worker.py")
RTOL, ATOL = 1e-3, 1e-5  # float32 sums in another order, through 3 AdamW steps
WEIGHT_ATOL = 1e-5


def test_unsharded_is_a_no_op():
    sh = SH.Sharding([])
    assert not sh.active
    with sh.gathered(), sh.student_sharded(), sh.gathered():
        pass
    sh.reduce_gradients(None)  # nothing sharded: nothing to reduce, the model is never touched
    assert SH.local_bytes([torch.zeros(3, 2), None]) == 24  # 6 float32 numbers


def test_setting_is_checked():
    from lopd_core.config import load_params

    with pytest.raises(ConfigError, match=r"lopd\.sharding"):
        load_params(ROOT / "params.yaml", ["lopd.sharding=zero3"])


def test_ema_teacher_is_refused_sharded(tiny_model, tiny_tokenizer):
    from benchmarks.sharded_update import distiller

    with pytest.raises(ConfigError, match=r"lopd\.sharding"):
        distiller(tiny_model, tiny_tokenizer, [], sharding="fsdp2", mode="full", method="sdpo")


def test_served_rollouts_with_reload_are_refused_sharded(tiny_model, tiny_tokenizer):
    import copy
    from dataclasses import replace

    from lopd_core.config import Params
    from lopd_core.distill.composer.composer import Composer
    from lopd_core.distill.loop.trainer import Distiller

    p = Params()
    p.rollout = replace(p.rollout, backend="openai", servers=["http://127.0.0.1:9/v1"], sync="reload")
    p.lopd = replace(p.lopd, sharding="fsdp2", method="grpo")
    composer = Composer(tiny_model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2, embedding_norm=1.0)
    with pytest.raises(ConfigError, match=r"rollout\.sync"):
        Distiller(
            p,
            copy.deepcopy(tiny_model),
            tiny_tokenizer,
            lambda ts: [[] for _ in ts],
            composer=composer,
            log=lambda m: None,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(procs: int, mode: str, out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        str(TORCHRUN),
        "--nproc_per_node",
        str(procs),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(WORKER),
        mode,
        str(out),
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _reference(case: str, out: Path) -> dict:
    """The same three updates in this process, unsharded, and update 3 resumed from the sharded checkpoint."""
    from benchmarks.sharded_update import distiller
    from benchmarks.update_fingerprint import setup
    from lopd_core.distill.loop.loop import export
    from tests.distill.fsdp_worker import CASES

    method, mode = CASES[case]
    base, tokenizer, tasks, trajs, texts = setup()
    d = distiller(base, tokenizer, texts, sharding="none", mode=mode, method=method, out_dir=str(out / "one" / case))
    rows = []
    for i in range(3):
        rows.append({k: v for k, v in asdict(d.update(tasks, trajs).row).items() if k != "step_seconds"})
        if i == 1:
            d.save_checkpoint()  # replicated, after update 2: the 1-rank launch resumes it sharded
    export(d, out / "one" / case / "student")
    ref = {
        "rows": rows,
        "beta": d.state.beta,
        "theta": dict(d.trainable.named_parameters()),
        "phi": dict(d.composer.named_parameters()),
    }
    # the two processes' sharded checkpoint (after update 2), resumed here in one unsharded process
    resumed = distiller(base, tokenizer, texts, sharding="none", mode=mode, method=method, out_dir=str(out / case))
    assert resumed.load_checkpoint() and resumed.state.step == 2
    r = resumed.update(tasks, trajs)
    ref["resumed"] = {
        "rows": [{k: v for k, v in asdict(r.row).items() if k != "step_seconds"}],
        "beta": resumed.state.beta,
        "theta": dict(resumed.trainable.named_parameters()),
        "phi": dict(resumed.composer.named_parameters()),
    }
    return ref


def _compare(label: str, ref: dict, got: dict) -> None:
    assert len(ref["rows"]) == len(got["rows"])
    for a, b in zip(ref["rows"], got["rows"]):
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, rel=RTOL, abs=ATOL, nan_ok=True), f"{label} step {a['step']} {k}"
            else:
                assert b[k] == v, f"{label} step {a['step']} {k}"
    assert got["beta"] == pytest.approx(ref["beta"], rel=RTOL, abs=ATOL)
    for part in ("theta", "phi"):
        assert set(got[part]) == set(ref[part]), f"{label}: {part} names differ"
        worst = max(float((ref[part][n].detach() - got[part][n].detach()).abs().max()) for n in ref[part])
        print(f"{label}: {part} max |Δ| {worst:.2e}")
        assert worst < WEIGHT_ATOL, f"{label}: {part} differs by {worst}"


@pytest.mark.slow
def test_sharded_updates_and_checkpoint_match_one_process(tmp_path):
    from safetensors.torch import load_file

    from tests.distill.fsdp_worker import CASES

    _launch(2, "train", tmp_path)  # sharded over 2 ranks; checkpoint after update 2
    refs = {case: _reference(case, tmp_path) for case in CASES}  # before the 1-rank resume adds its own update
    _launch(1, "resume", tmp_path)  # the 2-rank checkpoint, resharded to 1 rank
    for case, ref in refs.items():
        trained = torch.load(tmp_path / f"{case}_train.pt", weights_only=True)
        _compare(f"{case} 2 ranks", ref, trained)
        assert any(r["grad_norm_theta"] > 0 for r in trained["rows"])
        if case.startswith("lopd"):  # φ trains and β moves, so their agreement says something
            assert any(r["grad_norm_phi"] > 0 for r in trained["rows"]) and ref["beta"] != 0.5
        last = {"rows": ref["rows"][2:], "beta": ref["beta"], "theta": ref["theta"], "phi": ref["phi"]}
        _compare(f"{case} resumed in 1 unsharded process", last, ref["resumed"])
        _compare(
            f"{case} resumed in 1 sharded process", last, torch.load(tmp_path / f"{case}_resume.pt", weights_only=True)
        )
        _compare(
            f"{case} replicated checkpoint resumed sharded",
            last,
            torch.load(tmp_path / f"{case}_resume_replicated.pt", weights_only=True),
        )
        # the exported Hugging Face student (LoRA merged) is the one-process run's
        one = load_file(tmp_path / "one" / case / "student" / "model.safetensors")
        two = load_file(tmp_path / case / "student" / "model.safetensors")
        assert one.keys() == two.keys()
        worst = max(float((one[k] - two[k]).abs().max()) for k in one)
        print(f"{case}: exported student max |Δ| {worst:.2e}")
        assert worst < WEIGHT_ATOL
