"""End to end through the `lopd` command line: build a (small) base, load it as a plain Hugging Face model,
evaluate it, and fail clearly when the model is missing. Slow tier: it trains for real."""

import json
import subprocess
import sys

import pytest

SMALL = [
    "--set",
    "model.tiny.hidden_size=48",
    "--set",
    "model.tiny.num_layers=2",
    "--set",
    "model.tiny.num_heads=2",
    "--set",
    "model.tiny.num_kv_heads=1",
    "--set",
    "model.tiny.intermediate_size=96",
    "--set",
    "model.tiny.vocab_size=800",
    "--set",
    "model.warmstart.demos=300",
    "--set",
    "model.warmstart.time_budget_s=25",
    "--set",
    "model.warmstart.max_steps=0",
]


def lopd(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "lopd_cli.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    import pathlib
    import shutil
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    work = tmp_path_factory.mktemp("proj")
    shutil.copy(root / "params.yaml", work / "params.yaml")
    # every package the project installs, as pyproject lists them (a new one is linked without editing this)
    find = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for pkg in {pattern.rstrip("*") for pattern in find["include"]}:
        (work / pkg).symlink_to(root / pkg)
    return work


@pytest.fixture(scope="module")
def built(workdir):
    base = lopd("base", *SMALL, cwd=workdir)
    assert base.returncode == 0, base.stderr
    assert "base built" in base.stdout
    return workdir


@pytest.mark.slow
def test_base_then_evaluate(built):
    workdir = built
    model_dir = workdir / "data" / "base"
    report = json.loads((model_dir / "build_report.json").read_text())
    assert report["steps"] > 0 and report["final_loss"] > 0

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "tools: x"}, {"role": "user", "content": "[aurora] hi"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=8)
    assert out.shape[1] > prompt["input_ids"].shape[1]

    ev = lopd(
        "evaluate",
        *SMALL,
        "--set",
        "eval.n_per_split=6",
        "--set",
        "rollout.max_new_tokens=48",
        "--set",
        "eval.with_experience=true",
        cwd=workdir,
    )
    assert ev.returncode == 0, ev.stderr
    metrics = json.loads((workdir / "metrics" / "eval.json").read_text())
    for split in ("test_id", "test_ood", "test_id+experience", "test_ood+experience"):
        for mode in ("greedy", "sampled"):
            cell = metrics["toolworld"][split][mode]
            assert cell["n"] == 6 and 0.0 <= cell["success_rate"] <= 1.0
            assert cell["ci95"][0] <= cell["success_rate"] <= cell["ci95"][1]


@pytest.mark.slow
def test_missing_model_fails_clearly(tmp_path):
    (tmp_path / "params.yaml").write_text("model:\n  base_dir: nowhere\n")
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    for pkg in ("lopd_core", "flows", "tasks"):
        (tmp_path / pkg).symlink_to(root / pkg)
    res = lopd("evaluate", cwd=tmp_path)
    assert res.returncode == 1
    assert "lopd base" in res.stderr and "Traceback" not in res.stderr
    res = lopd("evaluate", "--set", "model.name_or_path=no-such-org/no-such-model", cwd=tmp_path)
    assert res.returncode == 1
    assert "cannot load model" in res.stderr and "Traceback" not in res.stderr


LOPD_SMALL = SMALL + [
    "--set",
    "bank.seed_tasks=12",
    "--set",
    "bank.samples_per_task=1",
    "--set",
    "coldstart.oracle_tasks=16",
    "--set",
    "envs.pretrain_worlds=2",
    "--set",
    "composer.num_queries=4",
    "--set",
    "composer.num_layers=1",
    "--set",
    "composer.num_heads=2",
    "--set",
    "coldstart.steps=3",
    "--set",
    "coldstart.batch_size=4",
    "--set",
    "coldstart.fit_steps=3",
    "--set",
    "coldstart.fit_batch_size=4",
    "--set",
    "lopd.steps=3",
    "--set",
    "lopd.tasks_per_step=2",
    "--set",
    "lopd.samples_per_task=2",
    "--set",
    "lopd.checkpoint_every=1",
    "--set",
    "rollout.max_new_tokens=32",
]


@pytest.mark.slow
def test_bank_coldstart_distill_resume_and_export(built):
    workdir = built
    bank = lopd("bank", *LOPD_SMALL, cwd=workdir)
    assert bank.returncode == 0, bank.stderr
    report = json.loads((workdir / "data" / "bank" / "bank_report.json").read_text())
    assert report["rollouts"] == 12  # the agent's own samples only: no oracle episode enters a deployment world's bank
    assert report["bank_rows"] <= report["rollouts"]
    # probe: the report once said refresh {"added": 0, "total": 0} beside "bank_rows": 8 (two refreshes, one shown)
    assert report["refresh"]["total"] == report["bank_rows"] == report["refresh"]["added"]

    cold = lopd("coldstart", *LOPD_SMALL, cwd=workdir)
    assert cold.returncode == 0, cold.stderr
    assert (workdir / "data" / "composer" / "phi0.pt").exists()
    assert "cold start done" in cold.stdout

    early = lopd("distill", *LOPD_SMALL, cwd=workdir)  # before `lopd fit`: the composer it starts from is missing
    assert early.returncode == 1 and "run `lopd fit` first" in early.stderr, early.stderr
    fit = lopd("fit", *LOPD_SMALL, cwd=workdir)
    assert fit.returncode == 0, fit.stderr
    assert (workdir / "data" / "composer_fit" / "phi.pt").exists()
    if report["bank_rows"]:  # a bank with rows to read: φ is fitted on the seed rollouts that retrieve them
        assert "fit done" in fit.stdout
        with open(workdir / "plots" / "fit.csv") as f:
            assert len(f.read().splitlines()) == 1 + 3

    first = lopd("distill", *LOPD_SMALL, "--stop-after", "1", cwd=workdir)
    assert first.returncode == 0, first.stderr
    rest = lopd("distill", *LOPD_SMALL, cwd=workdir)
    assert rest.returncode == 0, rest.stderr
    assert "resumed at step 1" in rest.stdout
    import csv

    with open(workdir / "plots" / "distill.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]

    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(workdir / "data" / "lopd" / "student")
    assert student.config.model_type == "qwen3"
