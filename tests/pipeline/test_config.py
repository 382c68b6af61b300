"""Configuration: the file loads to typed sections, overrides apply, and mistakes name key, value, expectation."""

import pytest

from lopd_core.config import ConfigError, Params, load_params


def test_params_yaml_loads_and_matches_defaults():
    params = load_params("params.yaml")
    assert isinstance(params, Params)
    # params.yaml spells out the defaults: a drift between the two would confuse users.
    assert params.to_dict() == Params().to_dict()


def test_overrides_keep_yaml_types():
    params = load_params("params.yaml", ["rollout.temperature=0.7", "eval.splits=[test_id]", "seed=3",
                                         "model.tiny.num_layers=2"])
    assert params.rollout.temperature == 0.7
    assert params.eval.splits == ["test_id"]
    assert params.seed == 3
    assert params.model.tiny.num_layers == 2


def test_int_widens_to_float():
    assert load_params("params.yaml", ["rollout.temperature=1"]).rollout.temperature == 1.0


def test_exponent_without_dot_is_a_number():
    # YAML 1.1 reads `3e-5` as a string; a float setting takes it as the number it spells.
    assert load_params("params.yaml", ["lopd.lr_student=3e-5"]).lopd.lr_student == 3e-5
    with pytest.raises(ConfigError, match="a number"):
        load_params("params.yaml", ["lopd.lr_student=fast"])


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("rollout.temprature=0.5", ["rollout.temprature", "unknown key", "temperature"]),
        ("rollout.temperature=-1", ["rollout.temperature", "-1", ">= 0"]),
        ("rollout.batch_size=abc", ["rollout.batch_size", "'abc'", "an integer"]),
        ("rollout.batch_size=true", ["rollout.batch_size", "True", "an integer"]),
        ("eval.with_experience=1", ["eval.with_experience", "1", "true or false"]),
        ("eval.modes=[greedy, beam]", ["eval.modes", "beam", "greedy, sampled"]),
        ("model.dtype=fp8", ["model.dtype", "fp8", "one of"]),
        ("envs.mix={nowhere: 1.0}", ["envs.mix", "nowhere", "known environments"]),
        ("nosection.key=1", ["nosection", "unknown key"]),
        ("model.tiny=3", ["model.tiny", "3", "mapping"]),
        ("rollout.top_p=0", ["rollout.top_p", "(0, 1]"]),
        ("model.warmstart.slip=1.5", ["model.warmstart.slip", "1.5", "[0, 1]"]),
    ],
)
def test_bad_values_fail_naming_key_value_and_expectation(override, fragments):
    with pytest.raises(ConfigError) as info:
        load_params("params.yaml", [override])
    for fragment in fragments:
        assert fragment in str(info.value)


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_params("params.yaml", ["rollout.temperature"])
    with pytest.raises(ConfigError, match="no such params file"):
        load_params(tmp_path / "other.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_params(bad)


@pytest.mark.parametrize("content, fragments", [
    (b"", ["holds no settings"]),
    (b"# only a comment\n", ["holds no settings"]),
    (b"lopd:\n  steps: [3\n", ["p.yaml:3:1", "not valid YAML"]),
    (b"lopd:\n  steps: 3\n lr_student: 1\n", ["p.yaml:3:2", "not valid YAML"]),
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", ["not a text file"]),
    (b"seed: 1\n\x00\x00\n", ["not a text file"]),
    (b"lopd:\n  steps: 3\n  lr_student: 0.1\n  steps: 4\n", ["p.yaml:4:3", "duplicate key 'steps'", "line 2"]),
    (b"seed: 1\nlopd: {steps: 3}\nseed: 2\n", ["p.yaml:3:1", "duplicate key 'seed'", "line 1"]),
], ids=["empty", "comments-only", "unclosed-list", "bad-indent", "binary", "nul-bytes", "duplicate-nested",
        "duplicate-section"])
def test_unreadable_params_files_fail_in_one_line_naming_the_file(tmp_path, content, fragments):
    path = tmp_path / "p.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_params(path)
    message = str(info.value)
    assert message.startswith(str(path)) and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_a_directory_given_as_params_file_is_named(tmp_path):
    folder = tmp_path / "params.yaml"
    folder.mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        load_params(folder)


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("lopd:\n  <<: {steps: 3, lr_student: 0.1}\n  steps: 5\n")
    assert load_params(path).lopd.steps == 5  # the explicit key overrides the merged default


def test_cli_prints_a_bad_params_file_without_traceback(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "p.yaml"
    path.write_text("seed: 1\nseed: 2\n")
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-m", "flows.cli", "evaluate", "--params", str(path)], cwd=root,
                         capture_output=True, text=True, check=False)
    assert res.returncode == 2  # the exit code of every invalid configuration
    assert f"{path}:2:1" in res.stderr and "duplicate key 'seed'" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_reports_config_error(capsys):
    from flows.cli import main

    assert main(["evaluate", "--set", "rollout.batch_size=0"]) == 2
    err = capsys.readouterr().err
    assert "rollout.batch_size" in err and "> 0" in err


def test_config_is_a_leaf_of_the_library():
    """Loading the configuration loads nothing of the library but the names it validates against: every
    command reads params.yaml, and the lower layers (model/, envs/) must not reach the trainer through it."""
    import subprocess
    import sys

    code = ("import sys, lopd_core.config; "
            "print(sorted(m for m in sys.modules if m.startswith('lopd_core')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["lopd_core", "lopd_core.config", "lopd_core.names", "lopd_core.offline"]


def test_names_equal_the_lists_their_modules_define():
    """lopd_core/names.py copies these lists so the config can stay a leaf; the copies must not drift."""
    from lopd_core import names
    from lopd_core.benchmarks.acebench import data as ace
    from lopd_core.benchmarks.bfcl import data as bfcl
    from lopd_core.lopd.methods import METHOD_NAMES

    assert names.METHOD_NAMES == METHOD_NAMES
    assert names.BFCL_CATEGORIES == bfcl.CATEGORIES
    assert names.ACEBENCH_GROUPS == ace.GROUPS and names.ACEBENCH_CATEGORIES == ace.CATEGORIES


def test_bank_retrieval_settings_travel_as_one_value():
    """Retrievers take `bank.retrieval` whole, so every retrieval setting (same_world, ef_search...) reaches them."""
    import dataclasses

    from lopd_core.config import RetrievalSettings

    params = load_params("params.yaml", ["bank.same_world=false", "bank.ef_search=50", "bank.top_j=2"])
    assert params.bank.retrieval == RetrievalSettings(top_j=2, allow_self_retrieval=True, same_world=False,
                                                      ef_search=50)
    assert {f.name for f in dataclasses.fields(RetrievalSettings)} <= {f.name for f in dataclasses.fields(params.bank)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.bank.retrieval.top_j = 5  # a copy: changing it would change nothing in params


def test_removed_dead_knob_is_rejected():
    # envs.train_tasks was read nowhere: a file that still sets it is told so rather than silently ignored
    with pytest.raises(ConfigError, match="envs.train_tasks: unknown key"):
        load_params("params.yaml", ["envs.train_tasks=4000"])


def test_warmstart_documents_which_length_settings_apply():
    """epochs and time_budget_s are not read while max_steps > 0; the docstring and params.yaml say so."""
    from pathlib import Path

    from lopd_core.config import WarmStartConfig

    assert "max_steps" in WarmStartConfig.__doc__ and "not read" in WarmStartConfig.__doc__
    text = Path(__file__).resolve().parents[2].joinpath("params.yaml").read_text()
    for key in ("epochs", "time_budget_s"):
        line = next(l for l in text.splitlines() if l.strip().startswith(f"{key}:"))
        assert "only when max_steps is 0" in line, line
