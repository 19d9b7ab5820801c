"""Prompt-lookup n-gram proposer: no model; copies what followed the last occurrence of the context's suffix.
Deterministic (q is one-hot), so it also serves as the trivial proposer in tests. O(max_n) per proposal (draft
selection asks it every round): an index of every n-gram's two latest starts, updated as tokens are appended."""

from __future__ import annotations

from ..sampling import SamplingParams
from .base import Draft


class Lookup:
    """What the lookups (the n-gram one, draft/corpus.py's) share: nothing to feed, limit or close, a prompt taken
    as any text is (the subclass's `sync`), and a commit that appends the last proposal's accepted tokens and the
    next one to the text (its `_extend`)."""

    last_catchup_s = 0.0  # a lookup has nothing to feed
    _last: list[int]  # the last proposal

    def begin(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.sync(prompt_ids)  # a request's prompt is taken as any committed text is

    def limit_catchup(self, window: int) -> None:
        """Nothing to limit: a lookup's catch-up is an index update at most."""

    def commit(self, n_accepted: int, next_token: int) -> None:
        self._extend([*self._last[:n_accepted], next_token])
        self._last = []

    def close(self) -> None:
        """Nothing to free: a lookup holds no model."""


class NgramProposer(Lookup):
    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n  # min_n <= max_n: checked with the config (Engine)
        self._reset([])

    def spawn(self) -> NgramProposer:
        """A proposer of the same settings for another request (the request scheduler gives each its own)."""
        return NgramProposer(max_n=self.max_n, min_n=self.min_n)

    def _reset(self, ids: list[int]) -> None:
        self.ids, self._last = [], []
        #: n -> n-gram -> (latest start, the start before it; -1 when none)
        self._index: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {
            n: {} for n in range(self.min_n, self.max_n + 1)}
        self._extend(ids)

    def _extend(self, tokens: list[int]) -> None:
        ids, index = self.ids, self._index
        for tok in tokens:
            ids.append(int(tok))
            end = len(ids)
            for size, table in index.items():
                if end >= size:
                    key = tuple(ids[end - size:end])
                    table[key] = (end - size, table.get(key, (-1,))[0])  # the latest start becomes the one before

    def propose(self, k: int) -> Draft:
        ids, self._last, match = self.ids, [], 0
        for size in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            start = self._index[size].get(tuple(ids[-size:]), (-1, -1))[1]  # [0] is the suffix itself
            if start >= 0 and (cont := ids[start + size:start + size + k]):
                self._last, match = cont, size
                break
        return Draft(ids=list(self._last), match=match)

    def sync(self, ids: list[int]) -> None:
        """Take the committed text as it is now (another proposer drafted meanwhile): append what is new, or
        rebuild when the text is not an extension of what this proposer has."""
        have = len(self.ids)
        if len(ids) >= have and ids[:have] == self.ids:
            self._extend(ids[have:])
        else:
            self._reset(list(ids))
        self._last = []
