"""CUDA checks: a greedy rollout on the GPU plays as on the CPU. Skipped cleanly where no CUDA device is at hand
(`scripts/setup.sh` installs the CPU build on such machines)."""

from __future__ import annotations

import copy

import pytest
import torch
from _float_paths import assert_same_greedy_play

from lopd_core.envs import make_tasks
from lopd_core.model.chat import ChatCodec
from lopd_core.rollout.engine import RolloutRequest, Sampling, rollout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_greedy_rollout_on_cuda_plays_as_on_the_cpu(tiny_model, tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    requests = [RolloutRequest(t) for t in make_tasks("toolworld", "test_id", 4, seed=10)]
    greedy = Sampling(temperature=0.0, max_new_tokens=16, max_context=768)
    on_cpu = rollout(tiny_model, codec, requests, sampling=greedy, batch_size=4)
    on_gpu = rollout(copy.deepcopy(tiny_model).cuda(), codec, requests, sampling=greedy, batch_size=4)
    # Two devices' kernels round differently: the ids must agree where the greedy choice is clear (up to any
    # top-2 margin within 1e-3 of the CPU's full forward pass), whole trajectories with their rewards and
    # log-probs to 1e-4 where no near tie is met (tests/_float_paths.py).
    assert_same_greedy_play(tiny_model, on_gpu, on_cpu)
