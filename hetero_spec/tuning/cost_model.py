"""A measured cost model of one speculative round, and the gamma that maximises predicted goodput.

Notation (Leviathan et al. 2023): a = per-token acceptance, g = gamma, d = seconds per draft token, V(g) = one
target pass over [last, d1..dg]. E(a, g) tokens per round; round time R: in_process g * d + V(g), two_process
V(g) + transfer + (1 - a^g) * g * d; goodput E / R. The formulas and why: docs/features-tuning.md#the-cost-model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

LAYOUTS = ("in_process", "two_process")


def expected_tokens(a: float, g: int, a_first: float | None = None) -> float:
    """E(a, g): tokens a round of g drafts commits, the target's own included. a_first (drafts right in runs,
    like an n-gram copy): the first token is accepted with probability a_first, each next one with a."""
    if g <= 0:
        return 1.0
    a = min(max(a, 0.0), 1.0)
    if a_first is None:
        return float(g + 1) if a >= 1.0 else (1.0 - a ** (g + 1)) / (1.0 - a)
    a1 = min(max(a_first, 0.0), 1.0)
    return 1.0 + a1 * (float(g) if a >= 1.0 else (1.0 - a ** g) / (1.0 - a))


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = c0 + c1 * x over (x, y) points; c1 = 0 with fewer than two distinct x."""
    if not points:
        raise ValueError("no points to fit")
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return my, 0.0
    c1 = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - c1 * mx, c1


@dataclass
class CostModel:
    """Seconds: V(g) = measured[g] where measured, else verify_fixed_s + verify_per_token_s * (g + 1);
    catchup_s, in process, what a drafting round pays first (feeding what another strategy committed)."""

    verify_fixed_s: float
    verify_per_token_s: float
    draft_token_s: float
    transfer_s: float = 0.0
    catchup_s: float = 0.0
    measured: dict[int, float] = field(default_factory=dict)  # g -> V(g) seen (Tuning.observe_verify)

    def verify(self, g: int) -> float:
        """V(g): one target pass over g drafts plus the last committed token."""
        v = self.measured.get(g)
        return v if v is not None else self.verify_fixed_s + self.verify_per_token_s * (g + 1)

    def round_time(self, g: int, a: float, layout: str, a_first: float | None = None) -> float:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if g <= 0:
            return self.verify(0)
        if layout == "in_process":
            return self.catchup_s + g * self.draft_token_s + self.verify(g)
        a = min(max(a, 0.0), 1.0)
        all_accepted = a ** g if a_first is None else min(max(a_first, 0.0), 1.0) * a ** (g - 1)
        return self.verify(g) + self.transfer_s + (1.0 - all_accepted) * g * self.draft_token_s

    def goodput(self, g: int, a: float, layout: str, a_first: float | None = None) -> float:
        """Predicted committed tokens per second at gamma g (g = 0: the target alone)."""
        return expected_tokens(a, g, a_first) / self.round_time(g, a, layout, a_first)

    def best_gamma(self, a: float, layout: str, g_max: int = 16, a_first: float | None = None) -> tuple[int, float]:
        """(gamma in 0..g_max with the highest predicted goodput, that goodput); 0: do not speculate; the smallest
        gamma among equals. Asked every round, so goodput's formulas are inlined, term for term (the same floats;
        tests compare it with `goodput`): calling goodput per gamma made the search 3x slower (22 against 8 us)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        a = min(max(a, 0.0), 1.0)
        a1 = None if a_first is None else min(max(a_first, 0.0), 1.0)
        d, inproc, verify = self.draft_token_s, layout == "in_process", self.verify
        best, best_rate = 0, 1.0 / verify(0)
        for g in range(1, g_max + 1):
            if a1 is None:
                e = float(g + 1) if a >= 1.0 else (1.0 - a ** (g + 1)) / (1.0 - a)
            else:
                e = 1.0 + a1 * (float(g) if a >= 1.0 else (1.0 - a ** g) / (1.0 - a))
            if inproc:
                r = self.catchup_s + g * d + verify(g)
            else:
                miss = 1.0 - (a ** g if a1 is None else a1 * a ** (g - 1))
                r = verify(g) + self.transfer_s + miss * g * d
            rate = e / r
            if rate > best_rate:
                best, best_rate = g, rate
        return best, best_rate

    def break_even_transfer_s(self, a: float, g_max: int = 16) -> float:
        """two_process: the largest per-round transfer time at which some gamma still beats the target alone (above
        it, best_gamma chooses 0): max over g of V(0) * E(a, g) - V(g) - (1 - a^g) * g * d."""
        a = min(max(a, 0.0), 1.0)
        return max(self.verify(0) * expected_tokens(a, g) - self.verify(g) - (1.0 - a ** g) * g * self.draft_token_s
                   for g in range(1, g_max + 1))

    def to_dict(self) -> dict:
        return {**asdict(self), "measured": {str(g): v for g, v in sorted(self.measured.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(**{k: float(d[k]) for k in ("verify_fixed_s", "verify_per_token_s", "draft_token_s")},
                   transfer_s=float(d.get("transfer_s", 0.0)),
                   measured={int(g): float(v) for g, v in (d.get("measured") or {}).items()})


@dataclass
class Acceptance:
    """Accepted and tested draft tokens, the one definition of acceptance: a draft token is "tested" when the
    target saw it before the first rejection of its round (a round cut short tests only what it verified). Also
    split into each round's first token and the ones after an accepted token (for drafts right in runs)."""

    accepted: float = 0.0
    tested: float = 0.0
    first_accepted: float = 0.0
    first_tested: float = 0.0

    def observe(self, k: int, n: int) -> None:
        """A verified block of k drafts of which the first n were accepted."""
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
        return (self.accepted - self.first_accepted + prior * weight) / (self.tested - self.first_tested + weight)


class Ema:
    """Exponential moving average; None until the first sample."""

    def __init__(self, alpha: float = 0.3):
        self.alpha, self.value = alpha, None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
