"""Comparing two float paths that play the same policy (a kept cache against a re-prefill, a shared prefill
against an unshared one, a continuous batch against a request alone, a GPU against the CPU) by what must be equal,
at stated tolerances (STYLE habit 12), never by a sampled token or by bits: another CPU's kernels round
differently, and a last-bit difference in the logits can flip a sampled token or a top-p cut.

  * Teacher-forced: every token a path sampled is re-scored by one full forward pass over the finished sequence
    (no cache, no padding: `teacher.build_batch` + `action_logits`, the pass training reads), and the log-prob the
    path recorded must equal the full pass's under the same (temperature, top_p) truncation to `LOGPROB_ATOL`.
    The paths measured here differ by at most about 1e-6; a wrong cache (positions one late, a finished row's
    keys left with a live one) moves them by about 3e-2, so 1e-4 sits two orders of magnitude from both.
  * Greedy ids: two greedy paths must pick the same token wherever the full pass's top-2 logit margin exceeds
    `GREEDY_MARGIN` (1000 times the noise); the ids are compared up to the first action position inside it.
  * Sampled ids with one stream per row (inverse CDF, one float64 uniform from the row's own stream per token,
    decode.py): the stream is replayed and each token must be the full pass's inverse-CDF pick of its uniform
    wherever that uniform lies farther than `STREAM_EDGE` (in probability mass) from the edges of the token's
    interval; the ids are checked up to the first draw inside it (`check_stream_picks`).
  * A top-p cut is a threshold on a cumulative probability: where a token whose cumulative mass before it lies
    within `TOP_P_EDGE` of top_p is the sampled token or carries enough mass to move the others' truncated
    log-probs (`near_top_p_cut`), the truncated set could differ by a last bit, and that position is not
    compared. Callers assert that such positions are rare (at most 5 %), so the check keeps its bite.
"""

from __future__ import annotations

import torch

from lopd_core.distill.scoring.teacher import Framing, action_logits, build_batch
from lopd_core.rollout.decode import sampling_logprobs
from lopd_core.rollout.trajectory import Sampling

LOGPROB_ATOL = 1e-4
GREEDY_MARGIN = 1e-3
TOP_P_EDGE = 1e-5
STREAM_EDGE = 1e-5


@torch.no_grad()
def full_forward_logits(
    model, ids: list[int], mask: list[int], latents: torch.Tensor | None = None, framing: Framing | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, V) float32 logits of one full forward pass at the positions predicting the N action tokens of `ids`
    (latents spliced as a latent teacher reads them), and the (N,) action ids."""
    model_device = next(model.parameters()).device
    batch = build_batch(model, [ids], [mask], None if latents is None else [latents.to(model_device)], framing)
    return action_logits(model, batch).float().cpu(), batch.action_ids.cpu()


def near_top_p_cut(logits: torch.Tensor, sampling: Sampling, action_ids: torch.Tensor) -> torch.Tensor:
    """(N,) True where float noise could move the top-p cut of these (N, V) logits enough to matter: a token
    whose mass ahead of it lies within TOP_P_EDGE of top_p is the action token itself (kept on one path, dropped
    on the other) or carries more than LOGPROB_ATOL / 10 of mass (its flip would move every truncated log-prob
    by about that much). The many tiny tokens that always sit near the cut move the log-probs by less."""
    if sampling.temperature == 0 or sampling.top_p >= 1.0:
        return torch.zeros(logits.shape[0], dtype=torch.bool)
    probs, order = torch.softmax(logits.double() / sampling.temperature, dim=-1).sort(dim=-1, descending=True)
    ahead = probs.cumsum(dim=-1) - probs  # (N, V) the mass ahead of each token, in order
    near = (ahead - sampling.top_p).abs() < TOP_P_EDGE
    matters = (probs > LOGPROB_ATOL / 10) | (order == action_ids[:, None])
    return (near & matters).any(dim=-1)


def check_recorded_logprobs(
    model,
    ids: list[int],
    mask: list[int],
    logprobs: list[float],
    sampling: Sampling,
    latents: torch.Tensor | None = None,
    framing: Framing | None = None,
) -> tuple[int, int]:
    """Assert that the log-probs a path recorded (aligned with `ids`, read where `mask` is 1) equal a full
    forward pass's under `sampling` to LOGPROB_ATOL, and under greedy that each id is the full pass's argmax
    wherever its top-2 margin exceeds GREEDY_MARGIN. Returns (positions compared, action positions)."""
    logits, action_ids = full_forward_logits(model, ids, mask, latents, framing)
    recorded = torch.tensor([lp for i, (lp, m) in enumerate(zip(logprobs, mask)) if m and i > 0])
    expected = sampling_logprobs(logits, sampling).gather(-1, action_ids[:, None]).squeeze(-1)
    keep = ~near_top_p_cut(logits, sampling, action_ids)
    torch.testing.assert_close(recorded[keep], expected[keep], atol=LOGPROB_ATOL, rtol=0)
    if sampling.temperature == 0:
        top2 = logits.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > GREEDY_MARGIN
        assert torch.equal(action_ids[clear], logits[clear].argmax(dim=-1)), "a greedy id is not the argmax"
    return int(keep.sum()), len(action_ids)


def assert_records_full_forward(model, trajs, sampling: Sampling, latents=None, framing=None) -> None:
    """`check_recorded_logprobs` for every trajectory (`latents`: one per trajectory, or None); at most 5 % of
    the action positions may be left out at a top-p edge."""
    compared = total = 0
    for k, t in enumerate(trajs):
        c, n = check_recorded_logprobs(
            model,
            t.token_ids,
            t.action_mask,
            t.sample_logprobs,
            sampling,
            None if latents is None else latents[k],
            framing,
        )
        compared, total = compared + c, total + n
    assert total > 0 and compared >= 0.95 * total, f"only {compared} of {total} positions clear of a top-p edge"


def greedy_clear_prefix(model, ids: list[int], mask: list[int], latents=None, framing=None) -> int:
    """How many leading tokens of a greedy play any greedy path must reproduce: up to (not including) the first
    action token whose full-pass top-2 margin is within GREEDY_MARGIN (a near tie that float noise may break
    either way); the whole sequence when there is none."""
    logits, _ = full_forward_logits(model, ids, mask, latents, framing)
    top2 = logits.topk(2, dim=-1).values
    positions = [i for i, m in enumerate(mask) if m and i > 0]
    ties = [p for p, margin in zip(positions, (top2[:, 0] - top2[:, 1]).tolist()) if margin <= GREEDY_MARGIN]
    return ties[0] if ties else len(ids)


def assert_same_greedy_play(model, plays, reference, latents=None, framing=None) -> None:
    """Two greedy plays of the same requests: each trajectory's ids equal the reference's up to its first near
    tie (`greedy_clear_prefix`), and a trajectory with none is the same play whole (ids, mask, reward, stop,
    turns, log-probs to LOGPROB_ATOL). At least half the trajectories must be clear of near ties."""
    assert len(plays) == len(reference)
    whole = 0
    for k, (a, b) in enumerate(zip(plays, reference)):
        cut = greedy_clear_prefix(model, a.token_ids, a.action_mask, None if latents is None else latents[k], framing)
        assert a.token_ids[:cut] == b.token_ids[:cut], f"trajectory {k}: the ids part before any near tie"
        if cut == len(a.token_ids):
            whole += 1
            assert a.token_ids == b.token_ids and a.action_mask == b.action_mask, k
            assert (a.reward, a.success, a.stop_reason, a.num_turns) == (
                b.reward,
                b.success,
                b.stop_reason,
                b.num_turns,
            ), k
            torch.testing.assert_close(
                torch.tensor(a.sample_logprobs), torch.tensor(b.sample_logprobs), atol=LOGPROB_ATOL, rtol=0
            )
    assert whole >= len(plays) / 2, f"only {whole} of {len(plays)} greedy plays clear of near ties"


def assert_same_play(model, plays, reference, sampling: Sampling, latents=None, framing=None) -> None:
    """Two paths' plays of the same requests: both record what a full forward pass gives; greedy, the ids agree
    up to any near tie. Sampled ids are not compared: a last-bit difference may pick another token."""
    assert_records_full_forward(model, plays, sampling, latents, framing)
    assert_records_full_forward(model, reference, sampling, latents, framing)
    if sampling.temperature == 0:
        assert_same_greedy_play(model, plays, reference, latents, framing)


def greedy_clear_turn(model, context: list[int], turn: list[int]) -> int:
    """How many leading tokens of a greedy `turn` decoded after `context` are clear of a near tie."""
    return greedy_clear_prefix(model, context + turn, [0] * len(context) + [1] * len(turn)) - len(context)


def check_stream_picks(model, context: list[int], turn: list[int], sampling: Sampling, seed: int) -> int:
    """Replay a per-row stream seeded `seed` over a `turn` sampled after `context`: each token must be the
    inverse-CDF pick of the full forward pass's (temperature, top_p) distribution at its stream's next uniform,
    up to the first draw within STREAM_EDGE of an interval's edge (or at a top-p edge), after which float noise
    may have picked another token. Greedy turns draw nothing and are checked by argmax. Returns the number of
    leading tokens checked."""
    logits, _ = full_forward_logits(model, context + turn, [0] * len(context) + [1] * len(turn))
    if sampling.temperature == 0:
        top2 = logits.topk(2, dim=-1)
        for n, token in enumerate(turn):
            if float(top2.values[n, 0] - top2.values[n, 1]) <= GREEDY_MARGIN:
                return n
            assert token == int(top2.indices[n, 0]), f"token {n}: {token}, not the argmax"
        return len(turn)
    stream = torch.Generator().manual_seed(seed)
    ambiguous = near_top_p_cut(logits, sampling, torch.tensor(turn))
    cdf = sampling_logprobs(logits, sampling).double().exp().cumsum(dim=-1)  # (N, V)
    for n, token in enumerate(turn):
        u = float(torch.rand(1, generator=stream, dtype=torch.float64)) * float(cdf[n, -1])
        pick = int(torch.searchsorted(cdf[n], torch.tensor([u], dtype=torch.float64)).clamp(max=cdf.shape[1] - 1))
        low = float(cdf[n, pick - 1]) if pick > 0 else 0.0
        if bool(ambiguous[n]) or min(u - low, float(cdf[n, pick]) - u) <= STREAM_EDGE:
            return n
        assert token == pick, f"token {n}: {token}, but the stream's draw picks {pick}"
    return len(turn)
