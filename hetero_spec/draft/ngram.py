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

    def __init__(self, max_n: int = 3, min_n: int = 1, branches: int = 0):
        self.max_n, self.min_n = max_n, min_n  # min_n <= max_n: checked with the config (Engine)
        self.branches = branches  # draft.ngram.branches: more continuations, as a token tree's branches
        self._reset([])

    def spawn(self) -> NgramProposer:
        """A proposer of the same settings for another request (the request scheduler gives each its own)."""
        return NgramProposer(max_n=self.max_n, min_n=self.min_n, branches=self.branches)

    def _reset(self, ids: list[int]) -> None:
        self.ids, self._last = [], []
        #: n -> n-gram -> its latest starts, the latest first (2 + branches of them)
        self._index: dict[int, dict[tuple[int, ...], tuple[int, ...]]] = {
            n: {} for n in range(self.min_n, self.max_n + 1)}
        self._extend(ids)

    def _extend(self, tokens: list[int]) -> None:
        ids, index, keep = self.ids, self._index, 1 + self.branches
        for tok in tokens:
            ids.append(int(tok))
            end = len(ids)
            for size, table in index.items():
                if end >= size:
                    key = tuple(ids[end - size:end])
                    table[key] = (end - size, *table.get(key, ())[:keep])

    def propose(self, k: int) -> Draft:
        """The continuation of the longest suffix that occurred before (its latest earlier occurrence); with
        branches, up to that many other continuations as a token tree's branches (Draft.alts): the same suffix's
        earlier occurrences first, then shorter suffixes', each merged into the tree where it shares a prefix."""
        ids, self._last, match, chain_at = self.ids, [], 0, -1
        starts: list[tuple[int, int]] = []  # (start, size) of every occurrence found, longest suffixes first
        for size in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            found = [(start, size) for start in self._index[size].get(tuple(ids[-size:]), ())[1:]]  # [0]: the suffix
            if not match and found and (cont := ids[found[0][0] + size:found[0][0] + size + k]):
                self._last, match, chain_at = cont, size, found[0][0] + size
            starts += found
            if not self.branches and match:
                break
        draft = Draft(ids=list(self._last), match=match)
        if self.branches and match:
            self._grow(draft, starts, k, chain_at)
        return draft

    def _grow(self, draft: Draft, starts: list[tuple[int, int]], k: int, chain_at: int) -> None:
        """Merge the continuations at `starts` into draft's tree (the chain's continues ids[chain_at:]), until
        `branches` of them added a node."""
        ids, chain = self.ids, len(draft.ids)
        children = {n: {draft.ids[n]: n + 1} for n in range(chain)}  # node -> token -> node (Draft.alts' numbering)
        used, added = {chain_at}, 0
        for start, size in starts:
            if added >= self.branches:
                break
            if start + size in used:  # a shorter suffix of an occurrence already taken continues the same way
                continue
            used.add(start + size)
            node, grew = 0, False
            for token in ids[start + size:start + size + k]:
                nxt = children.setdefault(node, {}).get(token)
                if nxt is None:
                    draft.alts.append((node, token))
                    nxt = children[node][token] = chain + len(draft.alts)
                    grew = True
                node = nxt
            added += grew

    def sync(self, ids: list[int]) -> None:
        """Take the committed text as it is now (another proposer drafted meanwhile): append what is new, or
        rebuild when the text is not an extension of what this proposer has."""
        have = len(self.ids)
        if len(ids) >= have and ids[:have] == self.ids:
            self._extend(ids[have:])
        else:
            self._reset(list(ids))
        self._last = []
