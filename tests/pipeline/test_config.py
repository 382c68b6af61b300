"""Configuration: the file loads to typed sections, overrides apply, bad values are refused naming the key and the
value wherever they come from, and params.yaml and --help say what the definitions say."""

import dataclasses

import pytest

from lopd_core.config import (
    ConfigError,
    EvalConfig,
    LopdConfig,
    ModelConfig,
    Params,
    RolloutConfig,
    TinyModelConfig,
    load_params,
)


def test_params_yaml_loads_and_matches_defaults():
    params = load_params("params.yaml")
    assert isinstance(params, Params)
    # params.yaml spells out the defaults: a drift between the two would confuse users.
    assert params.to_dict() == Params().to_dict()


def test_overrides_keep_yaml_types():
    params = load_params(
        "params.yaml", ["rollout.temperature=0.7", "eval.splits=[test_id]", "seed=3", "model.tiny.num_layers=2"]
    )
    assert params.rollout.temperature == 0.7
    assert params.eval.splits == ["test_id"]
    assert params.seed == 3
    assert params.model.tiny.num_layers == 2


def test_int_widens_to_float():
    assert load_params("params.yaml", ["rollout.temperature=1"]).rollout.temperature == 1.0


def test_exponent_without_dot_is_a_number():
    # YAML 1.1 reads `3e-5` as a string; a float setting takes it as the number it spells.
    assert load_params("params.yaml", ["lopd.lr_student=3e-5"]).lopd.lr_student == 3e-5
    with pytest.raises(ConfigError, match=r"lopd\.lr_student: got 'fast'"):
        load_params("params.yaml", ["lopd.lr_student=fast"])


@pytest.mark.parametrize(
    "override, key, refused",
    [
        ("rollout.temprature=0.5", "rollout.temprature", "0.5"),
        ("rollout.temperature=-1", "rollout.temperature", "-1"),
        ("rollout.batch_size=abc", "rollout.batch_size", "'abc'"),
        ("rollout.batch_size=true", "rollout.batch_size", "True"),
        ("eval.with_experience=1", "eval.with_experience", "1"),
        ("eval.modes=[greedy, beam]", "eval.modes", "beam"),
        ("model.dtype=fp8", "model.dtype", "fp8"),
        ("envs.mix={nowhere: 1.0}", "envs.mix", "nowhere"),
        ("nosection.key=1", "nosection", "1"),
        ("model.tiny=3", "model.tiny", "3"),
        ("rollout.top_p=0", "rollout.top_p", "0"),
        ("model.warmstart.slip=1.5", "model.warmstart.slip", "1.5"),
        ("lopd.method=nonsense", "lopd.method", "nonsense"),
        ("lopd.steps=-1", "lopd.steps", "-1"),
        ("lopd.margin=nan", "lopd.margin", "nan"),
    ],
)
def test_bad_values_are_refused_naming_key_and_value(override, key, refused):
    with pytest.raises(ConfigError) as info:
        load_params("params.yaml", [override])
    message = str(info.value)
    assert message.startswith(f"{key}:") and refused in message, message


@pytest.mark.parametrize(
    "build, key, refused",
    [
        (lambda: LopdConfig(method="nonsense", steps=-1), "lopd.method", "nonsense"),
        (lambda: LopdConfig(steps=-1), "lopd.steps", "-1"),
        (lambda: dataclasses.replace(Params().lopd, lr_student=0.0), "lopd.lr_student", "0.0"),
        (lambda: RolloutConfig(temperature="hot"), "rollout.temperature", "hot"),
        (lambda: TinyModelConfig(num_layers=0), "model.tiny.num_layers", "0"),
        (lambda: ModelConfig(tiny={"num_layers": 0}), "model.tiny.num_layers", "0"),
        (lambda: EvalConfig(modes=["beam"]), "eval.modes", "beam"),
    ],
    ids=["method", "steps", "replace", "type", "nested", "nested-mapping", "list"],
)
def test_sections_built_in_python_refuse_what_the_file_refuses(build, key, refused):
    with pytest.raises(ConfigError) as info:
        build()
    message = str(info.value)
    assert message.startswith(f"{key}:") and refused in message, message


def test_sections_are_frozen_and_replace_checks_the_new_value():
    params = Params()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.lopd.steps = 3
    assert dataclasses.replace(params.lopd, steps=3).steps == 3
    assert dataclasses.replace(params.rollout, temperature=1).temperature == 1.0  # ints widen, as in the file
    assert all(
        dataclasses.is_dataclass(v) and type(v).__dataclass_params__.frozen
        for v in vars(params).values()
        if dataclasses.is_dataclass(v)
    )


def test_every_method_of_the_table_is_a_valid_lopd_method():
    from lopd_core.methods import METHOD_NAMES

    for name in METHOD_NAMES:
        assert LopdConfig(method=name).method == name


def test_training_rollouts_sample_from_one_section():
    """lopd.temperature was a second temperature for the same rollouts: a file that sets it is sent to rollout."""
    assert not any(f.name in ("temperature", "top_p", "max_new_tokens") for f in dataclasses.fields(LopdConfig))
    with pytest.raises(ConfigError) as info:
        load_params("params.yaml", ["lopd.temperature=0.5"])
    assert str(info.value).startswith("lopd.temperature:") and "rollout.temperature" in str(info.value)


def _settings(section, prefix=""):
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        yield f"{prefix}{f.name}", f, value
        if dataclasses.is_dataclass(value):
            yield from _settings(value, f"{prefix}{f.name}.")


def test_every_setting_has_help():
    missing = [key for key, f, _ in _settings(Params()) if not f.metadata.get("help", "").strip()]
    assert not missing, missing


def test_params_yaml_is_written_from_the_definitions():
    """params.yaml's values and comments are the definitions' defaults and help: rewrite it with
    `python -m lopd_core.config --write-params` after changing one."""
    from pathlib import Path

    from lopd_core.config import params_yaml

    text = Path(__file__).resolve().parents[2].joinpath("params.yaml").read_text(encoding="utf-8")
    assert text == params_yaml(Params()), "params.yaml is stale: run python -m lopd_core.config --write-params"
    for key, f, value in _settings(Params()):
        if not dataclasses.is_dataclass(value):
            assert " ".join(f.metadata["help"].split())[:30] in " ".join(text.split()), key


def test_command_help_lists_the_settings_it_reads_with_their_help():
    import argparse

    from lopd_cli.main import build_parser
    from lopd_core.settings.fields import help_of

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["distill"].format_help().split())
    assert "lopd.steps = 64" in text and " ".join(help_of(LopdConfig, "steps").split()) in text
    assert "rollout.temperature = 1.0" in text
    assert "eval.out" not in text  # distill does not read the eval section


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="'rollout.temperature'"):
        load_params("params.yaml", ["rollout.temperature"])
    with pytest.raises(ConfigError, match="other.yaml"):
        load_params(tmp_path / "other.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_params(bad)


@pytest.mark.parametrize(
    "content, fragments",
    [
        (b"", ["holds no settings"]),
        (b"# only a comment\n", ["holds no settings"]),
        (b"lopd:\n  steps: [3\n", ["p.yaml:3:1", "not valid YAML"]),
        (b"lopd:\n  steps: 3\n lr_student: 1\n", ["p.yaml:3:2", "not valid YAML"]),
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", ["not a text file"]),
        (b"seed: 1\n\x00\x00\n", ["not a text file"]),
        (b"lopd:\n  steps: 3\n  lr_student: 0.1\n  steps: 4\n", ["p.yaml:4:3", "duplicate key 'steps'", "line 2"]),
        (b"seed: 1\nlopd: {steps: 3}\nseed: 2\n", ["p.yaml:3:1", "duplicate key 'seed'", "line 1"]),
    ],
    ids=[
        "empty",
        "comments-only",
        "unclosed-list",
        "bad-indent",
        "binary",
        "nul-bytes",
        "duplicate-nested",
        "duplicate-section",
    ],
)
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
    res = subprocess.run(
        [sys.executable, "-m", "lopd_cli.main", "evaluate", "--params", str(path)],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 2  # the exit code of every invalid configuration
    assert f"{path}:2:1" in res.stderr and "duplicate key 'seed'" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_reports_config_error(capsys):
    from lopd_cli.main import main

    assert main(["evaluate", "--set", "rollout.batch_size=0"]) == 2
    err = capsys.readouterr().err
    assert "rollout.batch_size: got 0" in err


def test_config_is_a_leaf_of_the_library():
    """Loading the configuration loads nothing of the library but the names it validates against (the
    import-free methods table among them): every command reads params.yaml, and the lower layers (model/, envs/)
    must not reach the trainer through it."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys, lopd_core.config; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('lopd_core'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(json.loads(out))
    assert loaded - {m for m in loaded if m.startswith("lopd_core.settings.")} == {
        "lopd_core",
        "lopd_core.config",
        "lopd_core.names",
        "lopd_core.offline",
        "lopd_core.settings",
        "lopd_core.methods",
    }


def test_the_benchmarks_read_the_names_the_configuration_checks():
    """One list of each benchmark's categories (lopd_core/names.py): BFCL's single-turn ones come first, then the
    multi-turn ones, as the runner expects, and ACEBench's categories are its groups'."""
    from lopd_core import names
    from lopd_core.bench.acebench import data as ace
    from lopd_core.bench.bfcl import data as bfcl

    assert bfcl.SINGLE_TURN_CATEGORIES + bfcl.MULTI_TURN_CATEGORIES == names.BFCL_CATEGORIES
    assert bfcl.MULTI_TURN_CATEGORIES and all(c.startswith("multi_turn_") for c in bfcl.MULTI_TURN_CATEGORIES)
    assert ace.CATEGORIES == ace.GROUPS["normal"] + ace.GROUPS["special"] == names.ACEBENCH_CATEGORIES


def test_bank_retrieval_settings_travel_as_one_value():
    """Retrievers take `bank.retrieval` whole, so every retrieval setting (same_world, ef_search...) reaches them."""
    import dataclasses

    from lopd_core.config import RetrievalSettings

    params = load_params("params.yaml", ["bank.same_world=false", "bank.ef_search=50", "bank.top_j=2"])
    assert params.bank.retrieval == RetrievalSettings(
        top_j=2, allow_self_retrieval=True, same_world=False, ef_search=50
    )
    assert {f.name for f in dataclasses.fields(RetrievalSettings)} <= {f.name for f in dataclasses.fields(params.bank)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.bank.retrieval.top_j = 5  # a copy: changing it would change nothing in params


def test_removed_dead_knob_is_rejected():
    # envs.train_tasks was read nowhere: a file that still sets it is told so rather than silently ignored
    with pytest.raises(ConfigError, match="envs.train_tasks: unknown key"):
        load_params("params.yaml", ["envs.train_tasks=4000"])


def test_write_params_and_list_print_every_setting(tmp_path, capsys):
    from pathlib import Path

    from lopd_core.config import main

    out = tmp_path / "p.yaml"
    assert main(["--write-params", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == Path(__file__).resolve().parents[2].joinpath("params.yaml").read_text(
        encoding="utf-8"
    )
    assert load_params(out).to_dict() == Params().to_dict()
    capsys.readouterr()
    assert main(["--list"]) == 0
    listed = {line.split(" = ")[0].strip() for line in capsys.readouterr().out.splitlines() if " = " in line}
    leaves = {key for key, _, value in _settings(Params()) if not dataclasses.is_dataclass(value)}
    assert leaves <= listed, sorted(leaves - listed)
    assert main(["--bogus"]) == 2
