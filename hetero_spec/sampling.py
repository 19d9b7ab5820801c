"""Pure sampling and verification functions (numpy only; no models in here).

Terms, used the same way everywhere (Leviathan et al. 2023; p = target, q = draft):

* A round verifies a draft block ``x_1..x_k`` with target distributions ``p_1..p_{k+1}``, where
  ``p_i`` is the target's distribution for the token at draft position ``i`` (``p_{k+1}`` follows ``x_k``).
* **accepted**: the draft tokens kept, a prefix ``x_1..x_n`` of the block (``0 <= n <= k``).
* **recovered**: when ``x_{n+1}`` is rejected, the token the target puts in its place: in greedy mode
  ``argmax p_{n+1}``; in sampling mode a draw from ``norm(max(0, p_{n+1} - q_{n+1}))``.
* **bonus**: when all ``k`` are accepted, one extra token from ``p_{k+1}``.

Every round therefore yields ``n + 1`` tokens: the accepted ones and one recovered-or-bonus token,
called ``next_token`` below.

Randomness is explicit: the caller passes uniform draws, and `position_uniforms` derives them from
(seed, absolute position, stream), so a seeded run is reproducible whatever the round boundaries were.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Streams of `position_uniforms`: independent draws per absolute token position.
STREAM_ACCEPT = 0   # target: accept/reject test of the draft token at this position
STREAM_TARGET = 1   # target: recovered or bonus sample at this position
STREAM_DRAFT = 2    # draft: its own sample at this position


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def position_uniforms(seed: int, position: int, stream: int, n: int = 1) -> np.ndarray:
    """n uniform draws in [0, 1) that depend only on (seed, absolute position, stream)."""
    return np.random.default_rng([seed & 0xFFFFFFFFFFFF, position, stream]).random(n)


def logits_to_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[n, vocab] logits -> [n, vocab] float64 probabilities after temperature, top-k and top-p.

    The order (temperature, then top-k, then top-p, keeping at least one token) is the one
    transformers' samplers use. Greedy params give a one-hot distribution on the argmax.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {logits.shape}")
    x = logits.astype(np.float64)
    if params.greedy:
        out = np.zeros_like(x)
        out[np.arange(x.shape[0]), x.argmax(axis=-1)] = 1.0
        return out
    x = x / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = np.partition(x, -params.top_k, axis=-1)[:, -params.top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(axis=-1, keepdims=True)
    probs = np.exp(x)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        cum = np.cumsum(sorted_p, axis=-1)
        drop_sorted = (cum - sorted_p) >= params.top_p  # keep tokens until mass reaches top_p
        drop_sorted[:, 0] = False
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample_from(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from a 1-D distribution with one uniform u in [0, 1)."""
    cdf = np.cumsum(probs)
    idx = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    idx = min(idx, probs.shape[0] - 1)
    while probs[idx] <= 0.0 and idx > 0:  # guard against float round-off landing on a zero
        idx -= 1
    return idx


def verify_greedy(draft_ids: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """Greedy verification: accept the longest prefix equal to the target's argmax.

    draft_ids: [k]; target_argmax: [k + 1], the target's argmax at each draft position plus one.
    Returns (n_accepted, next_token) where next_token is target_argmax[n_accepted].
    """
    k = len(draft_ids)
    if len(target_argmax) != k + 1:
        raise ValueError(f"target_argmax must have k+1 = {k + 1} entries, got {len(target_argmax)}")
    n = 0
    while n < k and draft_ids[n] == target_argmax[n]:
        n += 1
    return n, int(target_argmax[n])


def rejection_accept(draft_ids: list[int], q: np.ndarray | None, p: np.ndarray,
                     u_accept: np.ndarray) -> int:
    """How many draft tokens the rejection test accepts (the n of `verify_rejection`).

    draft_ids: [k]; q: [k, vocab] or None (one-hot); p: [k + 1, vocab]; u_accept: [k] uniforms.
    Token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); the first rejection stops.
    """
    k = len(draft_ids)
    if p.ndim != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p must be [k+1={k + 1}, vocab], got shape {p.shape}")
    if q is not None and q.shape != (k, p.shape[1]):
        raise ValueError(f"q must be [k={k}, vocab={p.shape[1]}], got shape {q.shape}")
    for i, x in enumerate(draft_ids):
        q_x = 1.0 if q is None else float(q[i, x])
        if not (q_x > 0.0 and u_accept[i] < min(1.0, float(p[i, x]) / q_x)):
            return i
    return k


def rejection_next(draft_ids: list[int], q: np.ndarray | None, p: np.ndarray, n: int,
                   u_sample: float) -> int:
    """The token after n accepted ones: recovered from norm(max(0, p_n - q_n)) if n < k, else the
    bonus token from p_k (0-based rows). q None means one-hot on the draft token."""
    k = len(draft_ids)
    if n == k:
        return sample_from(p[k], u_sample)
    if q is None:
        residual = p[n].copy()
        residual[draft_ids[n]] = 0.0
    else:
        residual = np.maximum(p[n] - q[n], 0.0)
    if residual.sum() <= 0.0:  # p == q exactly: a rejection has probability 0; fall back to p
        residual = p[n]
    return sample_from(residual, u_sample)


def verify_rejection(draft_ids: list[int], q: np.ndarray | None, p: np.ndarray,
                     u_accept: np.ndarray, u_sample: float) -> tuple[int, int]:
    """Speculative rejection sampling (Leviathan et al. 2023, Algorithm 1).

    draft_ids: [k] tokens the draft sampled; q: [k, vocab] the draft distributions they were sampled
    from, or None for a deterministic proposer (q is then one-hot on each draft token); p: [k + 1, vocab]
    target distributions; u_accept: [k] uniforms for the accept tests; u_sample: one uniform for the
    recovered or bonus token. Token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the
    first rejection the recovered token is drawn from norm(max(0, p_i - q_i)); if all k are accepted the
    bonus token is drawn from p_{k+1}. Returns (n_accepted, next_token).
    """
    n = rejection_accept(draft_ids, q, p, u_accept)
    return n, rejection_next(draft_ids, q, p, n, u_sample)
