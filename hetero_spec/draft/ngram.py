"""Prompt-lookup n-gram proposer: no model; copies what followed the last occurrence of the context's
suffix. Deterministic (q is one-hot), so it also serves as the trivial proposer in tests."""

from __future__ import annotations

from ..sampling import SamplingParams
from .base import Draft


class NgramProposer:
    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if min_n > max_n:
            raise ValueError(f"ngram.min_n ({min_n}) must be <= ngram.max_n ({max_n})")
        self.max_n, self.min_n = max_n, min_n
        self.ids: list[int] = []
        self._last: list[int] = []

    def begin(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.ids = list(prompt_ids)
        self._last = []

    def propose(self, k: int) -> Draft:
        ids = self.ids
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            suffix = ids[-n:]
            # most recent earlier occurrence of the suffix
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start:start + n] == suffix:
                    cont = ids[start + n:start + n + k]
                    if cont:
                        self._last = list(cont)
                        return Draft(ids=list(cont))
                    break
        self._last = []
        return Draft(ids=[])

    def sync(self, ids: list[int]) -> None:
        """Take the committed text as it is now (another proposer drafted meanwhile)."""
        self.ids = list(ids)
        self._last = []

    def commit(self, n_accepted: int, next_token: int) -> None:
        self.ids.extend([*self._last[:n_accepted], next_token])
        self._last = []

    def close(self) -> None:
        pass
