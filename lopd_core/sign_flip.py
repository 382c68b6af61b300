"""The exact one-sided sign-flip test of a sum of per-task terms: the null distribution of Σ s_i |t_i| over
independent fair signs s_i, and the p-value of the observed Σ t_i in its upper tail.

Why a module of its own: it is the promotion gate's decision (lopd_core/gate.py says which terms, level and side),
plain numerics with no frames, and tested on hand-worked cases (tests/test_gate.py).

Exact where the terms take few distinct sizes: terms of size a_g occurring k_g times contribute a_g (2 J_g − k_g),
J_g ~ Binomial(k_g, 1/2), independent across sizes; the grid of all the J_g but the most frequent size's is
enumerated and the most frequent enters through its binomial tail. Binary outcomes take one size per cell at a zero
threshold (the sign test on the discordant tasks: McNemar's exact test) and three with a shift (wins, losses, ties).
Rewards take many sizes: Monte-Carlo over FLIPS sign patterns from a fixed seed, with the p-value (1 + hits) /
(1 + FLIPS), which is itself a valid p-value (the observed pattern counts as one of the draws).
"""

from __future__ import annotations

import math

import numpy as np

FLIPS = 10_000  # Monte-Carlo sign patterns where the exact p-value would take too many (rewards)
EXACT_PATTERNS = 200_000  # the exact path's largest grid of binomial counts (every size but the most frequent)


def _binomial_half(k: int) -> np.ndarray:
    """P(J = j), j = 0..k, for J ~ Binomial(k, 1/2) (log-gamma: no overflow at any k)."""
    j = np.arange(k + 1)
    log = [math.lgamma(k + 1) - math.lgamma(i + 1) - math.lgamma(k - i + 1) for i in j]
    return np.exp(np.array(log) - k * math.log(2))


def _exact_tail(sizes: np.ndarray, counts: np.ndarray, observed: float) -> float:
    """P(Σ_g sizes_g · (2 J_g − counts_g) ≥ observed), J_g ~ Binomial(counts_g, 1/2) independent: the sign-flip
    distribution of terms that take `counts_g` times the size `sizes_g`. The grid of every group's J but the
    largest group's is enumerated; the largest enters through its binomial tail."""
    order = np.argsort(counts)
    sizes, counts = sizes[order], counts[order]
    partial, weight = np.zeros(1), np.ones(1)  # over the grid: the sum so far and its probability
    for size, k in zip(sizes[:-1], counts[:-1]):
        partial = (partial[:, None] + size * (2 * np.arange(k + 1) - k)[None, :]).ravel()
        weight = (weight[:, None] * _binomial_half(int(k))[None, :]).ravel()
    size, k = sizes[-1], int(counts[-1])
    # the last group must bring size · (2j − k) ≥ observed − partial: j ≥ need
    need = np.ceil(((observed - partial) / size + k) / 2 - 1e-9)
    tail = np.concatenate([np.cumsum(_binomial_half(k)[::-1])[::-1], [0.0]])  # tail[j] = P(J ≥ j), tail[k+1] = 0
    return float(np.sum(weight * tail[np.clip(need, 0, k + 1).astype(int)]))


def sign_flip_p(
    terms: np.ndarray, *, seed: int = 0, flips: int = FLIPS, exact_patterns: int = EXACT_PATTERNS
) -> tuple[float, str]:
    """The one-sided p-value P(Σ s_i |t_i| ≥ Σ t_i) over independent fair signs s_i, and how it was computed:
    exactly where the grid of binomial counts is at most `exact_patterns`, else from `flips` sign patterns drawn
    from `seed`."""
    terms = np.asarray(terms, float)
    scale = max(float(np.abs(terms).max(initial=0.0)), 1e-300)
    observed = float(terms.sum()) - 1e-9 * scale  # ties with the observed sum count as at least as large
    nonzero = np.abs(terms[np.abs(terms) > 1e-12 * scale])
    if not len(nonzero):
        return 1.0, "exact: no task differs"
    sizes, counts = np.unique(np.round(nonzero / scale, 12) * scale, return_counts=True)
    if math.prod(int(k) + 1 for k in np.sort(counts)[:-1]) <= exact_patterns:
        return min(1.0, _exact_tail(sizes, counts, observed)), f"exact over {len(nonzero)} differing tasks"
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, flips, 1000):  # chunks of 1000 patterns bound the memory at any n
        plus = rng.random((min(1000, flips - start), len(nonzero))) < 0.5  # (patterns, tasks): s_i = +1
        hits += int(np.sum(2 * (plus @ nonzero) - nonzero.sum() >= observed))
    return (1 + hits) / (1 + flips), f"Monte-Carlo, {flips} sign patterns, seed {seed}"
