"""A lookup in a code corpus (`draft.candidates: [..., corpus]`), a retrieval draft (REST, He et al. 2024): the
token that most often followed the text's last n tokens (n = 6 down to 3) in the Python standard library's source
tokenized with the target's tokenizer (draft/head.py's corpus), chained while the corpus knows. Deterministic (q
is one-hot). What it gets right: docs/real-pair.md#drafts-that-cost-nothing-the-lookups.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..target.export_cache import build_once, cache_root, stamp_key
from .base import Draft
from .ngram import Lookup

ORDERS = (6, 5, 4, 3)  # context lengths looked up, the longest first
MIN_COUNT = 2  # a context seen once says nothing about what follows it
MIN_SHARE = 0.5  # a continuation that follows its context less than half the time is not proposed
CHAIN = 8  # tokens proposed at most per round (each one a lookup)
_PRIME, _MASK = 1000003, (1 << 64) - 1  # the context hash: a polynomial in the token ids, mod 2^64


def _hash(ctx: list[int]) -> int:
    value = 0
    for token in ctx:
        value = (value * _PRIME + int(token) + 1) & _MASK
    return value


class CorpusTable:
    """Per order n: the sorted hashes of the n-token contexts kept, and each one's most frequent next token."""

    def __init__(self, tables: dict[int, tuple[np.ndarray, np.ndarray]]):
        self.tables = tables

    def next(self, ids: list[int]) -> tuple[int, int] | None:
        """(the next token, the context length it was found at) for the text ids, or None."""
        for length in (n for n in ORDERS if n <= len(ids)):
            keys, nexts = self.tables[length]
            key = _hash(ids[-length:])
            i = int(np.searchsorted(keys, np.uint64(key)))
            if i < len(keys) and int(keys[i]) == key:
                return int(nexts[i]), length
        return None

    @classmethod
    def build(cls, files: list[np.ndarray]) -> CorpusTable:
        """The table of token arrays (one per file: no context crosses two)."""
        ids = np.concatenate([np.append(np.asarray(f, dtype=np.int64), -1) for f in files] or [np.array([-1])])
        tables = {}
        for length in ORDERS:
            n_ctx = max(len(ids) - length, 0)  # contexts of `length` tokens (each followed by one)
            hashes, bad = np.zeros(n_ctx, dtype=np.uint64), np.zeros(n_ctx, dtype=bool)
            for j in range(length):
                col = ids[j:j + n_ctx]
                hashes = hashes * np.uint64(_PRIME) + (col + 1).astype(np.uint64)
                bad |= col < 0
            nxt = ids[length:]
            keep = ~bad & (nxt >= 0)
            order = np.lexsort((nxt[keep], hashes[keep]))
            ctx, nxt = hashes[keep][order], nxt[keep][order]
            # distinct (context, next) pairs and their counts ([:len]: none when there is no context)
            first = np.flatnonzero(np.r_[True, (ctx[1:] != ctx[:-1]) | (nxt[1:] != nxt[:-1])][:len(ctx)])
            ctx, nxt, count = ctx[first], nxt[first], np.diff(np.r_[first, len(ctx)])
            # per context, its most frequent next token first (the smallest among equals)
            order = np.lexsort((nxt, -count, ctx))
            ctx, nxt, count = ctx[order], nxt[order], count[order]
            starts = np.flatnonzero(np.r_[True, ctx[1:] != ctx[:-1]][:len(ctx)])
            total = np.add.reduceat(count, starts) if len(starts) else count
            kept = (total >= MIN_COUNT) & (count[starts] >= MIN_SHARE * total)
            tables[length] = (ctx[starts][kept], nxt[starts][kept].astype(np.int32))
        return cls(tables)

    def save(self, path: Path) -> None:
        np.savez(path, **{f"{name}{n}": a for n, (keys, nexts) in self.tables.items()
                          for name, a in (("keys", keys), ("next", nexts))})

    @classmethod
    def load(cls, path: Path) -> CorpusTable:
        with np.load(path) as archive:
            return cls({n: (archive[f"keys{n}"], archive[f"next{n}"]) for n in ORDERS})


TABLE = "corpus.npz"


def cached_table(tokenizer_json: Path) -> CorpusTable:
    """The table of the standard library tokenized with this tokenizer, made once into the cache (~1 minute)."""
    from . import head
    files = head.corpus_files()
    key = stamp_key({"tokenizer": tokenizer_json.read_text(), "files": [str(f) for f in files],
                     "orders": ORDERS, "min_count": MIN_COUNT, "min_share": MIN_SHARE})
    entry = cache_root() / "corpus" / key

    def build(scratch: Path, say) -> None:
        say(f"draft.candidates corpus: counting what follows each 3-6 tokens in {len(files)} standard-library "
            f"files, once, into {entry}")
        scratch.mkdir(parents=True)
        CorpusTable.build(head.corpus_token_ids(tokenizer_json, files)).save(scratch / TABLE)
    build_once(entry, lambda e: (e / TABLE).is_file(), build, f"draft: using the corpus table {entry}")
    return CorpusTable.load(entry / TABLE)


class CorpusProposer(Lookup):
    """The proposer interface of draft/base.py over one CorpusTable (shared by every request's proposer)."""

    name = "corpus"

    def __init__(self, table: CorpusTable):
        self.table, self.ids, self._last = table, [], []

    def spawn(self) -> CorpusProposer:
        return CorpusProposer(self.table)

    def propose(self, k: int) -> Draft:
        ctx, out, match = self.ids[-ORDERS[0]:], [], 0
        while len(out) < min(k, CHAIN) and (hit := self.table.next(ctx)) is not None:
            out.append(hit[0])
            match = match or hit[1]
            ctx = [*ctx, hit[0]][-ORDERS[0]:]
        self._last = out
        return Draft(ids=list(out), match=match)

    def sync(self, ids: list[int]) -> None:
        self.ids, self._last = list(ids), []

    def _extend(self, tokens: list[int]) -> None:
        self.ids += tokens
