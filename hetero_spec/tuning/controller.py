"""The speculation controller: the one place that decides whether to speculate, how far, and whether a batch's
rows share one plain pass. Never speculate where it is predicted slower than the target alone; one probe schedule
(`Tuning.probe_every`) brings gamma 0 and unchosen strategies back. Per-stream state lives in StreamControl, the
hardware's in the one `Tuning`. The policies, in words: docs/features-tuning.md, docs/features-batching.md.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from statistics import median_high
from typing import TYPE_CHECKING

from ..draft.select import LOOKUPS
from .cost_model import Acceptance, CostModel, expected_tokens, fit_line

if TYPE_CHECKING:
    from ..draft.base import DraftCosts

EXPLORE = (1, 2, 4)  # gammas tried while the cost model is still unknown (short: the draft may be useless)
PROBE_EVERY = 16  # rounds at gamma 0 before a re-probe at PROBE_GAMMA; doubles per failed probe, up to MAX
PROBE_EVERY_MAX = 512
PROBE_GAMMA = 2
#: after a failed probe, the next waits until the rounds at gamma 0 since have cost 1 / PROBE_BUDGET times what the
#: probe cost above a plain round (measured: the draft's catch-up and drafts, the longer pass), so that a draft that
#: never pays costs at most about PROBE_BUDGET of the time
PROBE_BUDGET = 0.01
VERIFY_WINDOW = 256  # the last passes the verify line is fitted to
RECENT = 5  # passes per block length whose median is that length's measured cost
#: passes of a block length before their median stands for it (until then the line does): one stalled pass at a
#: length the plan then stops choosing would otherwise keep that length's cost wrong for good
MEASURED_AFTER = 3
SHARED_SIZES = 64  # shared-pass sizes kept (padded block passes take many: rows x (k + 1) positions)
#: serving.mode latency: the most a joining request may slow a round (predicted), against one request alone
LATENCY_SLOWDOWN = 1.5
#: serving.plain_hold's default: rounds a plain plan (one shared pass) holds while the batch keeps its size
PLAIN_HOLD = 16
G_MAX = 16


def layout_rate(model: CostModel, acceptance: float, layout: str, speculating: bool = True) -> tuple[int, float]:
    """What the controller earns on a layout's costs: (the gamma it chooses, 0 where the target alone is faster;
    predicted tok/s), or the target alone's rate where speculation is off (not speculating). The placement asks
    this before it moves a layout (tuning/placement.py), so the two never disagree on whether speculation pays."""
    if not speculating:
        return 0, 1.0 / model.verify(0)
    return model.best_gamma(acceptance, layout, G_MAX)


@dataclass
class SharedPassCost:
    """S(t): seconds of one target pass over t positions shared by several requests: the median of the last RECENT
    passes of t where seen, else the line fitted to those medians (why medians: docs/features-batching.md)."""

    _recent: dict[int, deque] = field(default_factory=dict)  # positions -> its last RECENT passes' seconds
    _line: tuple[float, float] | None = None

    def observe(self, positions: int, seconds: float) -> None:
        recent = self._recent.pop(positions, None) or deque(maxlen=RECENT)
        recent.append(seconds)
        self._recent[positions] = recent  # the most recently seen size last
        if len(self._recent) > SHARED_SIZES:  # the line is refitted each round: the size seen longest ago goes
            del self._recent[next(iter(self._recent))]
        self._line = None

    @property
    def points(self) -> list[tuple[int, float]]:
        """(positions, median seconds) per size seen."""
        return sorted((positions, median_high(recent)) for positions, recent in self._recent.items())

    def line(self) -> tuple[float, float] | None:
        """(c0, c1), or None until two distinct sizes have been seen."""
        if self._line is None and len(self._recent) >= 2:
            c0, c1 = fit_line(self.points)
            self._line = max(c0, 0.0), max(c1, 0.0)
        return self._line

    def cost(self, positions: int, model: CostModel | None) -> float | None:
        """Predicted seconds for a shared pass; until two sizes are known, the one-request verify curve, if any."""
        if positions in self._recent and len(self._recent) >= 2:
            return median_high(self._recent[positions])
        if (line := self.line()) is not None:
            return line[0] + line[1] * positions
        return model.verify(positions - 1) if model is not None else None


@dataclass
class Tuning:
    """Costs and acceptance learned across requests: one per Engine, shared by a batch's streams (loop thread only)."""

    profile: CostModel | None = None
    prior_acceptance: float = 0.7
    prior_weight: float = 4.0  # weak: a useless draft shows within a few rounds
    probe_every: int = PROBE_EVERY  # re-probe period while gamma 0 is chosen
    rounds_off: int = 0  # rounds at gamma 0 since the last probe (across streams)
    acceptance: Acceptance = field(default_factory=Acceptance)
    verify_points: deque = field(default_factory=lambda: deque(maxlen=VERIFY_WINDOW))  # (tokens in the pass, s)
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # n, sx, sy, sxx, sxy of verify_points
    _line: tuple[float, float] | None = None  # (fixed s, s per token): the last line fitted with two lengths or more
    #: k -> the median of the last RECENT passes of k drafts (CostModel.measured: the curve where it was seen)
    measured: dict[int, float] = field(default_factory=dict)
    #: k > 0 -> measured[0] when measured[k] was last set: a block's cost is priced against the one-token step of its
    #: time (model), since plain steps are timed every round and blocks rarely once speculation rests
    _step_at: dict[int, float] = field(default_factory=dict)
    _recent: dict[int, deque] = field(default_factory=dict)
    draft_token_s: float | None = None
    transfer_s: float = 0.0  # one proposal's transfer (the worker source's measurement)
    shared: SharedPassCost = field(default_factory=SharedPassCost)  # target passes shared by a batch
    recommended_batch: int | None = None  # the profile's recommended_max_batch (serving.max_batch: auto)
    recommended_precision: str | None = None  # the profile's (target.precision: auto with allow_lossy)

    def reset_costs(self) -> None:
        """Forget the costs (another layout or thread count); acceptance, a property of the draft, is kept."""
        self.profile, self.draft_token_s, self.transfer_s, self.shared = None, None, 0.0, SharedPassCost()
        self.verify_points.clear()
        self._sums, self.measured, self._recent, self._line, self._step_at = [0.0] * 5, {}, {}, None, {}

    def seed_costs(self, model: CostModel) -> None:
        """Start the learned costs from a measured model (placement's probes), so gamma auto needs no exploration."""
        for k in (0, 0, 8, 8):
            self.observe_verify(k, model.verify(k))
        if model.draft_token_s > 0:
            self.draft_token_s = model.draft_token_s

    def global_acceptance(self) -> float:
        return self.acceptance.rate(self.prior_acceptance, self.prior_weight)

    def probed(self, hit: bool, cost_s: float | None = None) -> None:
        """A probe's outcome (the one probe schedule): a hit resets the period; a miss doubles it (up to
        PROBE_EVERY_MAX), and makes it at least the rounds at gamma 0 that the probe's measured cost above a plain
        round (cost_s) is PROBE_BUDGET of."""
        if hit:
            self.probe_every = PROBE_EVERY
            return
        model = self.model()
        floor = 0 if cost_s is None or model is None else math.ceil(cost_s / (PROBE_BUDGET * model.verify(0)))
        self.probe_every = max(floor, min(PROBE_EVERY_MAX, 2 * self.probe_every))

    def observe_verify(self, k: int, verify_s: float) -> None:
        """One verification pass of k drafts (k + 1 tokens), whoever drafted them."""
        if len(self.verify_points) == self.verify_points.maxlen:
            self._add_point(*self.verify_points[0], sign=-1.0)  # the oldest leaves the window
        self.verify_points.append((k + 1, verify_s))
        self._add_point(k + 1, verify_s, sign=1.0)
        n, sx, sy, sxx, sxy = self._sums
        spread = n * sxx - sx * sx  # 0 when every point has the same block length
        if n >= 2 and spread >= 0.5:
            c1 = (n * sxy - sx * sy) / spread
            self._line = (max((sy - c1 * sx) / n, 0.0), max(c1, 0.0))
        # else the window holds one block length only (after VERIFY_WINDOW rounds at gamma 0 every point is a plain
        # step): the line stays the last one fitted. The model must not be lost to rounds that test nothing, or the
        # controller would explore again, drafting blocks of a draft it has already judged useless
        recent = self._recent.setdefault(k, deque(maxlen=RECENT))
        recent.append(verify_s)
        if len(recent) >= MEASURED_AFTER:
            self.measured[k] = median_high(recent)  # a median: one stalled pass does not move it
            if k and 0 in self.measured:
                self._step_at[k] = self.measured[0]

    def _add_point(self, x: float, y: float, sign: float) -> None:
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            self._sums[i] += sign * v

    def model(self, need_draft: bool = True) -> CostModel | None:
        """The profile, else the costs learned so far: the passes seen per length, else the verify line (O(1), from
        running sums: asked every round); None until two block lengths and (need_draft) the draft were timed."""
        if self.profile is not None:
            return self.profile
        if self._line is None or (need_draft and self.draft_token_s is None):
            return None
        measured, step = self.measured, self.measured.get(0)
        if step and self._step_at:
            # the machine's load moves every pass alike: a block timed when a step took s0 costs step / s0 of it now
            # (on a shared 2-core machine the step swung 23-48 ms; a block timed in a quiet spell then looked free)
            measured = {k: v * step / self._step_at[k] if k in self._step_at else v for k, v in measured.items()}
        return CostModel(*self._line, self.draft_token_s or 0.0, self.transfer_s, measured=measured)


@dataclass
class StreamControl:
    """One stream's part of the controller. `fixed`: a configured integer gamma (no choice made). shadow: its
    drafts can be compared with the target's own tokens for free while it rests (greedy and coupled requests)."""

    fixed: int | None = None
    stream_id: int = 0
    shadow: bool = False
    acceptance: Acceptance = field(default_factory=Acceptance)
    choices: Counter = field(default_factory=Counter)
    reason: str = ""
    gamma: int = 0  # this round's gamma, before the room left (0: none)
    steps: int = 1  # gamma 0: the rounds at 0 this round may stand for (RowPlan.steps)
    probing: bool = False  # this round re-probes after rounds at gamma 0
    ahead: int = 0  # the block a source that drafts ahead drafts at: the last gamma > 0
    _round: int = 0
    #: (key, rate, a) of a gamma 0 chosen afresh; key: (engine-wide tested tokens, the draft's costs) then
    _off: tuple | None = None
    _off_rounds: int = 0


@dataclass
class RowPlan:
    """One row's part of a round. k: drafts to verify (0: the target alone). ahead: the block a source that drafts
    ahead drafts at meanwhile (0: it rests). strategy: the draft selection's choice ("ngram@3"; None: the source's
    only kind). probing: a re-probe after rounds at gamma 0 (the draft catches up on a short window)."""

    k: int = 0
    ahead: int = 0
    strategy: str | None = None
    probing: bool = False
    #: k 0: the rounds at gamma 0 the row may run as one (the rounds left before its re-probe); the loop runs them as
    #: one-token steps and reports how many it ran (ran_plain)
    steps: int = 1


@dataclass
class RoundPlan:
    """The controller's decision for one round: per row, what to draft; for the round, whether no row drafts (one
    shared plain pass) and how long the round may wait for drafts made in another process (None: drafted here)."""

    rows: list[RowPlan]
    shared: bool = False
    deadline_s: float | None = None

    @property
    def ks(self) -> list[int]:
        return [row.k for row in self.rows]


#: what a draft selection offers a round: given each row's cap, the strategies that can draft each row (a lookup
#: as "name@n", n the suffix it matched, where it matched), or None when the source has no choice to make
Offers = Callable[[list[int]], list[list[str]] | None]


class Controller:
    """layout: the cost model's round (in_process | two_process). batch_blocks: the target verifies rows with blocks
    of different lengths in one pass (else one pass per drafting row). together: the source drafts many rows in
    one call (its rows' steps are priced as one shared pass)."""

    def __init__(self, tuning: Tuning, layout: str, batch_blocks: bool, mode: str = "throughput",
                 plain_hold: int = PLAIN_HOLD):
        self.tuning, self.layout, self.batch_blocks, self.mode = tuning, layout, batch_blocks, mode
        self.plain_hold = plain_hold  # serving.plain_hold
        self.together = False
        self.chooser: StrategyChooser | None = None  # draft selection (Controller.selection)
        self.last_plan = ""
        self.last_rates: tuple[float, float] | None = None  # (speculating, one shared pass): predicted tok/s
        self._plain = (0, 0)  # (batch size, rounds left): a plain plan holds this long for an unchanged batch

    def stream(self, gamma: int | str, stream_id: int = 0, shadow: bool = False) -> StreamControl:
        """A new stream's part; it starts drafting ahead at the configured gamma, or the cost model's best (else 4)."""
        stream = StreamControl(fixed=gamma if isinstance(gamma, int) else None, stream_id=stream_id, shadow=shadow)
        model = self.tuning.model()
        stream.ahead = stream.fixed if stream.fixed is not None else \
            max(1, model.best_gamma(self.estimate(stream), self.layout, G_MAX)[0]) if model else 4
        return stream

    def estimate(self, stream: StreamControl) -> float:
        """A stream's acceptance, starting from the engine-wide estimate."""
        return stream.acceptance.rate(self.tuning.global_acceptance(), self.tuning.prior_weight)

    # -- 1) plan -------------------------------------------------------------------------------------------
    def plan(self, streams: list[StreamControl], rooms: list[int], offers: Offers | None = None,
             wait_default_s: float = 0.010) -> RoundPlan:
        """The round's plan: each row's k is at most room - 1 (room: the tokens it may still commit). offers: the
        source's strategies per row (draft selection), asked only when some row may draft. wait_default_s: see
        wait_budget (the rows' prefill time, say)."""
        size, left = self._plain
        if len(streams) > 1 and size == len(streams) and left > 0:
            self._plain = (size, left - 1)
            return self._plain_round(streams)
        caps = [max(0, min(G_MAX if s.fixed is None else s.fixed, room - 1)) for s, room in zip(streams, rooms)]
        offered = offers(caps) if offers is not None and self.chooser is not None else None
        if offered is None:
            for stream in streams:
                stream.gamma = self._choose(stream)  # a source drafting ahead drafts on at it (0: it rests)
            rows = [self._row(s, min(s.gamma, cap)) for s, cap in zip(streams, caps)]
        else:
            self.chooser.next_round()
            rows = [self._selected(s, cap, names) for s, cap, names in zip(streams, caps, offered)]
        if len(streams) > 1 and all(s.fixed is None for s in streams):
            together = self.together and offered is None
            if not any(self.plan_batch([row.k for row in rows], [self.estimate(s) for s in streams], together)):
                return self._plain_round(streams, counted=True)
        deadline = self.wait_budget(max(row.k for row in rows), wait_default_s) if self.layout == "two_process" \
            else None
        return RoundPlan(rows, shared=len(rows) > 1 and not any(row.k for row in rows), deadline_s=deadline)

    def _row(self, stream: StreamControl, k: int, strategy: str | None = None) -> RowPlan:
        if stream.gamma > 0:
            stream.ahead = stream.gamma
        ahead = stream.ahead if stream.gamma > 0 or stream.shadow else 0
        return RowPlan(k=max(0, k), ahead=ahead, strategy=strategy, probing=stream.probing,
                       steps=stream.steps if k <= 0 else 1)

    def _selected(self, stream: StreamControl, cap: int, names: list[str]) -> RowPlan:
        """Draft selection's row: the strategy the chooser picks among those offered, at its gamma (<= cap); a
        source drafting ahead keeps drafting at the stream's largest block."""
        stream.probing, stream.gamma, stream.steps = False, G_MAX if stream.fixed is None else stream.fixed, 1
        key, gamma = self.chooser.choose(cap, names, stream=stream.stream_id, round_started=True)
        stream.choices[gamma] += 1
        return self._row(stream, gamma, key)

    def _plain_round(self, streams: list[StreamControl], counted: bool = False) -> RoundPlan:
        """No row drafts: one shared pass (a source drafting ahead goes on only where it compares for free)."""
        rows = []
        for stream in streams:
            if not counted:
                stream.choices[0] += 1
            stream.probing, stream.gamma, stream.steps = False, 0, 1
            rows.append(self._row(stream, 0))
        return RoundPlan(rows, shared=True, deadline_s=0.0 if self.layout == "two_process" else None)

    def _choose(self, stream: StreamControl) -> int:
        """A stream's gamma as if it ran alone (best predicted goodput; 0: the target alone is best), or a re-probe."""
        stream.probing, stream.steps = False, 1
        if stream.fixed is not None:
            return stream.fixed
        stream._round += 1
        tuning, model = self.tuning, self.tuning.model()
        if model is None:
            gamma = EXPLORE[(stream._round - 1) % len(EXPLORE)]
            stream.reason = "exploring: no profile and too few measurements for a cost model yet"
        else:
            key = (tuning.acceptance.tested, tuning.draft_token_s, tuning.transfer_s)
            if stream._off is not None and stream._off[0] == key and stream._off_rounds < 32:
                # off, and nothing was tested since (gamma 0 rounds test nothing) nor the draft's costs moved: the
                # answer has not changed, so do not pay the search every round (about 0.1 ms, 2-3 % of a step)
                gamma, (_, rate, a) = 0, stream._off
                stream._off_rounds += 1
            else:
                a = self.estimate(stream)
                gamma, rate = layout_rate(model, a, self.layout)
                stream._off, stream._off_rounds = ((key, rate, a) if gamma == 0 else None), 0
            if gamma == 0:
                tuning.rounds_off += 1
                if tuning.rounds_off >= tuning.probe_every:
                    gamma, tuning.rounds_off, stream.probing = PROBE_GAMMA, 0, True
                else:  # this round and the ones at 0 before the re-probe may run as one (ran_plain counts them)
                    stream.steps = tuning.probe_every - tuning.rounds_off
            if gamma or stream._off_rounds == 0:  # the reason is built only when the choice was made afresh
                round_ms = model.round_time(gamma, a, self.layout) * 1e3
                stream.reason = (f"a={a:.3f} ({self.layout}): predicted {rate:.1f} tok/s at gamma {gamma} (E="
                                 f"{expected_tokens(a, gamma):.2f}, round {round_ms:.2f} ms)"
                                 + (f"; re-probe (every {tuning.probe_every} rounds off)" if stream.probing else ""))
        stream.choices[gamma] += 1
        return gamma

    def plan_batch(self, ks: list[int], acceptances: list[float], together: bool = False) -> list[int]:
        """Rows' own choices, or all 0 (one shared pass), by predicted tok/s. together: drafting rows draft as one."""
        batch, model, shared = len(ks), self.tuning.model(), self.tuning.shared
        self.last_rates = None
        if batch < 2 or not any(ks):
            self.last_plan = "one row" if batch < 2 else "no row drafts"
            return ks
        plain_s, spec_s = shared.cost(batch, model), self._spec_time(ks, model, together)
        if plain_s is None or spec_s is None:
            self.last_plan = "costs not measured yet: the rows' own choices"
            return ks
        spec_rate, plain_rate = sum(expected_tokens(a, k) for a, k in zip(acceptances, ks)) / spec_s, batch / plain_s
        self.last_rates = (spec_rate, plain_rate)
        if spec_rate > plain_rate:
            self.last_plan = (f"batch of {batch}: speculation predicts {spec_rate:.0f} tok/s against {plain_rate:.0f} "
                              "for one shared pass")
            return ks
        self.last_plan = (f"batch of {batch}: one shared pass predicts {plain_rate:.0f} tok/s against "
                          f"{spec_rate:.0f} speculating")
        self._plain = (batch, self.plain_hold)
        return [0] * batch

    def _spec_time(self, ks: list[int], model: CostModel | None, together: bool) -> float | None:
        """Predicted seconds of a speculating round of the batch (docs/features-batching.md#the-batch-plan); drafting
        together: max k steps, each scaled like a shared target pass."""
        if model is None:
            return None
        shared = self.tuning.shared
        draft_s = 0.0 if self.layout == "two_process" else sum(ks) * model.draft_token_s
        drafting = sum(1 for k in ks if k > 0)
        if together and drafting > 1 and self.layout == "in_process":
            one, many = shared.cost(1, model), shared.cost(drafting, model)
            if one and many:
                draft_s = max(ks) * model.draft_token_s * many / one
        if self.batch_blocks:
            verify_s = shared.cost(len(ks) * (max(ks) + 1), model)
            return None if verify_s is None else draft_s + verify_s
        alone = sum(model.verify(k) for k in ks if k > 0)
        rest = sum(1 for k in ks if k == 0)
        joint = 0.0 if rest == 0 else (model.verify(0) if rest == 1 else shared.cost(rest, model))
        return None if joint is None else draft_s + alone + joint

    def wait_budget(self, k: int, default_s: float) -> float:
        """How long the target may wait for k drafts from another process: their cost, at most one target step (longer
        is slower than decoding alone); half of `default_s` before any cost."""
        model = self.tuning.model()
        cap = model.verify(0) if model is not None else default_s
        if (token_s := self.tuning.draft_token_s) is None:
            return 0.5 * cap
        return min(cap, (k * token_s + self.tuning.transfer_s) * 1.5 + 0.0005)

    def may_join(self, batch: int) -> bool:
        """serving.mode latency: whether one more request may join a batch of `batch` (throughput: always)."""
        if self.mode != "latency" or batch == 0:
            return True
        model, shared = self.tuning.model(), self.tuning.shared
        alone = model.verify(0) if model is not None else shared.cost(1, None)
        joined = shared.cost(batch + 1, model)
        return alone is None or joined is None or joined <= LATENCY_SLOWDOWN * alone

    # -- 5) observe ----------------------------------------------------------------------------------------
    def observe(self, stream: StreamControl, k: int, n: int, verify_s: float | None,
                row: RowPlan | None = None, draft_s: float | None = None) -> None:
        """One stream's round as planned in row (default: its last plan): k drafts, n accepted; verify_s None when
        the pass was shared with other rows; draft_s: what drafting (or waiting for the drafts) took."""
        row = row or RowPlan(probing=stream.probing)
        stream.acceptance.observe(k, n)
        self.tuning.acceptance.observe(k, n)
        if verify_s is not None:
            self.tuning.observe_verify(k, verify_s)
        cost_s = self._probe_cost(k, verify_s, draft_s)
        if row.strategy is not None and k > 0:
            self.chooser.observe_round(row.strategy, k, n, stream=stream.stream_id, cost_s=cost_s)
        elif row.probing and k > 0:
            self.tuning.probed(n > 0, cost_s)

    def _probe_cost(self, k: int, verify_s: float | None, draft_s: float | None) -> float | None:
        """What a round of k drafts cost above a plain round: its drafting and its pass, less one step."""
        if draft_s is None or (model := self.tuning.model()) is None:
            return None
        return max(0.0, draft_s + (model.verify(k) if verify_s is None else verify_s) - model.verify(0))

    def observe_costs(self, token_s: float | None, transfer_s: float | None) -> None:
        """The draft source's measured costs (DraftSource.costs)."""
        if token_s is not None:
            self.tuning.draft_token_s = token_s
        if transfer_s is not None:
            self.tuning.transfer_s = transfer_s

    def ran_plain(self, stream: StreamControl, steps: int) -> None:
        """The loop ran a row planned at k 0 as `steps` one-token rounds (at most RowPlan.steps): the ones after the
        first count as rounds at gamma 0 too, for the re-probe schedule and the stream's choices."""
        if steps > 1:
            self.tuning.rounds_off += steps - 1
            stream.choices[0] += steps - 1

    def observe_pass(self, rows: int, positions: int, all_single: bool, seconds: float) -> None:
        """One verify_batch call: the shared-pass line learns from it when it was one pass of several rows."""
        if rows > 1 and (self.batch_blocks or all_single):
            self.tuning.shared.observe(positions if self.batch_blocks else rows, seconds)

    def selection(self, names: list[str], layouts: dict[str, str],
                  cost_fns: dict[str, Callable[[], DraftCosts]]) -> StrategyChooser:
        """The choice among draft strategies (draft.candidates), on this controller's costs and probe schedule:
        part of every plan from now on."""
        self.chooser = StrategyChooser(names, self.tuning, layouts, cost_fns,
                                       prior_acceptance=self.tuning.prior_acceptance)
        return self.chooser

    def observe_shadow(self, tested: int, accepted: int) -> None:
        """Drafts compared with tokens the target decoded alone: a draft judged useless early can be judged again."""
        self.tuning.acceptance.observe(tested, accepted)

    def first_block(self, stream: StreamControl) -> tuple[int, int]:
        """(the block a source that drafts ahead starts at, the longest block a plan may ask of this stream)."""
        return stream.ahead, G_MAX if stream.fixed is None else max(1, stream.fixed)

    def end(self, stream: StreamControl) -> dict:
        """A stream ended: what its stats report of the controller's choices (its per-stream state goes)."""
        out: dict = {}
        if stream.fixed is None:
            out["gamma_auto"] = {"choices": {str(g): c for g, c in sorted(stream.choices.items())},
                                 "last_reason": stream.reason, "acceptance_estimate": round(self.estimate(stream), 4)}
        if self.chooser is not None:
            self.chooser.forget(stream.stream_id)
            out["draft_selection"] = self.chooser.summary()
        return out


@dataclass
class StrategyStats:
    acceptance: Acceptance = field(default_factory=Acceptance)
    rounds: int = 0
    last_round: int = 0


class StrategyChooser:
    """The choice among named strategies (draft/select.py) on the engine's verify line (cycled until it is known).
    layouts[name]: where it drafts; cost_fns[name](): its DraftCosts. Re-probes on the one schedule."""

    weight = 8.0  # of the prior acceptance

    def __init__(self, names: list[str], tuning: Tuning, layouts: dict[str, str],
                 cost_fns: dict[str, Callable[[], DraftCosts]], prior_acceptance: float = 0.5, explore_rounds: int = 2):
        if not names:
            raise ValueError("draft selection needs at least one candidate")
        self.names, self.tuning, self.prior, self.explore_rounds = list(names), tuning, prior_acceptance, explore_rounds
        self.layouts, self.cost_fns = layouts, cost_fns
        self.stats = {n: StrategyStats() for n in self.names}
        self.reason, self._round = "", 0
        self._probing: dict[int, str] = {}  # per stream: the strategy it re-probes this round

    def predict(self, model: CostModel, name: str, g_max: int) -> tuple[float, int]:
        """(predicted goodput, gamma) of strategy `name` at its best gamma <= g_max. A lookup is right in runs (a
        copy continues once it starts): its acceptance is run-aware (cost_model.expected_tokens)."""
        base = name.partition("@")[0]
        acc, layout, costs = self._stats(name).acceptance, self.layouts.get(base, "in_process"), self.cost_fns[base]()
        priced = replace(model, draft_token_s=costs.token_s if costs.token_s is not None else model.draft_token_s,
                    catchup_s=costs.catchup_s if layout == "in_process" else 0.0)
        lookup = base in LOOKUPS
        a = (acc.next_rate if lookup else acc.rate)(self.prior, self.weight)
        a_first = acc.first_rate(self.prior, self.weight) if lookup else None
        gamma, rate = priced.best_gamma(a, layout, g_max, a_first=a_first)
        return rate, gamma

    def next_round(self) -> None:
        """A round begins: the clock of exploration and re-probes moves once a round, however many rows it has."""
        self._round += 1

    def choose(self, k: int, available: list[str] | None = None, stream: int = 0,
               round_started: bool = False) -> tuple[str | None, int]:
        """This round's (strategy, or None for the target alone; gamma <= k) for one stream, among `available`
        (default: all). round_started: the caller began the round with next_round() (several streams choose in it);
        otherwise this call is a round of its own."""
        if not round_started:
            self.next_round()
        self._probing.pop(stream, None)
        names = list(self.names if available is None else available)
        if not names or k <= 0:
            self.reason = "none: no strategy can draft now"
            return None, 0
        unexplored = [n for n in names if self._stats(n).rounds < self.explore_rounds]
        model = self.tuning.model(need_draft=False)
        if unexplored or model is None:
            # short blocks of varying length: the verify line needs two lengths, and a useless draft costs little
            name = unexplored[0] if unexplored else names[self._round % len(names)]
            self.reason = f"exploring {name}" if unexplored else f"no cost model yet: cycling ({name})"
            return name, min(k, EXPLORE[self._round % len(EXPLORE)])
        stale = [n for n in names if self._round - self._stats(n).last_round >= self.tuning.probe_every]
        if stale:
            self.reason = f"re-probing {stale[0]} (every {self.tuning.probe_every} rounds)"
            self._probing[stream] = stale[0]
            return stale[0], min(k, PROBE_GAMMA)
        preds = {n: self.predict(model, n, k) for n in names}
        best = max(preds, key=lambda n: preds[n][0])
        alone = 1.0 / model.verify(0)
        rate, g = preds[best]
        if g == 0 or rate <= alone:
            self.reason = f"none: best {best} predicts {rate:.1f} tok/s <= target alone {alone:.1f}"
            return None, 0
        self.reason = f"{best}: predicts {rate:.1f} tok/s at gamma {g} (target alone {alone:.1f})"
        return best, g

    def _stats(self, name: str) -> StrategyStats:
        """A strategy's record; a lookup's per matched length ("ngram@3") starts when that length first drafts."""
        return self.stats.setdefault(name, StrategyStats())

    def observe_round(self, name: str, drafted: int, accepted: int, stream: int = 0,
                      cost_s: float | None = None) -> None:
        """A round `name` drafted for `stream`: its acceptance (drafted tokens, of which accepted); the outcome of
        that stream's re-probe, if it was one (cost_s: what it cost above a plain round, Tuning.probed)."""
        record = self._stats(name)
        record.rounds += 1
        record.last_round = self._round
        record.acceptance.observe(drafted, accepted)
        if self._probing.get(stream) == name and drafted:
            self.tuning.probed(accepted > 0, cost_s)
            del self._probing[stream]

    def forget(self, stream: int) -> None:
        """A stream ended: its probing state goes with it."""
        self._probing.pop(stream, None)

    def summary(self) -> dict:
        out = {}
        for name, record in self.stats.items():
            if not record.rounds and any(k.startswith(f"{name}@") for k in self.stats):
                continue  # a lookup drafts under its matched lengths' names
            costs, acc = self.cost_fns[name.partition("@")[0]](), record.acceptance
            out[name] = {"rounds": record.rounds, "acceptance": round(acc.rate(self.prior, self.weight), 4),
                      "first_token_acceptance": round(acc.first_rate(self.prior, self.weight), 4),
                      "acceptance_after_accepted": round(acc.next_rate(self.prior, self.weight), 4),
                      "tested": acc.tested,
                      "draft_ms_per_token": None if costs.token_s is None else round(costs.token_s * 1e3, 4),
                      "catchup_ms_per_round": round(costs.catchup_s * 1e3, 4)}
        return {"strategies": out, "last_reason": self.reason}
