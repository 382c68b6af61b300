"""The BFCL data folder is a setting: v3 and v4 file names, answers joined by id, clear errors."""

import json

import pytest

from lopd_core.bench.bfcl.data import BfclDataError, category_file, load_category, resolve_data_dir

ROW = {
    "id": "simple_0",
    "question": [[{"role": "user", "content": "hi"}]],
    "function": [{"name": "f", "parameters": {"type": "dict", "properties": {}, "required": []}}],
}


def write(folder, name, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_v3_files_load_and_the_newest_version_wins(tmp_path):
    write(tmp_path, "BFCL_v3_simple.json", [ROW])
    write(tmp_path / "possible_answer", "BFCL_v3_simple.json", [{"id": "simple_0", "ground_truth": [{"f": {}}]}])
    write(tmp_path, "BFCL_v3_parallel_multiple.json", [ROW])  # must not be taken for `multiple`
    (entry,) = load_category("simple", resolve_data_dir(str(tmp_path)))
    assert entry.answer == [{"f": {}}] and entry.functions[0]["name"] == "f"
    write(tmp_path, "BFCL_v4_simple_python.json", [ROW])
    assert category_file(tmp_path, "simple").name == "BFCL_v4_simple_python.json"
    with pytest.raises(BfclDataError, match="no BFCL file for category 'multiple'"):
        category_file(tmp_path, "multiple")


def test_missing_answers_are_named(tmp_path):
    write(tmp_path, "BFCL_v4_multiple.json", [ROW])
    write(tmp_path / "possible_answer", "BFCL_v4_multiple.json", [{"id": "other", "ground_truth": []}])
    with pytest.raises(BfclDataError, match=r"no answer for 1 entries, e\.g\. 'simple_0'"):
        load_category("multiple", tmp_path)


def test_unknown_category_and_folder(tmp_path):
    with pytest.raises(ValueError, match="unknown BFCL category 'java'"):
        category_file(tmp_path, "java")
    with pytest.raises(BfclDataError, match="is not a directory"):
        resolve_data_dir(str(tmp_path / "absent"))
