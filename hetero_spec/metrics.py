"""Per-request statistics, collected by the decode loop from the first round on."""

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    """What one generate call did. Times are wall-clock seconds."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    tested: int = 0  # draft tokens the target judged: accepted, plus the first rejected (tuning/cost_model.Acceptance)
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[n] = rounds that accepted n tokens
    time_prefill_s: float = 0.0
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_total_s: float = 0.0
    time_wait_s: float = 0.0  # two-process: the target waiting for draft tokens
    tree_tokens: int = 0  # tokens verified beside the drafts' chains (token trees: second choices, other branches)
    tree_taken: int = 0  # rounds whose kept tokens left the chain for another branch
    finish_reason: str = ""
    proposer: str = "none"
    gamma: int | str = 0  # the configured gamma, or "auto" (the choices are in extra.gamma_auto)
    extra: dict = field(default_factory=dict)  # gamma choices, the worker's stale proposals and restarts, ...

    def record_round(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.tested += accepted + (1 if accepted < drafted else 0)  # nothing drafted: nothing tested
        self.accept_hist.extend([0] * (accepted + 1 - len(self.accept_hist)))  # grown to reach accepted (or kept)
        self.accept_hist[accepted] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted; None when nothing was drafted (0.0 would read as a draft that never agrees)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_total_s if self.time_total_s > 0 else 0.0

    @property
    def time_idle_s(self) -> float:
        """Time in the loop that was neither prefill, drafting nor verifying (bookkeeping, sampling)."""
        return max(0.0, self.time_total_s - (self.time_prefill_s + self.time_draft_s + self.time_verify_s))

    def to_dict(self) -> dict:
        rate = self.acceptance_rate
        return {**asdict(self), "acceptance_rate": None if rate is None else round(rate, 4),
                "tokens_per_s": round(self.tokens_per_s, 2), "time_idle_s": self.time_idle_s,
                "tokens_per_round": round(self.new_tokens / self.rounds if self.rounds else 0.0, 3)}
