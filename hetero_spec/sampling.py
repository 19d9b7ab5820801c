"""Pure sampling and verification functions (numpy only; no models in here).

Terms, used the same way everywhere (Leviathan et al. 2023; p = target, q = draft):

* A round verifies a draft block ``x_1..x_k`` with target distributions ``p_1..p_{k+1}``, where
  ``p_i`` is the target's distribution for the token at draft position ``i`` (``p_{k+1}`` follows ``x_k``).
* **accepted**: the draft tokens kept, a prefix ``x_1..x_n`` of the block (``0 <= n <= k``).
* **recovered**: when ``x_{n+1}`` is rejected, the token the target puts in its place: in greedy mode
  ``argmax p_{n+1}``; in rejection sampling a draw from ``norm(max(0, p_{n+1} - q_{n+1}))``; in coupled
  sampling the target's own choice ``y_{n+1} = argmax(log p_{n+1} + g_{n+1})``.
* **bonus**: when all ``k`` are accepted, one extra token from ``p_{k+1}`` (coupled: ``y_{k+1}``).

Every round therefore yields ``n + 1`` tokens: the accepted ones and one recovered-or-bonus token, ``next_token``.
Randomness is passed in, keyed by (seed, absolute position, stream). The two sampled modes, ``rejection``
(`rejection_accept`, `rejection_next`) and ``coupled`` (`exponential_noise`, `verify_coupled`):
docs/features-sampling.md.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Streams of `position_uniforms`: independent draws per absolute token position.
STREAM_ACCEPT = 0   # target: accept/reject test of the draft token at this position
STREAM_TARGET = 1   # target: recovered or bonus sample at this position
STREAM_DRAFT = 2    # draft: its own sample at this position
STREAM_COUPLED = 3  # coupled mode: the noise vector draft and target share at this position
#: noise vectors kept (exponential_noise): in one process the draft and the target ask for the same positions, the
#: draft first (1.2 MB each at 152k tokens; a batch of more streams than this only draws some twice)
NOISE_CACHE = 32

SAMPLING_MODES = ("rejection", "coupled")


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens. temperature 0 means greedy; `sampling` is how a sampled request
    is verified (the module docstring)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    sampling: str = "rejection"

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling must be one of {', '.join(SAMPLING_MODES)}, got {self.sampling!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def coupled(self) -> bool:
        """Sampled with Gumbel-max coupling: the draft sends tokens only (no q), like greedy."""
        return not self.greedy and self.sampling == "coupled"


def position_uniforms(seed: int, position: int, stream: int, n: int = 1) -> np.ndarray:
    """n uniform draws in [0, 1) that depend only on (seed, absolute position, stream)."""
    # the whole 64-bit seed, as two 32-bit words: seeds that differ only in high bits draw differently
    return np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, position, stream]).random(n)


def exponential_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """[vocab] float64 i.i.d. Exp(1) draws E keyed like `position_uniforms` (stream STREAM_COUPLED): the noise of
    coupled sampling (g = -log(E) is Gumbel). numpy's ziggurat costs about one uniform per entry and no logarithm
    (~1.3 ms for 128k), a prefix does not depend on `vocab`, and zeros are lifted: p / E is never 0 / 0."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return _noise(seed, position, vocab)


@functools.lru_cache(maxsize=NOISE_CACHE)
def _noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """exponential_noise, drawn once per (seed, position, vocab) while it stays among the NOISE_CACHE last (shared by
    the draft and the target in one process: ~0.6 ms a position at 152k); read-only, as it is shared."""
    e = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, position, STREAM_COUPLED]).standard_exponential(vocab)
    e = np.maximum(e, np.finfo(np.float64).smallest_subnormal, out=e)
    e.setflags(write=False)
    return e


def coupled_choice(probs: np.ndarray, e: np.ndarray) -> int:
    """argmax(log p + g) with g = -log(e), computed as argmax(p / e) (no logarithm): with e [vocab] the position's
    `exponential_noise`, an exact sample from probs [vocab] (or from any positive multiple of it: `coupled_weights`);
    a token with probability 0 is never chosen."""
    if probs.shape != e.shape:
        raise ValueError(f"probs and noise must have the same shape, got {probs.shape} and {e.shape}")
    return int(np.argmax(probs / e))


def coupled_weights(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[vocab] weights proportional to the sampling distribution of one row of logits, for `coupled_choice`:
    argmax(p / E) does not change when p is scaled, so without top-k and top-p the weights are exp((x - max x) / T)
    in float32, one pass with no normalisation (~0.1 ms against 1.3 ms for `logits_to_probs` at 152k tokens);
    with them, the probabilities. Draft, target and the target alone all use it, so their choices agree."""
    if params.greedy or 0 < params.top_k < logits.shape[-1] or params.top_p < 1.0:
        return logits_to_probs(logits.reshape(1, -1), params)[0]
    y = np.multiply(logits, np.float32(1.0 / params.temperature), dtype=np.float32)
    y -= y.max()
    return np.exp(y, out=y)


def logits_to_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[n, vocab] logits -> [n, vocab] float64 probabilities: temperature, then top-k, then top-p keeping at least
    one token (transformers' order); greedy params give one-hot on the argmax."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {logits.shape}")
    x = logits.astype(np.float64)
    if params.greedy:
        return (np.arange(x.shape[-1]) == x.argmax(axis=-1)[:, None]).astype(np.float64)
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
        drop = (np.cumsum(sorted_p, axis=-1) - sorted_p) >= params.top_p  # keep tokens until mass reaches top_p
        drop[:, 0] = False
        np.put_along_axis(probs, order, np.where(drop, 0.0, sorted_p), axis=-1)  # the dropped ones zeroed, in place
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample_from(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from a 1-D distribution with one uniform u in [0, 1)."""
    cdf = np.cumsum(probs)
    idx = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), probs.shape[0] - 1)
    while probs[idx] <= 0.0 and idx > 0:  # guard against float round-off landing on a zero
        idx -= 1
    return idx


def verify_greedy(draft_ids: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """Greedy verification: (n, target_argmax[n]), n the longest prefix of draft_ids [k] equal to target_argmax
    [k + 1] (the target's argmax at each draft position plus one)."""
    k = len(draft_ids)
    if len(target_argmax) != k + 1:
        raise ValueError(f"target_argmax must have k+1 = {k + 1} entries, got {len(target_argmax)}")
    n = next((i for i in range(k) if draft_ids[i] != target_argmax[i]), k)
    return n, int(target_argmax[n])


def rejection_accept(draft_ids: list[int], q: np.ndarray | None, p: np.ndarray, u_accept: np.ndarray) -> int:
    """Speculative rejection sampling (Leviathan et al. 2023, Algorithm 1), first half: how many of draft_ids [k]
    are accepted (`rejection_next` draws the token after them). q: [k, vocab] the draft's distributions, or None
    (one-hot); p: [k + 1, vocab]; u_accept: [k]. x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i))."""
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


def rejection_next(draft_ids: list[int], q: np.ndarray | None, p: np.ndarray, n: int, u_sample: float) -> int:
    """The token after n accepted ones: recovered from norm(max(0, p_n - q_n)) if n < k, else the
    bonus token from p_k (0-based rows). q None means one-hot on the draft token."""
    if n == len(draft_ids):
        return sample_from(p[n], u_sample)
    if q is None:
        residual = p[n].copy()
        residual[draft_ids[n]] = 0.0
    else:
        residual = np.maximum(p[n] - q[n], 0.0)
    if residual.sum() <= 0.0:  # p == q exactly: a rejection has probability 0; fall back to p
        residual = p[n]
    return sample_from(residual, u_sample)


def verify_coupled(draft_ids: list[int], p: np.ndarray | Callable[[int], np.ndarray],
                   noise: Callable[[int], np.ndarray]) -> tuple[int, int]:
    """Gumbel-max coupled verification: (n_accepted, next_token), the longest prefix of draft_ids [k] with
    x_i == y_i, then y_n, where y_i = `coupled_choice(p_i, noise(i))` is the target's own sample: the block is
    what target-only sampling emits. p: [k + 1, vocab], or p(i) -> p_i [vocab]; noise(i) -> [vocab]: callables,
    so that rows after the first rejection are never computed nor drawn."""
    k = len(draft_ids)
    if isinstance(p, np.ndarray):
        if p.ndim != 2 or p.shape[0] != k + 1:
            raise ValueError(f"p must be [k+1={k + 1}, vocab], got shape {p.shape}")
        p = p.__getitem__
    for n in range(k + 1):
        y = coupled_choice(p(n), noise(n))
        if n == k or draft_ids[n] != y:
            return n, y
