"""The cost gate: speculation pays only while drafting plus transfer costs less than verification.

The pipelined scheduler feeds it measurements (moving averages): the draft's time per token, the
proposal transfer time, and the target's verification time. States:

* ON: the target waits (within a budget) for draft tokens and verifies them.
* OFF: when draft + transfer for a block exceeds what the block is worth (or the draft misses rounds
  entirely), the target decodes alone and the worker is paused. A block is worth `max(1, step_ratio * E)`
  verifications, E being the tokens a speculating round commits (moving average): with the draft
  overlapped, a round costs about max(verify, draft block) and yields E tokens, against E target steps of
  at least step_ratio verifications each. Before any round is seen, E counts as 2 (worth one verification).
* PROBING: every `probe_interval_s` the worker drafts again in the background while the target keeps
  decoding alone (probing costs the target nothing); the first fresh timings decide ON or OFF. For greedy and
  coupled requests the probe also measures acceptance for free: the target compares the worker's tokens with
  the ones it decoded alone (`observe_shadow`), and the probe decides once `probe_tested` of them are compared
  (or at the end of the interval). Without that, an acceptance estimated low early on (a few cold rounds)
  could keep speculation off for good: a probe refreshed only the draft's timings.

With a cost model (`tuning`: the engine's learned verification line and acceptance, tuning/gamma.py), the
decision is by predicted goodput instead: speculation is off when no gamma beats the target alone for the
two-process layout, given this gate's measured draft and transfer costs. One gate serves all of an Engine's
requests (`begin_request` resets only the per-request accounting), so what it measured is not thrown away.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .cost_model import CostModel


class Ema:
    """Exponential moving average; None until the first sample."""

    def __init__(self, alpha: float = 0.3):
        self.alpha, self.value = alpha, None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


@dataclass
class CostGate:
    enabled: bool = True
    probe_interval_s: float = 2.0
    alpha: float = 0.3
    on: bool = True
    draft_tok_s: Ema = field(default_factory=Ema)
    transfer_s: Ema = field(default_factory=Ema)
    verify_s: Ema = field(default_factory=Ema)
    switches: list[dict] = field(default_factory=list)
    time_on_s: float = 0.0
    time_off_s: float = 0.0
    _since: float = 0.0
    _off_at: float = 0.0
    probing: bool = False
    _probe_t0: float = 0.0
    _probe_samples0: int = 0
    misses: int = 0
    n_draft_samples: int = 0
    min_samples: int = 3
    max_misses: int = 2
    tokens_per_round: Ema = field(default_factory=Ema)
    n_rounds: int = 0
    min_rounds: int = 16
    """Speculating rounds seen (by this gate, across requests) before the cost model may turn speculation off:
    the first rounds measure a cold draft (one round once turned a whole demo request off), and the verify line
    fitted to a few rounds is rough (after 4 rounds of the int8 pair: 1.71 + 0.78 ms a token, against about
    2.7 + 0.85 later, which made the target alone look faster than it is and turned a request off)."""
    step_ratio: float = 0.5
    """Lower bound of one target step over a verification of a block (a verify of gamma + 1 tokens costs
    more than one step, but on bandwidth-bound hardware less than twice as much)."""
    probe_tested: int = 8
    """Draft tokens a probe compares with the target's own (shadow acceptance) before it decides, when the
    request allows the comparison (`begin_request(shadow=True)`)."""
    shadow_tested: int = 0
    expect_shadow: bool = False
    _probe_shadow0: int = 0
    clock: Callable[[], float] = time.monotonic  # a seam for tests
    tuning: Any = None  # tuning.gamma.Tuning: the goodput decision (None: the cost rule above)

    def __post_init__(self) -> None:
        self._since = self.clock()

    def begin_request(self, shadow: bool = False) -> None:
        """A new request: fresh accounting (on/off time, switches, misses); measurements and state are kept.
        shadow: its acceptance is token equality (greedy, coupled), so probes measure it (observe_shadow)."""
        self.expect_shadow = shadow
        self.time_on_s = self.time_off_s = 0.0
        self.switches = []
        self.misses = 0
        self._since = self.clock()

    def pays(self) -> bool | None:
        """Whether some gamma beats the target alone per the cost model (None: not enough measurements)."""
        base = self.tuning.model() if self.tuning is not None else None
        d = self.draft_tok_s.value
        if base is None or d is None:
            return None
        model = CostModel(base.verify_fixed_s, base.verify_per_token_s, d, self.transfer_s.value or 0.0)
        return model.best_gamma(self.tuning.global_acceptance(), "two_process")[0] > 0

    def _model_note(self) -> str:
        """What the cost model decided from, for a switch's reason."""
        base = self.tuning.model() if self.tuning is not None else None
        if base is None or self.draft_tok_s.value is None:
            return ""
        return (f" (acceptance {self.tuning.global_acceptance():.2f}, draft {self.draft_tok_s.value * 1e3:.2f} "
                f"ms/token, verify {base.verify_fixed_s * 1e3:.2f} + {base.verify_per_token_s * 1e3:.2f} "
                f"ms/token)")

    def observe_proposal(self, draft_s: float, n_tokens: int, transfer_s: float | None) -> None:
        if n_tokens > 0:
            self.draft_tok_s.add(draft_s / n_tokens)
            self.n_draft_samples += 1
        if transfer_s is not None:
            self.transfer_s.add(max(0.0, transfer_s))

    def observe_shadow(self, tested: int, accepted: int) -> None:
        """Draft tokens compared with the tokens the target decoded alone (tested as `Acceptance.observe`
        counts them: up to and including the first mismatch): they join the engine's acceptance estimate."""
        if tested > 0:
            self.shadow_tested += tested
            if self.tuning is not None:
                self.tuning.acceptance.observe(tested, accepted)

    def observe_verify(self, seconds: float) -> None:
        self.verify_s.add(seconds)

    def observe_round(self, drafted: int, accepted: int) -> None:
        """A verified round: the tokens it committed (accepted drafts + the target's own) when it speculated."""
        if drafted > 0:
            self.tokens_per_round.add(accepted + 1)
            self.n_rounds += 1

    def worth(self) -> float:
        """How many verifications a block of drafts is worth (see the module docstring)."""
        e = self.tokens_per_round.value
        return 1.0 if e is None else max(1.0, self.step_ratio * e)

    def observe_wait(self, got_tokens: int) -> None:
        """A round that waited its whole budget and got no draft token is a miss: evidence that the
        draft is slower than verification before its timings arrive. Once `min_samples` timings have come,
        the timings decide (the cost model, or the cost rule) and a miss counts for nothing: on a busy
        machine a short budget (one token after a correction: about 2.5 ms) runs out now and then, and two
        in a row used to turn speculation off for a whole request (seen in 3 of 6 runs of 8 requests)."""
        if got_tokens or self.n_draft_samples >= self.min_samples:
            self.misses = 0
        else:
            self.misses += 1

    def block_cost(self, gamma: int) -> float | None:
        """Predicted draft + transfer time of one block of gamma tokens (None before any sample)."""
        if self.draft_tok_s.value is None:
            return None
        return gamma * self.draft_tok_s.value + (self.transfer_s.value or 0.0)

    def wait_budget(self, k: int, default: float) -> float:
        """How long the target may wait for k draft tokens: what drafting them costs, never more than
        one verification (waiting longer than a target step would be slower than decoding alone).
        Before any draft timing has arrived: half a verification, so that a draft too slow to report
        costs at most `max_misses` half-steps before the gate turns speculation off."""
        cap = self.verify_s.value if self.verify_s.value is not None else default
        cost = self.block_cost(k)
        return min(cap, cost * 1.5 + 0.0005) if cost is not None else 0.5 * cap

    def _switch(self, on: bool, reason: str) -> None:
        now = self.clock()
        self._account(now)
        self.on = on
        self.switches.append({"t": round(now, 4), "on": on, "reason": reason})
        self.misses = 0
        if not on:
            self._off_at = now

    def _account(self, now: float) -> None:
        if self.on:
            self.time_on_s += now - self._since
        else:
            self.time_off_s += now - self._since
        self._since = now

    @property
    def drafting(self) -> bool:
        """Whether the worker should draft (ON, or PROBING in the background)."""
        return self.on or self.probing

    def decide(self, gamma: int) -> bool:
        """Update the state after a round; returns whether the next round speculates (waits for drafts)."""
        if not self.enabled:
            return True
        now = self.clock()
        self._account(now)
        cost, verify = self.block_cost(gamma), self.verify_s.value
        worth = self.worth()
        pays = self.pays()
        if pays is not None:
            too_slow = not pays
        else:
            too_slow = cost is not None and verify is not None and cost > worth * verify
        if self.on:
            if too_slow and self.n_draft_samples >= self.min_samples and self.n_rounds >= self.min_rounds:
                self._switch(False, "cost model: no gamma beats the target alone" + self._model_note()
                             if pays is not None else
                             f"draft+transfer {cost * 1e3:.2f} ms > {worth:.2f} x verify "
                             f"{verify * 1e3:.2f} ms for gamma={gamma}")
            elif self.misses >= self.max_misses:
                self._switch(False, f"no draft tokens within the wait budget for {self.misses} rounds")
        elif self.probing:
            fresh = self.n_draft_samples > self._probe_samples0
            compared = not self.expect_shadow or self.shadow_tested - self._probe_shadow0 >= self.probe_tested
            if fresh and (compared or now - self._probe_t0 >= self.probe_interval_s):
                self.probing = False
                if too_slow:
                    self._off_at = now
                else:
                    self._switch(True, "probe: the cost model says speculation pays" + self._model_note()
                                 if pays is not None else
                                 f"probe: draft+transfer {cost * 1e3:.2f} ms <= {worth:.2f} x verify "
                                 f"{verify * 1e3:.2f} ms for gamma={gamma}")
            elif now - self._probe_t0 >= self.probe_interval_s:
                self.probing = False
                self._off_at = now
        elif now - self._off_at >= self.probe_interval_s:
            self.probing = True
            self._probe_t0 = now
            self._probe_samples0 = self.n_draft_samples
            self._probe_shadow0 = self.shadow_tested
            self.draft_tok_s = Ema(self.alpha)  # measure afresh: the draft may be fast again
        return self.on

    def summary(self) -> dict:
        ms = lambda e: None if e.value is None else round(e.value * 1e3, 3)  # noqa: E731
        self._account(self.clock())
        return {"on": self.on, "probing": self.probing, "time_spec_on_s": round(self.time_on_s, 4),
                "time_spec_off_s": round(self.time_off_s, 4), "switches": self.switches[-20:],
                "n_switches": len(self.switches), "draft_ms_per_token": ms(self.draft_tok_s),
                "transfer_ms": ms(self.transfer_s), "verify_ms": ms(self.verify_s),
                "tokens_per_round": None if self.tokens_per_round.value is None else round(self.tokens_per_round.value, 3),
                "block_worth_verifies": round(self.worth(), 3)}
