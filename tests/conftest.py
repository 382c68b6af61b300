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
