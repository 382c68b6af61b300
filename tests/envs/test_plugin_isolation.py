"""The plugin trust boundary (issue #30 item 3): a plugin's tools run in the trainer's process with the arguments
the model chose, so they reach the user's files, environment variables and local network — unless
`envs.isolate_tools` puts each episode in a sandboxed child. Either way a step that blocks is stopped after
`envs.step_timeout_s` with one line naming the env and the task, and `lopd envs check` says where tools run."""

import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lopd_cli.main import main
from lopd_core.envs import check_env_contract, format_call, make_env, make_tasks, registry
from lopd_core.envs.isolated import IsolatedEnv
from lopd_core.errors import EnvironmentStepFailed

SECRET = "LOPD_TEST_SECRET_TOKEN"


def use(plugins, *, isolate=False, timeout_s=30.0):
    registry.use_config(
        SimpleNamespace(plugins=plugins, task_files={}, isolate_tools=isolate, step_timeout_s=timeout_s)
    )


@pytest.fixture(autouse=True)
def clean_registry():
    yield
    registry.use_config(SimpleNamespace(plugins={}, task_files={}))


def first_call(env_name: str, tool: str, arguments: dict):
    """One fresh episode of `env_name`: the call, its step result and the environment."""
    (task,) = make_tasks(env_name, "train", 1, 0)
    env = make_env(task)
    env.reset(task)
    return env.step(format_call(tool, arguments)), env


@pytest.fixture
def listener():
    """A TCP listener on 127.0.0.1 that records what reaches it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3)
    received: list[bytes] = []

    def accept():
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            received.append(conn.recv(100))

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], received, thread
    server.close()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_in_process_tools_reach_files_secrets_and_local_ports(monkeypatch, listener):
    """The documented boundary: without isolation a tool is trusted code with the trainer's reach."""
    monkeypatch.setenv(SECRET, "s3cret")
    use({"snoop": "_plugin_fixture:SnoopEnv"})
    r, _ = first_call("snoop", "read_file", {"path": "/etc/passwd"})
    assert "root:" in r.observation
    r, _ = first_call("snoop", "read_env", {"name": SECRET})
    assert "s3cret" in r.observation
    port, received, thread = listener
    r, _ = first_call("snoop", "connect", {"port": port})
    thread.join(5)
    assert '"connected"' in r.observation and received == [b"hello from a tool"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_isolated_tools_cannot_read_files_secrets_or_reach_local_ports(monkeypatch, listener):
    monkeypatch.setenv(SECRET, "s3cret")
    use({"snoop": "_plugin_fixture:SnoopEnv"}, isolate=True)
    r, env = first_call("snoop", "read_file", {"path": "/etc/passwd"})
    assert isinstance(env, IsolatedEnv) and env.isolation["audit_hook"] is True
    assert "root:" not in r.observation and r.info["error"] == "failed"
    assert "PermissionError" in env.internal_errors[0]
    r, env = first_call("snoop", "read_env", {"name": SECRET})
    assert "s3cret" not in r.observation and r.observation == '{"result": ""}'  # a scrubbed environment
    port, received, thread = listener
    r, env = first_call("snoop", "connect", {"port": port})
    thread.join(5)
    assert r.info["error"] == "failed" and received == []
    assert "PermissionError" in env.internal_errors[0] or "OSError" in env.internal_errors[0]


@pytest.mark.parametrize("isolate", [False, True], ids=["in_process", "isolated"])
def test_a_step_that_blocks_is_stopped_with_one_line_naming_env_and_task(isolate):
    use({"sleepy": "_plugin_fixture:SleepyEnv"}, isolate=isolate, timeout_s=0.5)
    (task,) = make_tasks("sleepy", "train", 1, 0)
    env = make_env(task)
    env.reset(task)
    started = time.perf_counter()
    with pytest.raises(EnvironmentStepFailed) as caught:
        env.step("done")
    assert time.perf_counter() - started < 10  # the step sleeps for an hour
    message = str(caught.value)
    assert "\n" not in message and message.startswith(
        f"env 'sleepy' task {task.task_id}: step did not return within 0.5 s (envs.step_timeout_s)"
    )
    with pytest.raises(EnvironmentStepFailed):  # the env is unusable afterwards, never half-played on
        env.step("done")
    if isolate:  # the child's whole process group is dead (zombies wait for whoever reaps them)
        deadline = time.perf_counter() + 5
        while live_members(env._proc.pid) and time.perf_counter() < deadline:
            time.sleep(0.05)
        assert live_members(env._proc.pid) == []


def live_members(pgid: int) -> list[int]:
    """Processes of group `pgid` that are not zombies (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == pgid and state != "Z":
                out.append(int(entry))
    return out


@pytest.mark.parametrize("isolate", ["false", "true"])
def test_envs_check_of_a_blocking_step_fails_in_seconds(capsys, isolate):
    started = time.perf_counter()
    code = main(
        [
            "envs",
            "check",
            "sleepy",
            "--n",
            "1",
            "--set",
            "envs.plugins={sleepy: '_plugin_fixture:SleepyEnv'}",
            "--set",
            "envs.step_timeout_s=0.5",
            "--set",
            f"envs.isolate_tools={isolate}",
        ]
    )
    assert code == 1 and time.perf_counter() - started < 30
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[-1].startswith("note: ")
    for line, split in zip(lines, ("train", "test_id")):
        assert line.startswith(
            f"FAIL sleepy {split}: EnvironmentStepFailed: env 'sleepy' task sleepy/{split}/0/0: "
            "step did not return within 0.5 s (envs.step_timeout_s)"
        )


def test_envs_check_says_where_tools_run_and_checks_isolated_as_a_run_plays(capsys):
    assert main(["envs", "check", "library", "--n", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("OK library: the contract holds on 3 tasks")
    assert out[1] == (
        "note: library's tools are trusted code: they run inside the trainer's process with the "
        "arguments the model chose, and may read your files, environment variables and network; set "
        "envs.isolate_tools: true to run them in the sandbox"
    )
    assert main(["envs", "check", "library", "--n", "1", "--set", "envs.isolate_tools=true"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("OK library: the contract holds on 3 tasks")
    assert out[1].startswith("note: library's reset and step run isolated (envs.isolate_tools")


def test_the_contract_checker_plays_isolated_episodes_when_the_option_is_on():
    use({}, isolate=True)
    made = []

    def factory():
        made.append(make_env("library"))
        return made[-1]

    tasks = make_tasks("library", "train", 1, 0)
    assert check_env_contract(factory, tasks) == 1
    assert made and all(isinstance(env, IsolatedEnv) for env in made)
