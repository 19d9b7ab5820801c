"""Verification as pure functions: exact greedy cases and a statistical test of rejection sampling."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from hetero_spec.sampling import (SamplingParams, logits_to_probs, position_uniforms, rejection_accept,
                                  rejection_next, sample_from, verify_greedy)


def verify_rejection(draft_ids, q, p, u_accept, u_sample):
    """Rejection sampling as the scheduler composes it: (n_accepted, next_token)."""
    n = rejection_accept(draft_ids, q, p, u_accept)
    return n, rejection_next(draft_ids, q, p, n, u_sample)


# -- greedy: every case on constructed target argmax ----------------------------------------------------
@pytest.mark.parametrize("draft, target, expected", [
    ([4, 5, 6], [4, 5, 6, 9], (3, 9)),      # all accepted -> bonus token
    ([4, 5, 6], [1, 5, 6, 9], (0, 1)),      # first rejected -> recovered token
    ([4, 5, 6], [4, 2, 6, 9], (1, 2)),      # middle rejected
    ([4, 5, 6], [4, 5, 3, 9], (2, 3)),      # last rejected
    ([4], [4, 8], (1, 8)),                  # k = 1 accepted
    ([4], [7, 8], (0, 7)),                  # k = 1 rejected
    ([], [7], (0, 7)),                      # empty draft = target-only step
])
def test_verify_greedy_cases(draft, target, expected):
    assert verify_greedy(draft, target) == expected


def test_verify_greedy_from_constructed_logits():
    vocab = 10
    logits = np.full((4, vocab), -1.0)
    for row, tok in enumerate([3, 1, 4, 1]):
        logits[row, tok] = 5.0
    argmax = logits.argmax(-1).tolist()
    assert verify_greedy([3, 1, 5], argmax) == (2, 4)
    assert verify_greedy([3, 1, 4], argmax) == (3, 1)


def test_verify_greedy_rejects_wrong_length():
    with pytest.raises(ValueError, match="k\\+1"):
        verify_greedy([1, 2], [1, 2])


def test_rejection_with_onehot_equal_to_greedy_target_accepts_all():
    p = np.eye(6)[[2, 3, 4]]  # target puts all mass on 2, 3, then 4
    n, tok = verify_rejection([2, 3], None, p, np.array([0.999, 0.999]), 0.5)
    assert (n, tok) == (2, 4)
    n, tok = verify_rejection([2, 5], None, p, np.array([0.0, 0.0]), 0.5)
    assert (n, tok) == (1, 3)


# -- logits processing ---------------------------------------------------------------------------------
def test_logits_to_probs_top_k_top_p_and_greedy():
    logits = np.log(np.array([[0.5, 0.25, 0.15, 0.1]]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(p, [[0.5, 0.25, 0.15, 0.1]])
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [[2 / 3, 1 / 3, 0, 0]])
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    np.testing.assert_allclose(p, [[2 / 3, 1 / 3, 0, 0]])  # 0.5 < 0.7, 0.75 >= 0.7: keep two
    p = logits_to_probs(logits, SamplingParams(temperature=0.0))
    np.testing.assert_allclose(p, [[1, 0, 0, 0]])
    hot = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert hot[0, 0] > 0.5


def test_position_uniforms_reproducible_and_distinct():
    a = position_uniforms(7, 10, 0, 3)
    np.testing.assert_array_equal(a, position_uniforms(7, 10, 0, 3))
    assert not np.allclose(a, position_uniforms(7, 11, 0, 3))
    assert not np.allclose(a, position_uniforms(7, 10, 1, 3))


# -- distribution preservation ---------------------------------------------------------------------------
N_DRAWS = 100_000


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, "a token with target probability 0 was emitted"
    expected = probs[support] * counts.sum()
    return sps.chisquare(counts[support], expected).pvalue


@pytest.mark.parametrize("case", ["overlap", "draft_mass_outside_target", "deterministic_draft"])
def test_rejection_sampling_preserves_target_distribution(case):
    """100,000 seeded draws of (draft sample, verification) on constructed p and q: the emitted first
    token must follow p (chi-square, p-value > 1e-3), and never be a token p gives zero mass."""
    rng = np.random.default_rng(1234)
    p = np.array([0.05, 0.30, 0.0, 0.25, 0.15, 0.0, 0.25])
    q = {"overlap": np.array([0.20, 0.10, 0.0, 0.30, 0.10, 0.0, 0.30]),
         "draft_mass_outside_target": np.array([0.10, 0.10, 0.35, 0.05, 0.05, 0.30, 0.05]),
         "deterministic_draft": None}[case]
    p2 = np.vstack([p, np.full(7, 1 / 7)])  # k = 1: p_1 and the bonus distribution p_2
    counts = np.zeros(7, dtype=np.int64)
    u = rng.random((N_DRAWS, 3))
    for i in range(N_DRAWS):
        x = sample_from(q, u[i, 0]) if q is not None else 2  # deterministic draft always proposes 2
        n, tok = verify_rejection([x], None if q is None else q[None], p2, u[i, 1:2], u[i, 2])
        counts[x if n == 1 else tok] += 1
    assert _chi2_pvalue(counts, p) > 1e-3


def test_rejection_sampling_detects_a_wrong_sampler():
    """The statistical test can fail: emitting the draft's sample unverified is caught."""
    rng = np.random.default_rng(1)
    p = np.array([0.05, 0.30, 0.0, 0.25, 0.15, 0.0, 0.25])
    q = np.array([0.20, 0.10, 0.0, 0.30, 0.10, 0.0, 0.30])
    counts = np.bincount([sample_from(q, u) for u in rng.random(20_000)], minlength=7)
    assert _chi2_pvalue(counts, p) < 1e-6


def test_rejection_second_position_after_acceptance():
    """With k = 2, the token at position 2 given the first was accepted follows p_2."""
    rng = np.random.default_rng(99)
    p = np.array([[0.6, 0.4, 0.0], [0.2, 0.3, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    q = np.array([[0.6, 0.4, 0.0], [0.5, 0.0, 0.5]])  # position 1 q == p: always accepted
    counts = np.zeros(3, dtype=np.int64)
    u = rng.random((N_DRAWS, 5))
    for i in range(N_DRAWS):
        x = [sample_from(q[0], u[i, 0]), sample_from(q[1], u[i, 1])]
        n, tok = verify_rejection(x, q, p, u[i, 2:4], u[i, 4])
        assert n >= 1
        counts[x[1] if n == 2 else tok] += 1
    assert _chi2_pvalue(counts, p[1]) > 1e-3


def test_rejection_accept_shapes_checked():
    with pytest.raises(ValueError, match="p must be"):
        rejection_accept([1, 2], None, np.ones((2, 4)) / 4, np.zeros(2))
    with pytest.raises(ValueError, match="q must be"):
        rejection_accept([1], np.ones((1, 3)) / 3, np.ones((2, 4)) / 4, np.zeros(1))
