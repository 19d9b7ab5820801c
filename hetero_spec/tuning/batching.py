"""Hardware-aware batching: whether a batch speculates, and whether a waiting request may join it.

Each row (request) of a batch has its own gamma choice (tuning/gamma.py, as if it ran alone). For the batch as a
whole the choice is between two plans for a round, both committing tokens for every row:

- plain: every row without a draft, one token each, in ONE shared target pass:
  B tokens in S(B) seconds, where S(t) is the shared pass's cost for t positions;
- speculate: every row drafts k_b tokens (in turn, or stepping together when they all draft with the ONNX
  model: max k_b steps, each scaled like a shared target pass), then the blocks are verified,
  in one padded pass of B x max(k_b + 1) positions where the backend can (`batch_blocks`: torch), else one pass
  per row with a draft (the exported ONNX attention takes one-token rows only) plus one shared pass for the rest:
  sum_b E(a_b, k_b) tokens in sum_b k_b d + verify time.

The plan with more committed tokens per second wins. A wide accelerator verifies a batch of blocks for about
the price of one token, so speculation stays; on a CPU a shared pass of B tokens costs little more than one
token's, and the same positions spent on drafts cost B times, so speculation turns off as B grows. There is no
fixed threshold: S is measured (a line fitted to the shared passes seen), with the one-request verify line as
its prior until two batch sizes have been seen.

`serving.mode: latency` also holds a waiting request back when the batch with it is predicted to make a
round take more than LATENCY_SLOWDOWN x a round of one request alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .cost_model import CostModel, expected_tokens

#: serving.mode latency: the most a joining request may slow a round (predicted), against one request alone
LATENCY_SLOWDOWN = 1.5


@dataclass
class SharedPassCost:
    """S(t) = c0 + c1 t: the seconds of one target pass over t positions shared by several requests, fitted to
    the passes seen (a sliding window)."""

    points: deque = field(default_factory=lambda: deque(maxlen=128))  # (positions, seconds)

    def observe(self, positions: int, seconds: float) -> None:
        self.points.append((positions, seconds))

    def line(self) -> tuple[float, float] | None:
        """(c0, c1), or None until two distinct sizes have been seen."""
        if len({x for x, _ in self.points}) < 2:
            return None
        from .cost_model import fit_line

        c0, c1 = fit_line(list(self.points))
        return max(c0, 0.0), max(c1, 0.0)

    def cost(self, positions: int, model: CostModel | None) -> float | None:
        """Predicted seconds for a shared pass; before two sizes are known, the one-request verify line
        (a pass of `positions` tokens), or None without either."""
        line = self.line()
        if line is not None:
            return line[0] + line[1] * positions
        return model.verify(positions - 1) if model is not None else None


@dataclass
class BatchPlan:
    gammas: list[int]
    reason: str
    spec_rate: float | None = None  # predicted committed tokens/s over the batch
    plain_rate: float | None = None
    asked: list[int] | None = None  # the rows' own gammas, when the plan overrode them

    def spec_gammas(self) -> list[int]:
        return self.asked if self.asked is not None else self.gammas


def interleaved_rate(a: float, model: CostModel, g_max: int = 16) -> tuple[int, float]:
    """(gamma, committed tokens/s) of requests taking turns on one target while one draft worker drafts for all
    of them (two_process): the target verifies one request's block after another, the worker drafts the other
    requests' next blocks meanwhile, so a request's round costs V(g) while the worker keeps up (g d <= V(g)),
    else g d. The rate does not depend on how many requests take turns: their passes are not shared."""
    best = (0, 1.0 / model.verify(0))
    for g in range(1, g_max + 1):
        rate = expected_tokens(a, g) / max(model.verify(g), g * model.draft_token_s + model.transfer_s)
        if rate > best[1]:
            best = (g, rate)
    return best


def streams_or_rows(b: int, a: float, model: CostModel | None, shared: SharedPassCost) -> tuple[bool, str]:
    """two_process, b requests starting together: (True: they take turns, drafted by the worker; False: one
    shared target pass per round without drafts), by predicted committed tokens/s, and why."""
    if b < 2:
        return True, "one request: the worker drafts it"
    if model is None:
        return True, "no cost model yet: the worker drafts them"
    g, streams = interleaved_rate(a, model)
    s = shared.cost(b, model)
    plain = b / s if s else 0.0
    if streams >= plain:
        return True, f"{b} requests taking turns, drafted by the worker: {streams:.1f} tok/s (gamma {g}) >= " \
                     f"{plain:.1f} in shared passes without drafts"
    return False, f"{b} requests in shared passes without drafts: {plain:.1f} tok/s > {streams:.1f} taking " \
                  "turns, drafted by the worker"


def plan_batch(gammas: list[int], acceptances: list[float], model: CostModel | None, shared: SharedPassCost,
               batch_blocks: bool, draft_together: bool = False) -> BatchPlan:
    """The round's gammas for a batch: each row's own choice (speculate) or all 0 (plain), by predicted goodput.
    gammas: the rows' own choices; acceptances: the rows' estimates; model: the one-request costs (None: not
    yet measured, the rows' choices stand)."""
    b = len(gammas)
    if b < 2 or not any(gammas):
        return BatchPlan(gammas, "one row" if b < 2 else "no row drafts")
    plain_s = shared.cost(b, model)
    spec_s = _spec_time(gammas, model, shared, batch_blocks, draft_together)
    if plain_s is None or spec_s is None:
        return BatchPlan(gammas, "costs not measured yet: the rows' own choices")
    tokens = sum(expected_tokens(a, g) for a, g in zip(acceptances, gammas))
    spec_rate, plain_rate = tokens / spec_s, b / plain_s
    if spec_rate > plain_rate:
        return BatchPlan(gammas, f"batch of {b}: speculation predicts {spec_rate:.0f} tok/s against "
                                 f"{plain_rate:.0f} for one shared pass", spec_rate, plain_rate)
    return BatchPlan([0] * b, f"batch of {b}: one shared pass predicts {plain_rate:.0f} tok/s against "
                              f"{spec_rate:.0f} speculating", spec_rate, plain_rate, asked=list(gammas))


def _spec_time(gammas: list[int], model: CostModel | None, shared: SharedPassCost,
               batch_blocks: bool, draft_together: bool = False) -> float | None:
    if model is None:
        return None
    draft_s = sum(gammas) * model.draft_token_s
    drafting = sum(1 for g in gammas if g > 0)
    if draft_together and drafting > 1:
        # the drafting rows step together (one draft run per token for all): the draft is a smaller decoder of
        # the same shape, so a shared step is taken to scale with the rows as the target's shared pass does
        one, many = shared.cost(1, model), shared.cost(drafting, model)
        if one and many:
            draft_s = max(gammas) * model.draft_token_s * many / one
    if batch_blocks:
        verify_s = shared.cost(len(gammas) * (max(gammas) + 1), model)
        return None if verify_s is None else draft_s + verify_s
    alone = sum(model.verify(g) for g in gammas if g > 0)
    rest = sum(1 for g in gammas if g == 0)
    together = 0.0 if rest == 0 else (model.verify(0) if rest == 1 else shared.cost(rest, model))
    return None if together is None else draft_s + alone + together


def may_join(batch: int, mode: str, model: CostModel | None, shared: SharedPassCost) -> bool:
    """serving.mode latency: whether one more request may join a batch of `batch` (throughput: always)."""
    if mode != "latency" or batch == 0:
        return True
    alone = model.verify(0) if model is not None else shared.cost(1, None)
    joined = shared.cost(batch + 1, model)
    if alone is None or joined is None:
        return True
    return joined <= LATENCY_SLOWDOWN * alone
