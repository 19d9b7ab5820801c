"""Confidence early stop (`speculation.early_stop: true`, in process): the drafter ends a block when the
draft's probability of its own token falls below a threshold learned from what the target accepted.

Every verified round teaches it: a drafted token at position i of a block was tested when the target
accepted the i tokens before it, and accepted when i < n. Tokens are binned by the draft's confidence
(its probability of the token it proposed). The threshold is the upper edge of the lowest run of bins,
each with at least `min_samples` tested tokens, whose acceptance is below the break-even: drafting a
token costs draft_token + verify_per_token seconds, and pays when it is accepted often enough to be worth
that at the current goodput, P(accept) > (draft_token + verify_per_token) x goodput. Without a cost model
the break-even is `default_break_even`. Until the bins are filled there is no threshold (no early stop).
Stopping early never changes the output (every committed token is still the target's), only the speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BINS = 10


@dataclass
class ConfidenceStop:
    min_samples: int = 20
    default_break_even: float = 0.35
    tested: list[int] = field(default_factory=lambda: [0] * BINS)
    accepted: list[int] = field(default_factory=lambda: [0] * BINS)
    break_even: float | None = None  # set from the cost model by the caller; None: default_break_even

    @staticmethod
    def _bin(conf: float) -> int:
        return min(BINS - 1, max(0, int(conf * BINS)))

    def observe(self, confidences: list[float], n_accepted: int) -> None:
        """One verified round: the drafted tokens' confidences, and how many the target accepted."""
        for i, c in enumerate(confidences[:n_accepted + 1]):
            b = self._bin(c)
            self.tested[b] += 1
            self.accepted[b] += i < n_accepted

    def rate(self, b: int) -> float | None:
        return self.accepted[b] / self.tested[b] if self.tested[b] >= self.min_samples else None

    def threshold(self) -> float:
        """Stop when confidence < this (0.0: never)."""
        be = self.break_even if self.break_even is not None else self.default_break_even
        t = 0.0
        for b in range(BINS):
            r = self.rate(b)
            if r is None:
                if self.tested[b] == 0:
                    continue  # no token ever had this confidence: it does not end the run
                break
            if r >= be:
                break
            t = (b + 1) / BINS
        return t

    def summary(self) -> dict:
        return {"threshold": self.threshold(), "break_even": round(self.break_even or self.default_break_even, 4),
                "acceptance_by_confidence": [None if r is None else round(r, 3) for r in map(self.rate, range(BINS))],
                "tested": list(self.tested)}
