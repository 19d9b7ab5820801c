"""Draft sources in this process (draft/base.py has the interface): one proposer kind for every sequence, and
the per-round selection among several sources (draft.candidates; local sources or the worker's, in both layouts)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from collections.abc import Callable

from .base import Draft, DraftCosts, DraftSource, Proposer, Seq
from ..tuning.controller import RowPlan
from ..tuning.cost_model import Ema
from .select import LOOKUPS

log = logging.getLogger("hetero_spec.draft")

PROBE_WINDOW = 64  # a re-probe feeds the draft at most this many of the tokens committed while it rested


class LocalSource:
    """Drafts with one proposer per sequence, spawned from a loaded one (one model, a state per sequence).
    together(proposers, ks): drafts for several sequences in one call (OnnxDrafter.propose_batch), if it can."""

    drafts_ahead = False

    def __init__(self, proposer: Proposer, together: Callable[[list[Proposer], list[int]], list[Draft]] | None = None):
        self.proposer, self.name, self._together = proposer, proposer.name, together
        self.drafts_together = together is not None
        self._props: dict[int, Proposer] = {}
        self._proposed: dict[int, bool] = {}  # drafted for the sequence this round
        self._fresh: set[int] = set()  # sequences not drafted for yet: their first catch-up is the prompt
        self._token_s = Ema(0.2)  # the draft's cost per token
        self._catchup_s = Ema(0.2)  # feeding what other strategies committed, per drafting round (selection)
        self._errors: Counter[int] = Counter()  # per sequence: calls of its proposer that raised

    def _failed(self, seq: Seq, what: str, exc: BaseException) -> None:
        """A proposer call raised: that sequence drafts nothing this round (draft/base.py: no call raises); the
        error is counted in its stats (draft_errors) and logged once per sequence, and the other rows go on."""
        self._errors[seq.id] += 1
        self._proposed[seq.id] = False
        if self._errors[seq.id] == 1:
            log.warning("draft %s: %s failed for request %d (it drafts nothing while this lasts; output is "
                        "unchanged): %s: %s", self.name, what, seq.id, type(exc).__name__, exc, exc_info=exc)

    def begin(self, seq: Seq, ahead: int = 0, most: int = 0) -> None:
        self._fresh.add(seq.id)
        try:
            proposer = self._props[seq.id] = self.proposer.spawn()
            proposer.begin(seq.prompt_ids, seq.params)
        except Exception as exc:  # noqa: BLE001 - the request goes on without this draft
            self._props.pop(seq.id, None)
            self._failed(seq, "begin", exc)

    def _ready(self, seq: Seq, probing: bool) -> Proposer:
        proposer = self._props[seq.id]
        if len(proposer.ids) != len(seq.ids):  # rounds it did not draft: take the committed text
            proposer.sync(seq.ids)
        if probing:
            proposer.limit_catchup(PROBE_WINDOW)
        return proposer

    def offers(self, seqs: list[Seq], caps: list[int]) -> None:
        return None  # one kind: nothing to choose among

    def propose(self, seqs: list[Seq], rows: list[RowPlan], budget_s: float = 0.0) -> list[Draft]:
        self._proposed.update((seq.id, row.k > 0 and seq.id in self._props) for seq, row in zip(seqs, rows))
        live = [i for i, seq in enumerate(seqs) if self._proposed[seq.id]
                and self._guarded(seq, "catch-up", self._ready, seq, rows[i].probing) is not None]
        if not live:
            return [Draft(ids=[]) for _ in seqs]
        props, live_ks = [self._props[seqs[i].id] for i in live], [rows[i].k for i in live]
        started = time.perf_counter()
        try:
            made = (self._together(props, live_ks) if self._together is not None
                    else [p.propose(k) for p, k in zip(props, live_ks)])
        except Exception:  # noqa: BLE001 - which row failed is not known: each alone, and only that one drafts nothing
            made = [self._guarded(seqs[i], "propose", p.propose, k) or Draft(ids=[])
                    for i, p, k in zip(live, props, live_ks)]
        fresh = [seqs[i].id in self._fresh for i in live]
        self._fresh.difference_update(seqs[i].id for i in live)
        self._observe(time.perf_counter() - started, props, made, fresh)
        drafts = dict(zip(live, made))
        return [drafts.get(i) or Draft(ids=[]) for i in range(len(seqs))]

    def _guarded(self, seq: Seq, what: str, call, *args):
        """call(*args), or None when it raises (counted and logged by _failed)."""
        try:
            return call(*args)
        except Exception as exc:  # noqa: BLE001 - see _failed
            self._failed(seq, what, exc)
            return None

    def _observe(self, seconds: float, props: list[Proposer], drafts: list[Draft], fresh: list[bool]) -> None:
        """The round's drafting time per token, without the catch-up (a step that fed a backlog is left out with
        its token); and the catch-up per round, but for a sequence's first (its prompt)."""
        catchup = sum(p.last_catchup_s for p in props)
        later = [p.last_catchup_s for p, f in zip(props, fresh) if not f]
        if later:
            self._catchup_s.add(sum(later) / len(later))
        tokens = sum(len(d.ids) - (1 if p.last_catchup_s else 0) for p, d in zip(props, drafts))
        if tokens > 0 and seconds > catchup:
            self._token_s.add((seconds - catchup) / tokens)

    def commit(self, seq: Seq, n_accepted: int, next_token: int) -> None:
        if self._proposed.get(seq.id):
            self._proposed[seq.id] = False
            self._guarded(seq, "commit", self._props[seq.id].commit, n_accepted, next_token)

    def end(self, seq: Seq) -> dict[str, Any]:
        self._proposed.pop(seq.id, None)
        self._fresh.discard(seq.id)
        if (proposer := self._props.pop(seq.id, None)) is not None:
            self._guarded(seq, "close", proposer.close)
        errors = self._errors.pop(seq.id, 0)
        fallback = {"draft_fallback": notes} if (notes := self._provider().get("draft_fallback")) else {}
        return ({"draft_errors": errors} if errors else {}) | fallback

    def costs(self) -> DraftCosts:
        return DraftCosts(self._token_s.value, None, self._catchup_s.value or 0.0)

    def _provider(self) -> dict[str, Any]:
        """The ONNX draft's execution provider, and the fallbacks its config allowed and took (else nothing)."""
        if (decoder := getattr(self.proposer, "decoder", None)) is None:
            return {}
        notes = {"draft_fallback": decoder.provider_notes} if decoder.provider_notes else {}
        return {"draft_provider": decoder.session.get_providers()[0], **notes}

    def health(self, probe: bool, timeout_s: float | None = None) -> dict[str, Any]:
        return {"draft": "in_process", **self._provider()}

    def close(self) -> None:
        for sid in list(self._props):
            self._props.pop(sid).close()
        self.proposer.close()


class SelectingSource:
    """Per-round draft selection (draft/select.py) among candidate sources: the lookups are asked first (offers)
    and compete only where they found a match; the controller's plan names each row's strategy, which drafts. A
    candidate that drafts ahead (the worker) is asked every round (k = 0 when another drafts), so that it keeps its
    stream and hears the commits."""

    name = "select"
    drafts_together = False

    def __init__(self, candidates: dict[str, DraftSource], names: list[str] | None = None):
        """names: the strategies chosen among (default: every candidate); one left out (the worker, next to
        candidates [ngram]) still runs and hears every commit."""
        self.cands, self.names = candidates, list(candidates) if names is None else names
        self.drafts_ahead = any(c.drafts_ahead for c in candidates.values())
        self.lookups = [n for n in candidates if n in LOOKUPS]
        self._found: dict[int, dict[str, Draft]] = {}  # per sequence: this round's lookup drafts
        self._chosen: dict[int, str | None] = {}  # per sequence: the candidate that drafted this round

    def begin(self, seq: Seq, ahead: int = 0, most: int = 0) -> None:
        for candidate in self.cands.values():
            candidate.begin(seq, ahead, most)

    def offers(self, seqs: list[Seq], caps: list[int]) -> list[list[str]]:
        """Each row's strategies: the model candidates, and a lookup as "name@n" where it matched a suffix of n
        tokens (a long match is right far more often: acceptance is kept per length)."""
        out = []
        for seq, cap in zip(seqs, caps):
            found = self._found[seq.id] = {n: self.cands[n].propose([seq], [RowPlan(k=cap)])[0] if cap > 0
                                           else Draft(ids=[]) for n in self.lookups}
            out.append([f"{n}@{found[n].match}" if n in self.lookups else n for n in self.names
                        if n not in self.lookups or found[n].ids])
        return out

    def propose(self, seqs: list[Seq], rows: list[RowPlan], budget_s: float) -> list[Draft]:
        """Each row's draft by the strategy its plan names; one deadline for the round's waits."""
        out, deadline = [], time.monotonic() + budget_s
        for seq, row in zip(seqs, rows):
            name = row.strategy.partition("@")[0] if row.strategy and row.k > 0 else None
            made = {n: c.propose([seq], [RowPlan(k=row.k if n == name else 0, ahead=row.ahead)],
                                 max(0.0, deadline - time.monotonic()))[0]
                    for n, c in self.cands.items() if n not in self.lookups}
            found = self._found.pop(seq.id, {})
            self._chosen[seq.id] = name
            if name in self.lookups:  # proposed at the row's cap: cut to the plan's gamma, branches too
                ids, alts = found[name].cut(max(1, row.k))
                out.append(Draft(ids, alts=alts))
            else:
                out.append(made.get(name, Draft([])))
        return out

    def commit(self, seq: Seq, n_accepted: int, next_token: int) -> None:
        name = self._chosen.get(seq.id)
        for cand_name, candidate in self.cands.items():
            if cand_name == name or candidate.drafts_ahead:
                candidate.commit(seq, n_accepted if cand_name == name else 0, next_token)
        self._chosen[seq.id] = None

    def end(self, seq: Seq) -> dict[str, Any]:
        self._chosen.pop(seq.id, None)
        self._found.pop(seq.id, None)
        return {key: v for c in self.cands.values() for key, v in c.end(seq).items()}

    def costs(self) -> DraftCosts:
        return DraftCosts(None, None)  # each candidate's own goes to the controller's selection

    def health(self, probe: bool, timeout_s: float | None = None) -> dict[str, Any]:
        workers = [c for c in self.cands.values() if c.drafts_ahead]
        return workers[0].health(probe, timeout_s) if workers else {"draft": "in_process"}

    def close(self) -> None:
        for candidate in self.cands.values():
            candidate.close()
