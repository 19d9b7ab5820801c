"""What the decode loop asks of a draft: the `DraftSource` interface (its calls: docs/architecture.md#the-decode-loop),
and the per-request `Proposer`s that the local source wraps. begin(seq) comes before the target's prefill (a worker
reads the prompt meanwhile); a source reads the committed text from `seq.ids` when it drafts; fewer drafts than
asked are always allowed, and no call raises because a draft is slow, wrong or gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..sampling import SamplingParams

if TYPE_CHECKING:
    from ..tuning.controller import RowPlan


@dataclass
class Draft:
    """Proposed tokens. probs is [len(ids), vocab] (the q each token was sampled from) or None when
    the proposer is deterministic (greedy or n-gram), in which case q is one-hot on each token."""

    ids: list[int]
    probs: np.ndarray | None = None
    #: draft tokens the source compared, for free, with tokens the target committed alone: (tested, accepted)
    shadow: tuple[int, int] | None = None
    #: a lookup's draft: the length of the context's suffix it matched (draft selection keeps acceptance per length)
    match: int = 0
    #: more tokens verified in the same pass, a token tree, where the target can (supports_tree): (parent, token),
    #: a node whose parent is node `parent`, the nodes numbered 0 (the last committed token), 1..k (ids) and then
    #: k + 1 + a for alts[a]; a parent comes before its children. (j, token) with j < k is a second choice for
    #: ids[j] (its sibling); a parent among the alts continues another branch. Siblings have distinct tokens.
    alts: list[tuple[int, int]] = field(default_factory=list)
    #: set by the verification (scheduler.decide_block) where the kept path left the chain: its tokens
    path: list[int] | None = None
    #: ... and how many of the chain's tokens it kept before it left
    chain_kept: int = 0

    def cut(self, k: int) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, alts) of this draft cut to depth k: the chain's first k tokens, and the alts that hang from what
        is kept within that depth, renumbered."""
        if len(self.ids) <= k:
            return list(self.ids), list(self.alts)
        old = len(self.ids)
        depth, index = {n: n for n in range(k + 1)}, {n: n for n in range(k + 1)}  # kept node -> depth, new number
        alts: list[tuple[int, int]] = []
        for a, (parent, token) in enumerate(self.alts):
            if parent in index and depth[parent] < k:
                alts.append((index[parent], token))
                depth[old + 1 + a], index[old + 1 + a] = depth[parent] + 1, k + len(alts)
        return self.ids[:k], alts

    def accepted_ids(self, n_accepted: int) -> list[int]:
        """The n_accepted tokens the verification kept: ids[:n_accepted], or the path it took through the tree."""
        return self.ids[:n_accepted] if self.path is None else self.path


@dataclass
class DraftCosts:
    token_s: float | None = None  # seconds per draft token
    transfer_s: float | None = None  # seconds per proposal's transfer (another process)
    catchup_s: float = 0.0  # per drafting round: feeding tokens another strategy committed (selection)


class Seq(Protocol):
    """What a draft source may read of a sequence (scheduler.Seq): the request's tokens, nothing of the plan."""

    id: int
    ids: list[int]  # prompt + committed tokens
    params: SamplingParams
    prompt_ids: list[int]


class DraftSource(Protocol):
    """What a source can do, not which layout it is: drafts_ahead, it drafts while the target verifies (another
    process: the round waits for its drafts at most the plan's deadline); drafts_together, it drafts many rows in
    one call. The plan's rows (tuning/controller.RowPlan) say what to draft; offers lists a selection's choices."""

    name: str
    drafts_ahead: bool
    drafts_together: bool

    def begin(self, seq: Seq, ahead: int, most: int) -> None: ...
    def offers(self, seqs: list[Seq], caps: list[int]) -> list[list[str]] | None: ...
    def propose(self, seqs: list[Seq], rows: list[RowPlan], budget_s: float) -> list[Draft]: ...
    def commit(self, seq: Seq, n_accepted: int, next_token: int) -> None: ...
    def end(self, seq: Seq) -> dict[str, Any]: ...
    def costs(self) -> DraftCosts: ...
    def health(self, probe: bool, timeout_s: float | None = None) -> dict[str, Any]: ...
    def close(self) -> None: ...


class Proposer(Protocol):
    """One request's draft, in process (the onnx drafter, the n-gram lookup): begin, then rounds of sync (when the
    text moved on without it), propose and commit (which rolls its KV cache back to the accepted prefix)."""

    name: str
    ids: list[int]
    last_catchup_s: float  # the last propose's time feeding committed tokens before drafting (not drafting)

    def spawn(self) -> Proposer: ...
    def begin(self, prompt_ids: list[int], params: SamplingParams) -> None: ...
    def sync(self, ids: list[int]) -> None: ...
    def limit_catchup(self, window: int) -> None: ...
    def propose(self, k: int) -> Draft: ...
    def commit(self, n_accepted: int, next_token: int) -> None: ...
    def close(self) -> None: ...
