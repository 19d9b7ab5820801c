"""`speculation.gamma: auto`: each round's gamma maximises predicted goodput E(a, g) / R(g) (cost_model.py).

- a: per-token acceptance estimated online, per request, starting from a global prior that persists across
  the Engine's requests (`Tuning`): (accepted + prior * weight) / (tested + weight), where a draft token is
  "tested" when the target saw it before the first rejection of its round.
- R: the round time of the layout in use, from a profile (`hetero-spec profile`, `speculation.profile`), or
  learned as the engine runs: verification time is fitted as a line in the block length over the rounds seen
  so far, and the draft's time per token is a moving average. Until both are known, rounds cycle through a
  few short gammas (1, 2, 4) so that the line has distinct points.
- gamma 0 (the target alone) is chosen when nothing pays; every `probe_every` such rounds one round drafts
  again (acceptance may have risen). A probe that gets nothing accepted doubles the period (up to 512 rounds),
  so a useless draft costs almost nothing; one that does resets it.

The chosen gamma and its reason go into the request's stats (`extra.gamma_auto`).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from .cost_model import CostModel, expected_tokens
from .early_stop import ConfidenceStop
from .batching import SharedPassCost

EXPLORE = (1, 2, 4)  # gammas tried while the cost model is still unknown (short: the draft may be useless)
PROBE_EVERY = 16  # rounds at gamma 0 before a re-probe at PROBE_GAMMA; doubles per failed probe, up to MAX
PROBE_EVERY_MAX = 512
PROBE_GAMMA = 2
PROBE_WINDOW = 64  # a re-probe feeds the draft at most this many of the tokens committed while it rested


@dataclass
class Acceptance:
    """Accepted and tested draft tokens (see the module docstring); also split into each round's first token
    and the ones after an accepted token (a run-aware estimate, for drafts that are right in runs)."""

    accepted: float = 0.0
    tested: float = 0.0
    first_accepted: float = 0.0
    first_tested: float = 0.0

    def observe(self, k: int, n: int) -> None:
        if k > 0:
            self.accepted += n
            self.tested += n + (1 if n < k else 0)
            self.first_tested += 1
            self.first_accepted += 1 if n > 0 else 0

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.tested + weight)

    def first_rate(self, prior: float, weight: float) -> float:
        """P(a round's first draft token is accepted)."""
        return (self.first_accepted + prior * weight) / (self.first_tested + weight)

    def next_rate(self, prior: float, weight: float) -> float:
        """P(a draft token is accepted, given the one before it was)."""
        return ((self.accepted - self.first_accepted + prior * weight)
                / (self.tested - self.first_tested + weight))


@dataclass
class Tuning:
    """What the engine learns across requests: acceptance and costs. One per Engine, shared by the requests of
    a batch (they run in one thread, the request scheduler's)."""

    profile: CostModel | None = None
    prior_acceptance: float = 0.7
    prior_weight: float = 4.0  # weak: a useless draft shows within a few rounds
    probe_every: int = PROBE_EVERY  # re-probe period while gamma 0 is chosen (see GammaPolicy.choose)
    rounds_off: int = 0  # rounds at gamma 0 since the last probe (across requests)
    acceptance: Acceptance = field(default_factory=Acceptance)
    verify_points: deque = field(default_factory=lambda: deque(maxlen=256))  # (tokens in the pass, seconds)
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # n, sx, sy, sxx, sxy of verify_points
    draft_token_s: float | None = None
    alpha: float = 0.2
    early_stop: ConfidenceStop = field(default_factory=ConfidenceStop)
    shared: SharedPassCost = field(default_factory=SharedPassCost)  # target passes shared by a batch
    recommended_batch: int | None = None  # the profile's recommended_max_batch (serving.max_batch: auto)
    recommended_precision: str | None = None  # the profile's (target.precision: auto with allow_lossy)


    def reset_costs(self) -> None:
        """Forget the costs (the hardware under them changed: another layout or thread count); acceptance,
        a property of the draft and the text, is kept."""
        self.profile = None
        self.verify_points.clear()
        self._sums = [0.0] * 5
        self.draft_token_s = None
        self.shared = SharedPassCost()

    def seed_costs(self, model: CostModel, weight: int = 2) -> None:
        """Start the learned costs from a measured model (placement's probes): its verify line as points at
        block lengths 1 and 9, `weight` times each, and its draft cost. Rounds then refine them, and gamma auto
        needs no exploration rounds. A profile, when given, stays the model."""
        for k in (0, 8):
            for _ in range(weight):
                self.observe_verify(k, model.verify(k))
        if model.draft_token_s > 0:
            self.draft_token_s = model.draft_token_s

    def global_acceptance(self) -> float:
        return self.acceptance.rate(self.prior_acceptance, self.prior_weight)

    def off(self, reason: str) -> int:
        """A round where something else (the two-process gate) has turned speculation off: gamma 0."""
        self.reason = reason
        self.choices[0] += 1
        return 0

    def observe(self, k: int, n: int, verify_s: float | None, draft_s: float | None) -> None:
        """One round: k drafts, n accepted; verify_s None when the pass was shared with other requests."""
        self.acceptance.observe(k, n)
        if verify_s is not None:
            self.observe_verify(k, verify_s)
        if draft_s is not None and k > 0:
            self.observe_draft_token(draft_s / k)

    def observe_verify(self, k: int, verify_s: float) -> None:
        """One verification pass of k drafts (k + 1 tokens), whoever drafted them."""
        if len(self.verify_points) == self.verify_points.maxlen:
            self._add_point(*self.verify_points[0], sign=-1.0)  # the oldest leaves the window
        self.verify_points.append((k + 1, verify_s))
        self._add_point(k + 1, verify_s, sign=1.0)

    def observe_draft_token(self, seconds: float) -> None:
        """One measurement of the draft's time per token (moving average)."""
        a = self.alpha
        self.draft_token_s = seconds if self.draft_token_s is None else (1 - a) * self.draft_token_s + a * seconds

    def _add_point(self, x: float, y: float, sign: float) -> None:
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            self._sums[i] += sign * v

    def verify_line(self) -> tuple[float, float] | None:
        """(verify_fixed_s, verify_per_token_s): the profile's, else fitted to the passes seen so far (None
        until they have two distinct block lengths). O(1): asked every round, so from running sums."""
        if self.profile is not None:
            return self.profile.verify_fixed_s, self.profile.verify_per_token_s
        n, sx, sy, sxx, sxy = self._sums
        spread = n * sxx - sx * sx  # 0 when every point has the same block length
        if n < 2 or spread < 0.5:
            return None
        c1 = (n * sxy - sx * sy) / spread
        c0 = (sy - c1 * sx) / n
        return max(c0, 0.0), max(c1, 0.0)

    def model(self) -> CostModel | None:
        """The profile, else the costs learned so far (None until verify_line is known and the draft has
        been timed)."""
        if self.profile is not None:
            return self.profile
        line = self.verify_line()
        if line is None or self.draft_token_s is None:
            return None
        return CostModel(verify_fixed_s=line[0], verify_per_token_s=line[1], draft_token_s=self.draft_token_s)


@dataclass
class GammaPolicy:
    """One request's gamma choices. `fixed`: a configured integer gamma (no choice made)."""

    tuning: Tuning
    layout: str
    fixed: int | None = None
    g_max: int = 16
    acceptance: Acceptance = field(default_factory=Acceptance)
    choices: Counter = field(default_factory=Counter)
    reason: str = ""
    _round: int = 0
    _probing: bool = False
    _off_since: float | None = None  # tested tokens when gamma 0 was last chosen afresh
    _off_rounds: int = 0
    _off_rate: float = 0.0
    _off_a: float = 0.0

    def estimate(self) -> float:
        """This request's acceptance, starting from the global estimate."""
        return self.acceptance.rate(self.tuning.global_acceptance(), self.tuning.prior_weight)

    def choose(self) -> int:
        if self.fixed is not None:
            return self.fixed
        self._round += 1
        model = self.tuning.model()
        if model is None:
            g = EXPLORE[(self._round - 1) % len(EXPLORE)]
            self.reason = "exploring: no profile and too few measurements for a cost model yet"
        else:
            t = self.tuning
            if self._off_since is not None and t.acceptance.tested == self._off_since and self._off_rounds < 32:
                # off, and nothing was tested since (gamma 0 rounds test nothing): the answer has not changed,
                # so do not pay the search every round (about 0.1 ms, 2-3 % of a target step here)
                g, rate, a = 0, self._off_rate, self._off_a
                self._off_rounds += 1
            else:
                a = self.estimate()
                g, rate = model.best_gamma(a, self.layout, self.g_max)
                self._off_since, self._off_rounds = (t.acceptance.tested, 0) if g == 0 else (None, 0)
                self._off_rate, self._off_a = rate, a
            if g == 0:
                t.rounds_off += 1
                if t.rounds_off >= t.probe_every:  # re-probe now and then: acceptance may have risen
                    g, t.rounds_off, self._probing = PROBE_GAMMA, 0, True
            if g or self._off_rounds == 0:  # the reason is built only when the choice was made afresh
                self.reason = (f"a={a:.3f} ({self.layout}): predicted {rate:.1f} tok/s at gamma {g} (E="
                               f"{expected_tokens(a, g):.2f}, round {model.round_time(g, a, self.layout) * 1e3:.2f} ms)"
                               + (f"; re-probe (every {t.probe_every} rounds off)" if self._probing else ""))
        self.choices[g] += 1
        return g

    def off(self, reason: str) -> int:
        """A round where something else (the two-process gate) has turned speculation off: gamma 0."""
        self.reason = reason
        self.choices[0] += 1
        return 0

    @property
    def probing(self) -> bool:
        """This round is a re-probe after rounds at gamma 0."""
        return self._probing

    def observe(self, k: int, n: int, verify_s: float | None, draft_s: float | None) -> None:
        self.acceptance.observe(k, n)
        self.tuning.observe(k, n, verify_s, draft_s)
        if self._probing and k > 0:  # a failed probe waits twice as long for the next; a hit resets
            t = self.tuning
            t.probe_every = PROBE_EVERY if n > 0 else min(PROBE_EVERY_MAX, 2 * t.probe_every)
            self._probing = False

    def summary(self) -> dict:
        return {"choices": {str(g): c for g, c in sorted(self.choices.items())}, "last_reason": self.reason,
                "acceptance_estimate": round(self.estimate(), 4)}
