"""The proposer protocol every draft strategy implements.

Lifecycle of one request: ``begin(prompt_ids, params)``, then rounds of ``propose(k)`` and
``commit(n_accepted, next_token)``; ``commit`` rolls the proposer's own state (e.g. its KV cache) back to
the accepted prefix plus the target's next token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..sampling import SamplingParams


@dataclass
class Draft:
    """Proposed tokens. probs is [len(ids), vocab] (the q each token was sampled from) or None when
    the proposer is deterministic (greedy or n-gram), in which case q is one-hot on each token."""

    ids: list[int]
    probs: np.ndarray | None = None
    conf: list[float] | None = None  # the draft's probability of each proposed token (with confidence=True)
    stopped_early: bool = False  # the block ended below the confidence threshold


class Proposer(Protocol):
    name: str

    def begin(self, prompt_ids: list[int], params: SamplingParams) -> None: ...

    def propose(self, k: int) -> Draft: ...

    def commit(self, n_accepted: int, next_token: int) -> None: ...

    def close(self) -> None: ...
