"""Fixtures shared by the pipeline tests."""

import pytest


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory, tiny_model, tiny_tokenizer):
    """The tiny model saved as a plain Hugging Face folder: what export, evaluate and the output-path rules read."""
    out = tmp_path_factory.mktemp("student") / "student"
    tiny_model.save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out
