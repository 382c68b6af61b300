"""The orchestration layer, piece by piece and fast: cache keys, the promotion gate, MLflow lineage on a
temporary SQLite file, export (loads as a plain HF model and answers a task), the offline report, the task
wrappers through `.fn()`, and the static DVC / Prefect configuration."""

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import yaml

from lopd_core.config import Params, load_params
from tasks.caching import by_stage_key, content_hash, key_payload, stage_key

ROOT = Path(__file__).resolve().parents[2]
CSV_COLUMNS = [
    "step",
    "rollouts",
    "reward_mean",
    "success_rate",
    "distill_loss",
    "kl_phi",
    "delta",
    "beta",
    "anchor",
    "student_entropy",
    "teacher_entropy",
    "topk_mass",
    "grad_norm_theta",
    "grad_norm_phi",
    "latent_norm_ratio",
    "step_seconds",
]


def distill_csv(path: Path, steps: int = 4, margin: float = 0.05) -> Path:
    """A plausible distill CSV: β follows the dual-ascent rule of DESIGN §5 from δ̄."""
    rows, beta = [], 0.0
    for s in range(1, steps + 1):
        delta = 0.01 * s
        rows.append(
            {
                "step": s,
                "rollouts": 20 + 8 * s,
                "reward_mean": 0.1 + 0.02 * s,
                "success_rate": 0.05 * s,
                "distill_loss": 1.0 / s,
                "kl_phi": 0.5 / s,
                "delta": delta,
                "beta": beta,
                "anchor": 0.01,
                "student_entropy": 2.0 - 0.1 * s,
                "teacher_entropy": 1.5,
                "topk_mass": 0.9,
                "grad_norm_theta": 1.0,
                "grad_norm_phi": 0.5,
                "latent_norm_ratio": 1.0,
                "step_seconds": 1.0,
                "replay_kl": 0.001 * s,  # lopd.replay_share > 0: drawn beside the KL terms
            }
        )
        beta = max(0.0, beta + 0.5 * (margin - delta))
    pd.DataFrame(rows, columns=CSV_COLUMNS).to_csv(path, index=False)
    return path


def eval_json(success: float, reward: float) -> dict:
    cell = {"success_rate": success, "reward_mean": reward, "n": 10, "ci95": [max(0.0, success - 0.1), success + 0.1]}
    return {"toolworld": {split: {"greedy": dict(cell), "sampled": dict(cell)} for split in ("test_id", "test_ood")}}


# ---- cache keys ---------------------------------------------------------------------------------------------
def test_content_hash_follows_content_not_names_or_order(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, order in ((a, ["x", "y"]), (b, ["y", "x"])):
        d.mkdir()
        for name in order:
            (d / name).write_text(f"content of {name}")
    assert content_hash(a) == content_hash(b)
    (b / "_stage.json").write_text("{}")  # a stage's completion marker is not content
    assert content_hash(a) == content_hash(b)
    (b / "x").write_text("changed")
    assert content_hash(a) != content_hash(b)
    assert content_hash(tmp_path / "nowhere") == "missing" and content_hash(None) == "none"


def test_stage_key_changes_with_params_and_inputs_only(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "w").write_text("weights")
    params = Params()
    key = stage_key(key_payload("distill", {"lopd": params.lopd}, {"policy": model}))
    assert key == stage_key(key_payload("distill", {"lopd": Params().lopd}, {"policy": model}))
    changed = load_params("params.yaml", ["lopd.margin=0"])
    assert key != stage_key(key_payload("distill", {"lopd": changed.lopd}, {"policy": model}))
    (model / "w").write_text("other weights")
    assert key != stage_key(key_payload("distill", {"lopd": params.lopd}, {"policy": model}))
    assert by_stage_key(None, {"stage": "distill", "key": key}) == f"distill-{key}"


def test_path_params_do_not_enter_stage_keys():
    from flows.stage_flows import section

    a = load_params("params.yaml")
    b = load_params("params.yaml", ["bank.dir=elsewhere", "bank.index_dir=elsewhere_index", "lopd.csv=x.csv"])
    assert section(a, "bank") == section(b, "bank") and section(a, "lopd") == section(b, "lopd")
    assert section(a, "bank") != section(load_params("params.yaml", ["bank.top_j=2"]), "bank")


# ---- the promotion gate -------------------------------------------------------------------------------------
def test_gate_averages_held_out_splits_and_needs_a_strict_gain():
    from lopd_core.drivers.cycle_record import gate_score

    params = load_params("params.yaml", ["cycle.gate_metric=success_rate"])
    champion, student = eval_json(0.10, 0.3), eval_json(0.10, 0.4)
    student["toolworld"]["test_ood"]["greedy"]["success_rate"] = 0.2
    assert gate_score(params, champion) == pytest.approx(0.10)
    assert gate_score(params, student) == pytest.approx(0.15)  # mean of 0.10 and 0.20
    assert not gate_score(params, champion) > gate_score(params, champion) + params.cycle.min_gain  # a tie
    reward_gate = load_params("params.yaml", ["cycle.gate_metric=reward_mean", "cycle.gate_splits=[test_id]"])
    assert gate_score(reward_gate, student) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="gate"):
        gate_score(params, {"toolworld": {"train": {}}})


def _gate_outcomes(split: str, successes: int, n: int = 40) -> pd.DataFrame:
    """n tasks of one split, the first `successes` solved (lopd_core/outcomes.py's columns)."""
    return pd.DataFrame(
        {
            "env": "toolworld",
            "split": split,
            "mode": "greedy",
            "task_id": [f"{split}/{i}" for i in range(n)],
            "template": [f"t{i % 20}" for i in range(n)],
            "world": "cobalt",
            "success": [i < successes for i in range(n)],
            "reward": [1.0 if i < successes else 0.0 for i in range(n)],
            "turns": 2,
            "tokens": 30,
            "batch": 0,
        }
    )


def test_the_gate_record_and_summary_show_each_guard_since_the_champion_and_the_root_and_its_curve():
    """Root, champion and student on 40 tasks of a gate split and 40 of pretrain_test: the student gains 20 tasks on
    test_id and loses 4 of 20 on pretrain_test since the champion, 8 of 24 since the root. Its guard since the root
    cannot show a fall within the 10-point budget (8 losses, no win: a 20-point fall) and fails."""
    from lopd_core import gate as G
    from lopd_core.drivers.cycle_record import gate_record
    from lopd_core.drivers.cycle_summary import gate_line, guard_curves, guard_lines

    params = load_params("params.yaml", ["cycle.gate_metric=success_rate", "cycle.gate_splits=[test_id]"])
    root, champion, student = (
        pd.concat([_gate_outcomes("test_id", gate), _gate_outcomes("pretrain_test", kept)])
        for gate, kept in ((5, 24), (5, 20), (25, 16))
    )
    rule = G.rule_from(params.cycle, ["toolworld"])
    assert [g.name for g in rule.guards] == ["toolworld pretrain_test success"]  # gate_success: not on success
    decision = G.decide(champion, student, rule, root=root)
    gate = gate_record(decision, (0.1, 40, 0.2))
    (guard,) = gate["guards"]
    assert (guard["root"], guard["champion"], guard["student"]) == (0.6, 0.5, 0.4)
    assert not guard["vs_champion"]["failed"] and guard["vs_root"]["failed"] and not decision.promoted
    # 20 wins, no loss: p = 2^-20 (the 20 ties' −0.02 each cannot undo a single win)
    assert gate["p"] == pytest.approx(2**-20, rel=1e-9) and gate["alpha"] == pytest.approx(0.025)
    (line,) = guard_lines(gate)
    assert line.startswith("toolworld pretrain_test success: since the champion -10.0 points [")
    assert "a fall beyond 10 points) -> ok; since the root -20.0 points [" in line and line.endswith("-> FAILED")
    assert "exact one-sided paired sign-flip test at 2.5 % of success_rate" in gate_line(gate, params)
    assert "min gain +2.0 points" in gate_line(gate, params)
    history = [{"cycle": 1, "promoted": True, "gate": {"guards": [{**guard, "student": 0.5}]}}]
    history.append({"cycle": 2, "promoted": False, "gate": gate})
    curves = guard_curves(history)
    assert curves == {
        "toolworld pretrain_test success": "cycle 1 50.0* vs root 60.0 -> cycle 2 40.0 vs root 60.0 (%; * promoted)"
    }
    # the gate's batch in the record and the summary's line: fresh tasks, read by no earlier decision
    placed = gate_record(decision, (0.1, 40, 0.2), batches=[3], n_per_split=40)
    assert placed["batches"] == [3] and placed["tasks"] == [120, 160]
    assert "on fresh batch(es) 3 (instances 120..159 of each split" in gate_line(placed, params)


# ---- MLflow lineage -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    from lopd_core.config import TrackingConfig
    from tasks.tracking import Tracker

    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    return Tracker(TrackingConfig(mlflow_uri=f"sqlite:///{db}", experiment="unit"))


def test_environment_overrides_the_tracking_uri(monkeypatch):
    from lopd_core.config import TrackingConfig
    from tasks.tracking import tracking_uri

    assert tracking_uri(TrackingConfig()) == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert tracking_uri(TrackingConfig()) == "http://tracking.example:5000"


def test_parent_and_child_runs_carry_step_metrics_params_and_tags(tracker, tmp_path):
    from tasks.tracking import eval_metrics

    parent = tracker.start_run("cycle-1", tags={"lopd.cycle": 1, "git.commit": "abc"})
    tracker.log_params(parent, Params().to_dict())
    child = tracker.start_run("distill", parent=parent, tags={"lopd.stage": "distill"})
    steps = tracker.log_step_metrics(child, distill_csv(tmp_path / "distill.csv", steps=5))
    tracker.log_metrics(child, eval_metrics(eval_json(0.2, 0.5)))
    tracker.end(child)
    tracker.end(parent)

    client = tracker.client
    run = client.get_run(child)
    assert steps == 5 and run.data.tags["mlflow.parentRunId"] == parent
    for name in ("beta", "delta", "reward_mean", "success_rate", "kl_phi", "student_entropy"):
        assert [m.step for m in client.get_metric_history(child, name)] == [1, 2, 3, 4, 5], name
    assert run.data.metrics["eval.toolworld.test_id.greedy.success_rate"] == pytest.approx(0.2)
    top = client.get_run(parent)
    assert top.data.params["lopd.margin"] == "auto" and top.data.params["model.tiny.hidden_size"] == "128"
    assert top.data.tags["git.commit"] == "abc"


def test_eval_metric_names_are_valid_for_mlflow():
    from tasks.tracking import eval_metrics

    names = eval_metrics(
        {"toolworld": {"test_id+experience": {"greedy": eval_json(0.1, 0.2)["toolworld"]["test_id"]["greedy"]}}}
    )
    assert "eval.toolworld.test_id_experience.greedy.success_rate" in names


def test_dvc_hash_matches_what_dvc_records(tmp_path):
    import hashlib

    from tasks.tracking import dvc_hash

    (tmp_path / "f.bin").write_bytes(b"bank rows")
    assert dvc_hash(tmp_path / "f.bin") == hashlib.md5(b"bank rows").hexdigest()
    assert dvc_hash(tmp_path).endswith(".dir")


# ---- export: a plain HF checkpoint that answers a task ------------------------------------------------------
def test_export_loads_with_from_pretrained_and_answers_a_task(student_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lopd_core.envs import make_tasks
    from lopd_core.model.chat import ChatCodec
    from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout
    from tasks.stage_tasks import export_task

    params = Params()
    (tmp_path / "eval.json").write_text(json.dumps(eval_json(0.25, 0.6)))
    out = export_task.fn(
        str(student_dir),
        str(tmp_path / "export"),
        params,
        str(tmp_path / "eval.json"),
        None,
        {"cycle": 1, "bank DVC md5": "abc.dir"},
    )
    card = (Path(out) / "README.md").read_text()
    assert "25.0 %" in card and "abc.dir" in card and "AutoModelForCausalLM" in card
    assert json.loads((Path(out) / "lineage.json").read_text())["cycle"] == 1
    assert json.loads((Path(out) / "generation_config.json").read_text())["max_new_tokens"] == 64

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    task = make_tasks("toolworld", "test_id", 1, 0)[0]
    (traj,) = rollout(
        model,
        ChatCodec(tokenizer),
        [RolloutRequest(task)],  # no bank, composer or latents
        sampling=Sampling(temperature=0.0, max_new_tokens=16, max_context=1024),
        seed=0,
    )
    assert sum(traj.action_mask) > 0 and 0.0 <= traj.reward <= 1.0


def test_export_merges_a_lora_adapter(student_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lopd_core.export import export_checkpoint

    base = AutoModelForCausalLM.from_pretrained(student_dir)
    adapter = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapter.save_pretrained(tmp_path / "adapter")
    AutoTokenizer.from_pretrained(student_dir).save_pretrained(tmp_path / "adapter")
    out = export_checkpoint(tmp_path / "adapter", tmp_path / "merged", rollout=Params().rollout)
    assert not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name, _ in merged.named_parameters())


# ---- the offline report -------------------------------------------------------------------------------------
def test_report_is_self_contained_with_every_curve(tmp_path):
    from tasks.stage_tasks import report_task

    csvs = [distill_csv(tmp_path / f"c{i}.csv", steps=3 + i) for i in (1, 2)]
    (tmp_path / "base.json").write_text(json.dumps(eval_json(0.0, 0.2)))
    (tmp_path / "student.json").write_text(json.dumps(eval_json(0.1, 0.3)))
    path = report_task.fn(
        [{"label": f"cycle {i}", "csv": str(c), "margin": 0.05} for i, c in enumerate(csvs, 1)],
        [
            {"label": "base", "path": str(tmp_path / "base.json")},
            {"label": "student", "path": str(tmp_path / "student.json")},
        ],
        str(tmp_path / "report"),
        "test report",
        [("promoted", "no")],
    )
    page = Path(path).read_text()
    figures = ("reward_success", "delta_margin", "beta", "kl_entropy", "reward_signal", "eval")
    for png in figures:
        assert (tmp_path / "report" / f"{png}.png").stat().st_size > 1000
    assert page.count("data:image/png;base64,") == len(figures)
    assert "http://" not in page and "https://" not in page and "<script" not in page  # works offline
    assert "cycle 2" in page and "10.0% [0.0, 20.0]" in page
    margin = pd.read_csv(tmp_path / "report" / "delta_margin.csv")
    assert set(margin["margin"]) == {0.05} and len(margin) == 4 + 5


# ---- static configuration: DVC and Prefect -----------------------------------------------------------------
def test_dvc_stages_are_lopd_commands_over_known_params():
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    stages = spec["stages"]
    assert list(stages) == [
        "base",
        "plugins",
        "bank",
        "coldstart",
        "fit",
        "teacher",
        "distill",
        "evaluate",
        "export",
        "report",
    ]
    known = Params().to_dict()
    for name, stage in stages.items():
        cmds = stage["cmd"] if isinstance(stage["cmd"], list) else [stage["cmd"]]
        assert all(c.startswith("lopd ") for c in cmds), name
        for dotted in stage.get("params", []):
            node = known
            for part in dotted.split("."):
                assert part in node, f"{name}: params {dotted} not in params.yaml"
                node = node[part]
    outs = [o if isinstance(o, str) else next(iter(o)) for s in stages.values() for o in s.get("outs", [])]
    index_dir = Params().bank.index_dir
    assert "data/bank" in outs and not any(o == index_dir or index_dir.startswith(o + "/") for o in outs)
    assert (ROOT / ".dvc" / "config").exists()


def test_prefect_deployment_points_at_the_cycle_flow():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    (deployment,) = spec["deployments"]
    module, func = deployment["entrypoint"].split(":")
    assert module == "flows/cycle.py" and func == "cycle_flow"
    assert deployment["work_pool"]["name"] and deployment["schedules"][0]["cron"]
    from flows import cycle

    assert getattr(cycle, func).name == "lopd-cycle"


def test_report_renders_in_headless_chromium(tmp_path):
    """The check a person would do: open the page offline in a browser and look (scripts/screenshot_report.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("screenshot_report", ROOT / "scripts" / "screenshot_report.py")
    shot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shot)
    if shot.find_browser() is None:
        pytest.skip("no Chromium installed (apt-get install chromium)")
    from lopd_core.run_report import EvalColumn, TrainingRun, write_report

    page = write_report(
        [TrainingRun("cycle 1", distill_csv(tmp_path / "d.csv"), 0.05)],
        [EvalColumn("base", eval_json(0.0, 0.2))],
        tmp_path / "report",
    )
    png = shot.screenshot(page, tmp_path / "shot.png", height=1600)
    from PIL import Image

    image = Image.open(png).convert("L")
    assert image.size == (1200, 1600)
    assert image.getextrema()[0] < 100  # something dark was drawn (text, axes), not a blank page


def test_cycle_summary_shows_every_environment_of_the_mix(tmp_path):
    """A plugin environment's success is in the summary, on the splits it has; one env keeps the plain lines."""
    import json

    from lopd_core.config import EnvsConfig, Params
    from lopd_core.drivers.cycle_summary import summarize

    def cell(rate):
        return {"success_rate": rate, "reward_mean": rate, "n": 4, "ci95": [0.0, 1.0]}

    results = {
        "toolworld": {s: {"greedy": cell(0.25)} for s in ("test_id", "test_ood", "pretrain_test")},
        "library": {s: {"greedy": cell(0.5)} for s in ("test_id", "test_ood")},
    }
    for name in ("base", "student"):
        (tmp_path / f"{name}.json").write_text(json.dumps(results))
    record = {
        "cycle": 1,
        "seconds": 1.0,
        "eval": {k: str(tmp_path / f"{k}.json") for k in ("base", "student")},
        "final_beta": 0.1,
        "final_delta": 0.0,
        "delta_mean": 0.0,
        "margin": 0.05,
        "promoted": False,
        "gate": {"student": 0.2, "champion": 0.2},
        "cached": {},
        "export": "x",
        "version": 1,
        "report": "r",
    }
    params = Params()
    params.eval = replace(params.eval, modes=["greedy"])
    plain = "\n".join(summarize(record, params))
    assert "    test_id        greedy   25.0% [0.0, 100.0] -> 25.0%" in plain and "library" not in plain
    params.envs = EnvsConfig(mix={"toolworld": 1.0, "library": 0.5})
    both = "\n".join(summarize(record, params))
    assert "toolworld test_id" in both and "library test_ood" in both and "library pretrain_test" not in both
    assert "library test_id greedy   50.0% [0.0, 100.0] -> 50.0%" in both
