"""The fault suite (issue: nothing lost, nothing silently wrong): each probe that once passed silently or lost
data, with the verdict it must get now. Probes of the trainer's divergence guard live in lopd/test_trainer.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

from lopd_core.config import ConfigError, Params, load_params
from lopd_core.errors import NonFiniteWeights
from lopd_core.locks import FolderLocked, folder_lock

ROOT = Path(__file__).resolve().parents[2]


# --- non-finite and out-of-range settings --------------------------------------------------------------------
@pytest.mark.parametrize(
    "assignment, key",
    [
        ("lopd.margin=.nan", "lopd.margin"),
        ("lopd.lr_student=.inf", "lopd.lr_student"),
        ("cycle.min_gain=.nan", "cycle.min_gain"),
        ("lopd.margin=1e9", "lopd.margin"),
        ("lopd.lr_composer=-.inf", "lopd.lr_composer"),
        ("model.device=tpu", "model.device"),
        ("lopd.max_skipped_share=1.5", "lopd.max_skipped_share"),
    ],
)
def test_non_finite_and_out_of_range_values_are_rejected_by_key(assignment, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_params(str(ROOT / "params.yaml"), [assignment])


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1", "mps"])
def test_device_names_that_exist_are_accepted(device):
    assert load_params(str(ROOT / "params.yaml"), [f"model.device={device}"]).model.device == device


def test_top_k_above_the_vocabulary_is_rejected(tiny_model, tiny_tokenizer):
    from lopd_core.distill.composer.composer import Composer
    from lopd_core.distill.loop.trainer import Distiller

    p = Params()
    p.lopd = replace(p.lopd, top_k=tiny_model.config.vocab_size + 5)
    composer = Composer(tiny_model.config.hidden_size, num_queries=2, num_layers=1, num_heads=2)
    with pytest.raises(ConfigError, match="lopd.top_k"):
        Distiller(
            p, tiny_model, tiny_tokenizer, lambda tasks: [[] for _ in tasks], composer=composer, log=lambda m: None
        )


def test_a_model_with_nan_weights_is_refused_at_load(tmp_path, tiny_model, tiny_tokenizer):
    """Probe: a model file with NaN weights evaluated greedily with normal-looking metrics."""
    import copy

    from lopd_core.model.loading import load_policy

    broken = copy.deepcopy(tiny_model)
    with torch.no_grad():
        next(broken.parameters()).fill_(float("nan"))
    broken.save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    p = Params()
    p.model = replace(p.model, name_or_path=str(tmp_path / "m"))
    with pytest.raises(NonFiniteWeights, match="non-finite weights"):
        load_policy(p.model)


# --- locks -----------------------------------------------------------------------------------------------------
def _hold(folder: str, ready, release) -> None:
    with folder_lock(folder, "the cycle folder"):
        ready.set()
        release.wait(30)


def test_a_second_writer_is_told_who_holds_the_folder(tmp_path):
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path / "cycles"), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with (
            pytest.raises(FolderLocked, match=rf"in use by pid {holder.pid}"),
            folder_lock(tmp_path / "cycles", "the cycle folder"),
        ):
            pass
    finally:
        release.set()
        holder.join(30)
    with folder_lock(tmp_path / "cycles", "the cycle folder"):  # released when the holder exits
        pass


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from lopd_core.locks import folder_lock\n"
        "with folder_lock(sys.argv[2], 'x'):\n    print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(tmp_path / "f")], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"held"
    proc.kill()
    proc.wait()
    with folder_lock(tmp_path / "f", "x"):
        pass


def test_the_lock_file_sits_beside_a_dvc_tracked_folder(tmp_path):
    (tmp_path / "bank").mkdir()
    with folder_lock(tmp_path / "bank", "the experience bank"):
        pass
    assert list((tmp_path / "bank").iterdir()) == [] and (tmp_path / ".bank.lock").exists()


def _successes(first: int, n: int) -> pd.DataFrame:
    """n oracle successes of distinct train tasks (task seed `first`): rows every refresh keeps."""
    from lopd_core.envs import make_tasks, run_oracle
    from lopd_core.rollout.engine import Trajectory
    from lopd_core.rollout.table import trajectories_to_frame

    trajs = []
    for task in make_tasks("toolworld", "train", n, seed=first):
        _, _, env = run_oracle(task)
        trajs.append(
            Trajectory(
                task=task,
                sample_index=0,
                experiences=(),
                token_ids=[1, 2],
                action_mask=[0, 1],
                sample_logprobs=[0.0, -0.1],
                prompt_length=1,
                reward=1.0,
                success=True,
                stop_reason="answer",
                num_turns=len(env.episode),
                episode=env.episode,
            )
        )
    return trajectories_to_frame(trajs).reset_index(drop=True)


def _refresh(bank_dir: str, offset: int, barrier, results) -> None:
    from lopd_core.bank.store import BankStore

    frame = _successes(offset, 4)
    barrier.wait(60)
    results.put(
        BankStore(Path(bank_dir) / "experience.parquet")
        .refresh(frame, min_reward=1.0, policy_version="p", cycle=0)
        .added
    )


def test_concurrent_bank_refreshes_lose_no_rows(tmp_path):
    """Probe: two refreshes behind a barrier both reported added=1 while the bank grew by 1 (4 of 4 trials)."""
    from lopd_core.bank.store import BankStore

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    workers = [ctx.Process(target=_refresh, args=(str(tmp_path), seed, barrier, results)) for seed in (0, 100)]
    for w in workers:
        w.start()
    added = [results.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(30)
    rows = BankStore(tmp_path / "experience.parquet").load()
    assert sum(added) == len(rows) == 8


def test_a_second_cycle_on_one_folder_fails_at_once(tmp_path):
    """Probe: two `lopd cycle` on one folder both ran "cycle 8" and history.json gained one record."""
    from flows.cycle import cycle_flow

    root = tmp_path / "cycles"
    with folder_lock(root, "the cycle folder"), pytest.raises(FolderLocked, match="the cycle folder"):
        cycle_flow.fn(params_file=str(ROOT / "params.yaml"), overrides=[f"cycle.dir={root}"], track=False)
    assert not (root / "history.json").exists()


# --- clean shutdown --------------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return " Z " not in stat  # a zombie has ended


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the watchdog reads /proc")
def test_a_killed_command_leaves_no_child_server_behind(tmp_path):
    """Probe: `kill -9` of `lopd cycle` orphaned its temporary Prefect server. Here a stand-in command starts a
    long-lived child under the watchdog and is killed; the child must end too."""
    code = (
        "import subprocess, sys, time; sys.path.insert(0, sys.argv[1]); from flows.reaper import start_reaper\n"
        "with start_reaper():\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "    print(child.pid, flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(ROOT)], stdout=subprocess.PIPE, cwd=ROOT)
    child = int(proc.stdout.readline())
    time.sleep(1.5)  # the watchdog has seen the child
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(child)


def test_a_normal_exit_stops_the_watchdog_and_spares_nothing_else(tmp_path):
    from flows.reaper import descendants, start_reaper

    before = set(descendants(os.getpid()))
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    with start_reaper():
        watchdogs = set(descendants(os.getpid())) - before - {sibling.pid}
        assert len(watchdogs) == 1  # the watchdog runs while the block does
    time.sleep(0.2)
    assert not any(_alive(pid) for pid in watchdogs)
    assert _alive(sibling.pid)  # a normal exit terminates nothing
    sibling.kill()
    sibling.wait()


def test_runs_left_running_by_a_dead_process_are_closed_as_failed(tmp_path):
    from lopd_core.config import TrackingConfig
    from tasks.tracking import OWNER_PID_TAG, Tracker

    tracker = Tracker(TrackingConfig(mlflow_uri=f"sqlite:///{tmp_path}/m.db"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tracker.start_run("crashed")
    tracker.set_tags(orphan, {OWNER_PID_TAG: dead.pid})
    live = tracker.start_run("running")  # this process: alive
    assert tracker.close_abandoned_runs() == [orphan]
    assert tracker.client.get_run(orphan).info.status == "FAILED"
    assert tracker.client.get_run(live).info.status == "RUNNING"


# --- small items ------------------------------------------------------------------------------------------------
def test_the_bank_file_is_as_readable_as_its_folder(tmp_path):
    """Probe: experience.parquet was mode 0600 (mkstemp's) while every other output was 0644."""
    from lopd_core.bank.store import BankStore
    from lopd_core.outputs import _umask

    store = BankStore(tmp_path / "experience.parquet")
    store.refresh(_successes(0, 2), min_reward=1.0, policy_version="p", cycle=0)
    assert (store.path.stat().st_mode & 0o777) == 0o666 & ~_umask()


def test_every_command_says_what_it_does_and_writes():
    from lopd_cli.main import WRITES, build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name in WRITES:
        text = commands[name].format_help()
        assert "Writes:" in text, name


_ONE_RUN = """
import sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
import lopd_core  # noqa: F401
from lopd_core.bank import ExperienceBank
from lopd_core.config import TinyModelConfig
from lopd_core.distill.loop import trainer
from lopd_core.distill.composer.composer import Composer, mean_embedding_norm
from lopd_core.drivers.distill import make_retriever
from lopd_core.model.demos import build_demos
from lopd_core.model.loading import tiny_qwen3
from lopd_core.model.tokenizer import train_tokenizer
from tests.pipeline.test_faults import _successes
from tests.distill.test_trainer import _params

out = Path(sys.argv[2])
demos = build_demos(n=120, experience_fraction=0.4, max_experiences=2, convention_noise=0.5, slip=0.1, seed=0)
tok = train_tokenizer((d.text() for d in demos), vocab_size=600)
torch.manual_seed(0)
model = tiny_qwen3(TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                   intermediate_size=64), tok).eval()
bank = ExperienceBank(out / "bank" / "experience.parquet", index_dir=out / "index")
bank.refresh(_successes(0, 24), min_reward=1.0, policy_version="p", cycle=0)
p = _params(out, steps=4)
torch.manual_seed(0)
composer = Composer(model.config.hidden_size, num_queries=4, num_layers=1, num_heads=2,
                    embedding_norm=mean_embedding_norm(model))
d = trainer.Distiller(p, model, tok, make_retriever(bank, p.bank.retrieval), composer=composer, log=lambda m: None)
from lopd_core.distill.loop.loop import run_distill
run_distill(d)
"""


@pytest.mark.slow
def test_one_seed_gives_one_csv(tmp_path):
    """Probe: three `lopd distill --fresh` with one seed gave two variants of β. Two fresh processes (their own
    hash seeds, Chroma index built in each) must write the same numbers, the timing column aside."""
    frames = []
    for i, hash_seed in enumerate(("1", "2")):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "2"}
        subprocess.run(
            [sys.executable, "-c", _ONE_RUN, str(ROOT), str(tmp_path / f"run{i}")],
            env=env,
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
        frames.append(pd.read_csv(tmp_path / f"run{i}" / "plots" / "distill.csv").drop(columns=["step_seconds"]))
    pd.testing.assert_frame_equal(frames[0], frames[1], check_exact=True)
