"""Per-round draft selection (`draft.candidates`, in process): each round drafts with the strategy whose
predicted goodput is highest, from its own measured acceptance and cost per token; `none` (the target
alone) when no strategy pays.

For strategy s with per-token acceptance a_s and draft cost d_s per token, the cost model
(tuning/cost_model.py) gives the best gamma g_s and goodput E(a_s, g_s) / (g_s d_s + V(g_s)); the target
alone yields 1 / V(0). Every strategy is tried in turn until each has `explore_rounds` rounds; after that a
strategy not chosen for `reprobe_every` rounds gets one round again (its acceptance may have changed: an
n-gram lookup wins on repetitive text, a model on novel text). Strategies not chosen in a round are kept in
step with the committed text (`sync`), so any of them can draft the next round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling import SamplingParams
from ..tuning.cost_model import CostModel
from ..tuning.gamma import Acceptance
from .base import Draft, Proposer


@dataclass
class StrategyStats:
    acceptance: Acceptance = field(default_factory=Acceptance)
    draft_s: float = 0.0
    drafted: int = 0
    rounds: int = 0
    last_round: int = 0

    def draft_token_s(self) -> float | None:
        return self.draft_s / self.drafted if self.drafted else None


class SelectingProposer:
    """A Proposer over named candidates (see the module docstring). `model_fn()` returns the current
    CostModel (the engine's tuning) or None; then candidates are cycled."""

    name = "select"

    def __init__(self, candidates: dict[str, Proposer], model_fn, prior_acceptance: float = 0.5,
                 prior_weight: float = 8.0, explore_rounds: int = 2, reprobe_every: int = 32):
        if not candidates:
            raise ValueError("draft selection needs at least one candidate")
        self.candidates = candidates
        self.model_fn = model_fn
        self.prior, self.weight = prior_acceptance, prior_weight
        self.explore_rounds, self.reprobe_every = explore_rounds, reprobe_every
        self.stats = {n: StrategyStats() for n in candidates}
        self.chosen: str | None = None
        self.reason = ""
        self.ids: list[int] = []
        self._draft_ids: list[int] = []
        self._round = 0
        self.last_catchup_s = 0.0

    # -- choice ---------------------------------------------------------------------------------------
    def _predict(self, model: CostModel, name: str, g_max: int) -> tuple[float, int]:
        st = self.stats[name]
        d = st.draft_token_s()
        a = st.acceptance.rate(self.prior, self.weight)
        m = CostModel(model.verify_fixed_s, model.verify_per_token_s, d if d is not None else model.draft_token_s)
        g, rate = m.best_gamma(a, "in_process", g_max)
        return rate, g

    def choose(self, k: int) -> tuple[str | None, int]:
        """(strategy or None for the target alone, gamma) for this round; k is the most drafts allowed."""
        self._round += 1
        names = list(self.candidates)
        unexplored = [n for n in names if self.stats[n].rounds < self.explore_rounds]
        model = self.model_fn()
        if unexplored or model is None:
            name = unexplored[0] if unexplored else names[self._round % len(names)]
            self.reason = f"exploring {name}" if unexplored else f"no cost model yet: cycling ({name})"
            return name, k
        stale = [n for n in names if self._round - self.stats[n].last_round >= self.reprobe_every]
        if stale:
            self.reason = f"re-probing {stale[0]}"
            return stale[0], k
        preds = {n: self._predict(model, n, k) for n in names}
        best = max(preds, key=lambda n: preds[n][0])
        alone = 1.0 / model.verify(0)
        rate, g = preds[best]
        if g == 0 or rate <= alone:
            self.reason = f"none: best {best} predicts {rate:.1f} tok/s <= target alone {alone:.1f}"
            return None, 0
        self.reason = f"{best}: predicts {rate:.1f} tok/s at gamma {g} (target alone {alone:.1f})"
        return best, g

    # -- Proposer protocol -----------------------------------------------------------------------------
    def begin(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.ids = list(prompt_ids)
        for p in self.candidates.values():
            p.begin(prompt_ids, params)
        self.chosen = None

    def propose(self, k: int) -> Draft:
        import time

        name, g = self.choose(k)
        self.chosen = name
        self.last_catchup_s = 0.0
        self._draft_ids = []
        if name is None or g <= 0:
            self.chosen = None
            return Draft(ids=[])
        p = self.candidates[name]
        self._sync(p)
        t = time.perf_counter()
        draft = p.propose(min(g, k))
        dt = time.perf_counter() - t
        catchup = getattr(p, "last_catchup_s", 0.0)
        self.last_catchup_s = catchup
        st = self.stats[name]
        st.rounds += 1
        st.last_round = self._round
        if draft.ids:
            st.draft_s += dt - catchup
            st.drafted += len(draft.ids) - (1 if catchup else 0)
        self._draft_ids = list(draft.ids)
        return draft

    def commit(self, n_accepted: int, next_token: int) -> None:
        drafted = self._draft_ids[:n_accepted]
        if self.chosen is not None:
            self.stats[self.chosen].acceptance.observe(len(self._draft_ids), n_accepted)
            self.candidates[self.chosen].commit(n_accepted, next_token)
        self.ids.extend([*drafted, next_token])
        self._draft_ids = []

    def _sync(self, p) -> None:
        """Bring a candidate that did not draft the last rounds up to the committed text."""
        if hasattr(p, "sync"):
            p.sync(self.ids)

    def close(self) -> None:
        for p in self.candidates.values():
            p.close()

    def summary(self) -> dict:
        out = {}
        for n, st in self.stats.items():
            d = st.draft_token_s()
            out[n] = {"rounds": st.rounds, "acceptance": round(st.acceptance.rate(self.prior, self.weight), 4),
                      "tested": st.acceptance.tested, "draft_ms_per_token": None if d is None else round(d * 1e3, 4)}
        return {"strategies": out, "last_reason": self.reason}
