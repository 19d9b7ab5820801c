"""Per-round draft selection (`draft.candidates`): each round drafts with the strategy whose predicted
goodput is highest, from its own measured acceptance and cost per token; `none` (the target alone) when no
strategy pays.

For strategy s with per-token acceptance a_s and draft cost d_s per token, the cost model
(tuning/cost_model.py) gives the best gamma g_s and goodput E(a_s, g_s) / R_s(g_s), where R_s is the round
time of the layout s drafts in: in process (g d_s + V(g), drafting and verifying in turn), or two-process
for the worker's model draft (drafting overlapped with verification); the target alone yields 1 / V(0).
Every strategy is tried in turn until each has `explore_rounds` rounds; after that a strategy not chosen
for `reprobe_every` rounds gets one round again (its acceptance may have changed: an n-gram lookup wins on
repetitive text, a model on novel text). The n-gram lookup costs microseconds, so it is asked every round
first, and it competes only in rounds where it found a match (its acceptance is measured on those): elsewhere
the choice is among the others.

`draft/source.SelectingSource` runs it over draft sources, in either layout: in process over local sources
(the onnx model, the n-gram lookup), in two processes over the worker's model stream and a local n-gram lookup
(the worker keeps drafting whatever is chosen).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..tuning.cost_model import Acceptance, CostModel
from .base import DraftCosts


LOOKUPS = ("ngram",)  # strategies that cost microseconds: asked every round, chosen only when they found a match
#: a model candidate feeds at most this many of the tokens other strategies committed since it last drafted
#: (OnnxDrafter.catchup_skip). Measured on the repetitive bench, in process, 6 prompts x 5 repeats, selection
#: against the n-gram lookup alone: feeding all 0.94-0.97x, the last 2 0.95x, the last 4 0.98x.
CATCHUP_SKIP = 4
#: draft.prompt_window: auto, in process, with a lookup among the candidates: the model reads the prompt's last
#: 32 tokens. Its prefill of a 170-token prompt cost 46 ms of the 80 ms it drafted per request on the
#: repetitive bench (the int8 draft: prefill is 0.27 ms a token), for about 11 model rounds; the draft's run
#: of agreement with the target fell 4 % (5.94 -> 5.71 tokens, offline over those prompts).
PROMPT_WINDOW = 32


def prompt_window(setting: int | str | None, candidates: list[str], layout: str) -> int | None:
    """The model draft's prompt window (OnnxDrafter.prompt_window) for draft.prompt_window = setting: an int
    or None as given; `auto` is PROMPT_WINDOW in process when a lookup drafts next to a model, else None (two
    processes: the worker drafts every round on its own core, its prefill beside the target's)."""
    if setting != "auto":
        return setting
    lookup = any(c in LOOKUPS for c in candidates) and any(c not in LOOKUPS for c in candidates)
    return PROMPT_WINDOW if lookup and layout == "in_process" else None


@dataclass
class StrategyStats:
    acceptance: Acceptance = field(default_factory=Acceptance)
    rounds: int = 0
    last_round: int = 0


class StrategyChooser:
    """The choice among named strategies (see the module docstring).

    model_fn() returns the engine's current CostModel (its verify line; None until known: candidates are
    cycled). layouts[name] is the layout the strategy drafts in; cost_fns[name]() its measured costs
    (DraftSource.costs: seconds per draft token, None until measured, and the catch-up per round)."""

    def __init__(self, names: list[str], model_fn: Callable[[], CostModel | None],
                 layouts: dict[str, str], cost_fns: dict[str, Callable[[], DraftCosts]],
                 prior_acceptance: float = 0.5, prior_weight: float = 8.0, explore_rounds: int = 2,
                 reprobe_every: int = 32):
        if not names:
            raise ValueError("draft selection needs at least one candidate")
        self.names = list(names)
        self.model_fn = model_fn
        self.prior, self.weight = prior_acceptance, prior_weight
        self.explore_rounds, self.reprobe_every = explore_rounds, reprobe_every
        self.layouts, self.cost_fns = layouts, cost_fns
        self.stats = {n: StrategyStats() for n in self.names}
        self.reason = ""
        self._round = 0

    def predict(self, model: CostModel, name: str, g_max: int) -> tuple[float, int]:
        """(predicted goodput, gamma) of strategy `name` at its best gamma <= g_max. A lookup (n-gram) is right
        in runs (a copy continues once it starts), so its acceptance is run-aware: the first token's rate, and
        the rate after an accepted token (cost_model.expected_tokens)."""
        acc = self.stats[name].acceptance
        layout = self.layouts.get(name, "in_process")
        c = self.cost_fns[name]()
        m = CostModel(model.verify_fixed_s, model.verify_per_token_s,
                      c.token_s if c.token_s is not None else model.draft_token_s, model.transfer_s,
                      c.catchup_s if layout == "in_process" else 0.0)
        if name in LOOKUPS:
            g, rate = m.best_gamma(acc.next_rate(self.prior, self.weight), layout, g_max,
                                   a_first=acc.first_rate(self.prior, self.weight))
        else:
            g, rate = m.best_gamma(acc.rate(self.prior, self.weight), layout, g_max)
        return rate, g
    def choose(self, k: int, available: list[str] | None = None) -> tuple[str | None, int]:
        """(strategy or None for the target alone, gamma) for this round; k is the most drafts allowed,
        `available` the strategies that can draft now (default: all)."""
        self._round += 1
        names = [n for n in self.names if available is None or n in available]
        if not names or k <= 0:
            self.reason = "none: no strategy can draft now"
            return None, 0
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
        preds = {n: self.predict(model, n, k) for n in names}
        best = max(preds, key=lambda n: preds[n][0])
        alone = 1.0 / model.verify(0)
        rate, g = preds[best]
        if g == 0 or rate <= alone:
            self.reason = f"none: best {best} predicts {rate:.1f} tok/s <= target alone {alone:.1f}"
            return None, 0
        self.reason = f"{best}: predicts {rate:.1f} tok/s at gamma {g} (target alone {alone:.1f})"
        return best, g

    def observe_round(self, name: str, drafted: int, accepted: int) -> None:
        """A round `name` drafted: its acceptance (drafted tokens, of which accepted)."""
        st = self.stats[name]
        st.rounds += 1
        st.last_round = self._round
        st.acceptance.observe(drafted, accepted)

    def summary(self) -> dict:
        out = {}
        for n, st in self.stats.items():
            c, acc = self.cost_fns[n](), st.acceptance
            out[n] = {"rounds": st.rounds, "acceptance": round(acc.rate(self.prior, self.weight), 4),
                      "first_token_acceptance": round(acc.first_rate(self.prior, self.weight), 4),
                      "acceptance_after_accepted": round(acc.next_rate(self.prior, self.weight), 4),
                      "tested": acc.tested,
                      "draft_ms_per_token": None if c.token_s is None else round(c.token_s * 1e3, 4),
                      "catchup_ms_per_round": round(c.catchup_s * 1e3, 4)}
        return {"strategies": out, "last_reason": self.reason}
