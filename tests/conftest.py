"""Shared fixtures: a tokenizer fitted on a few demonstrations and a randomly initialised tiny Qwen3.

Seeded so every test run sees the same model and the same rollouts.
"""

import pytest
import torch

import lopd_core  # noqa: F401  (offline defaults)
from lopd_core.config import TinyModelConfig


@pytest.fixture(scope="session")
def tiny_demos():
    from lopd_core.model.demos import build_demos

    return build_demos(n=120, experience_fraction=0.4, max_experiences=2, convention_noise=0.5, slip=0.1, seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_demos):
    from lopd_core.model.tokenizer import train_tokenizer

    return train_tokenizer((d.text() for d in tiny_demos), vocab_size=600)


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    from lopd_core.model.loading import tiny_qwen3

    torch.manual_seed(0)
    cfg = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    return tiny_qwen3(cfg, tiny_tokenizer).eval()


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """One temporary Prefect server and database for the whole session (DESIGN §6): flows run against it,
    never against the user's own server. Opt-in: only tests that run flows start it."""
    import os

    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
