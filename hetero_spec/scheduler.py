"""The decode loop: propose, verify, commit, stop checks, adapt. One linear loop per request.

Invariants between rounds (see target/verifier.py):
* ``ids`` = prompt + generated tokens; the target cache holds ``ids[:-1]``;
* the proposer has been told every committed token (through ``begin`` and ``commit``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .draft.base import Draft, Proposer
from .errors import PromptTooLongError, RequestError
from .metrics import Stats
from .sampling import (STREAM_ACCEPT, STREAM_TARGET, SamplingParams, exponential_noise, logits_to_probs,
                       position_uniforms, rejection_accept, rejection_next, verify_coupled, verify_greedy)
from .tuning.gamma import PROBE_WINDOW, GammaPolicy, Tuning

if TYPE_CHECKING:  # the onnx target backend never imports torch
    from .target.base import Verifier


@dataclass
class Request:
    """One generation request, resolved: token ids and every knob explicit."""

    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    gamma: int | str  # an int, or "auto" (tuning/gamma.py)
    stop_ids: frozenset[int] = field(default_factory=frozenset)


def check_request(req: Request, context_len: int) -> None:
    if not req.prompt_ids:
        raise RequestError("the prompt is empty: give at least one token")
    if req.max_new_tokens < 1:
        raise RequestError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
    if len(req.prompt_ids) >= context_len:
        raise PromptTooLongError(
            f"the prompt has {len(req.prompt_ids)} tokens but the context holds {context_len} "
            f"(target.max_context or the model's max_position_embeddings), leaving no room for a new token")


def verify_block(target: Verifier, state: Any, params: SamplingParams, ids: list[int],
                 draft: Draft) -> tuple[int, int]:
    """3) verify one block in one target forward pass; returns (n_accepted, next_token)."""
    out = target.verify(state, ids[-1], draft.ids, params.greedy)
    return decide_block(target, state, params, ids, draft, out)


def decide_block(target: Verifier, state: Any, params: SamplingParams, ids: list[int], draft: Draft,
                 out: Any) -> tuple[int, int]:
    """3b) accept from the target's output for [ids[-1], *draft.ids] (argmax ids, or logits [k + 1, vocab]) and roll
    the target's cache back to what was accepted; returns (n_accepted, next_token).

    Uniform draws and noise are keyed by the absolute position of the token they decide, so seeded output
    does not depend on where round boundaries fall, nor on which requests shared the pass.
    Coupled sampling ignores draft.probs (None is fine).
    """
    base = len(ids)
    if params.greedy:
        n, nxt = verify_greedy(draft.ids, out)
    elif params.coupled:
        p = logits_to_probs(out, params)  # [k + 1, vocab]
        n, nxt = verify_coupled(draft.ids, p, lambda i: exponential_noise(params.seed, base + i, p.shape[1]))
    else:
        p = logits_to_probs(out, params)  # [k + 1, vocab]
        u_acc = np.array([position_uniforms(params.seed, base + i, STREAM_ACCEPT)[0]
                          for i in range(len(draft.ids))])
        n = rejection_accept(draft.ids, draft.probs, p, u_acc)
        u_tok = position_uniforms(params.seed, base + n, STREAM_TARGET)[0]
        nxt = rejection_next(draft.ids, draft.probs, p, n, u_tok)
    target.rollback(state, len(ids) + n)
    return n, nxt


def commit_tokens(ids: list[int], tokens: list[int], req: Request, generated: int, context_len: int,
                  stats: Stats) -> tuple[list[int], int]:
    """Append a round's tokens one by one, stopping at a stop token, max_new_tokens or the context limit.
    Returns (emitted tokens, new generated count); sets stats.finish_reason when generation ends."""
    emitted: list[int] = []
    for tok in tokens:
        emitted.append(tok)
        ids.append(tok)
        generated += 1
        if tok in req.stop_ids:
            stats.finish_reason = "stop"
        elif generated >= req.max_new_tokens:
            stats.finish_reason = "length"
        elif len(ids) >= context_len:
            stats.finish_reason = "context"
        if stats.finish_reason:
            break
    return emitted, generated


def _break_even(tuning: Tuning, policy: GammaPolicy, g: int) -> float | None:
    """P(accept) a drafted token needs to pay for itself: (draft + verify per token) x goodput (None: no model)."""
    model = tuning.model()
    if model is None:
        return None
    a = policy.estimate()
    return (model.draft_token_s + model.verify_per_token_s) * model.goodput(g, a, "in_process")


def _draft_token_s(proposer: Proposer | None, draft_s: float, k: int) -> float | None:
    """The draft's time per token this round, without feeding it the prompt or the committed backlog (the
    first step of such a round both catches up and drafts a token: it is left out with its token)."""
    catchup = getattr(proposer, "last_catchup_s", 0.0) if proposer is not None else 0.0
    if k <= 0 or (catchup and k == 1):
        return None
    return (draft_s - catchup) / (k - 1) if catchup else draft_s / k


class Row:
    """One request in the decode loop: its target state, proposer, committed ids, gamma policy and stats.

    `decode` runs one Row alone; the request scheduler (batch.py) runs many, verifying their blocks together.
    A round is: k = plan(); draft = propose(k); the target verifies [ids[-1], *draft.ids] (alone or in a batch);
    finish(draft, out, verify_s) commits and returns the round's tokens. `done` once a finish reason is set.
    """

    def __init__(self, target: Verifier, proposer: Proposer | None, req: Request, stats: Stats,
                 tuning: Tuning | None = None, early_stop: bool = False):
        check_request(req, target.context_len)
        self.t_start = time.perf_counter()
        self.target, self.proposer, self.req, self.stats = target, proposer, req, stats
        self.tuning = tuning = tuning or Tuning()
        self.policy = GammaPolicy(tuning, "in_process", fixed=req.gamma if isinstance(req.gamma, int) else None)
        self.stop = tuning.early_stop if early_stop and hasattr(proposer, "_confidence") else None
        self.stopped_early = 0
        stats.prompt_tokens, stats.gamma = len(req.prompt_ids), req.gamma
        stats.proposer = proposer.name if proposer is not None else "none"
        self.state: Any = None
        self.ids = list(req.prompt_ids)
        self.generated = 0

    @property
    def done(self) -> bool:
        return bool(self.stats.finish_reason)

    def start(self) -> None:
        """Prefill the target and start the proposer on the prompt."""
        self.state = self.target.new_state()
        self.target.prefill(self.state, self.req.prompt_ids)
        if self.proposer is not None:
            self.proposer.begin(self.req.prompt_ids, self.req.params)
        self.stats.time_prefill_s = time.perf_counter() - self.t_start

    def plan(self) -> int:
        """0) this round's gamma (before the room left: max_new_tokens, the context)."""
        policy = self.policy
        remaining = min(self.req.max_new_tokens - self.generated, self.target.context_len - len(self.ids))
        if self.proposer is None:
            return 0
        if getattr(self.proposer, "chooses_gamma", False) and policy.fixed is None:
            return min(policy.g_max, remaining - 1)  # draft selection picks each strategy's own gamma
        return min(policy.choose(), remaining - 1)

    def arm_probe_window(self) -> None:
        """A re-probe after rounds at gamma 0: the draft feeds at most PROBE_WINDOW of the tokens committed while
        it rested (OnnxDrafter.catchup_window), so that a useless draft's probes stay cheap."""
        if self.policy.probing and hasattr(self.proposer, "catchup_window"):
            armed = self.proposer.catchup_window  # a prompt window not yet used (draft.prompt_window) stays
            self.proposer.catchup_window = PROBE_WINDOW if armed is None else min(armed, PROBE_WINDOW)

    def propose(self, k: int) -> Draft:
        """1) propose (2) send is a no-op in process)."""
        self.arm_probe_window()
        t = time.perf_counter()
        if k <= 0:
            draft = Draft(ids=[])
        elif self.stop is not None:
            self.stop.break_even = _break_even(self.tuning, self.policy, k)
            draft = self.proposer.propose(k, min_confidence=self.stop.threshold())
            self.stopped_early += draft.stopped_early
        else:
            draft = self.proposer.propose(k)
        self.drafted(time.perf_counter() - t)
        return draft

    def drafted(self, seconds: float) -> None:
        """The time this round's draft took (its share, when several rows drafted together)."""
        self._draft_s = seconds
        self.stats.time_draft_s += seconds

    def finish(self, draft: Draft, out: Any, verify_s: float | None) -> list[int]:
        """3b) accept, 4) commit + stop checks, token by token inside the block, 5) adapt. verify_s: the pass's
        time when it verified this row alone (None in a shared pass: it is not this row's verify cost)."""
        stats, req = self.stats, self.req
        n, nxt = decide_block(self.target, self.state, req.params, self.ids, draft, out)
        stats.record_round(len(draft.ids), n)
        self.policy.observe(len(draft.ids), n, verify_s,
                            _draft_token_s(self.proposer, self._draft_s, len(draft.ids)))
        if self.stop is not None and draft.conf:
            self.stop.observe(draft.conf, n)
        emitted, self.generated = commit_tokens(self.ids, [*draft.ids[:n], nxt], req, self.generated,
                                                self.target.context_len, stats)
        if not stats.finish_reason and self.proposer is not None:
            self.proposer.commit(n, nxt)
        stats.new_tokens = self.generated
        stats.time_total_s = time.perf_counter() - self.t_start
        return emitted

    def close(self) -> None:
        """Summaries into stats; free the target state (a batched buffer's slot)."""
        stats = self.stats
        stats.time_total_s = time.perf_counter() - self.t_start
        if self.policy.fixed is None:
            stats.extra["gamma_auto"] = self.policy.summary()
        if self.stop is not None:
            stats.extra["early_stop"] = {**self.stop.summary(), "rounds_stopped_early": self.stopped_early}
        if hasattr(self.proposer, "summary"):  # draft selection: per-strategy acceptance and cost
            stats.extra["draft_selection"] = self.proposer.summary()
        if self.state is not None:
            release = getattr(self.target, "release_state", None)
            if release is not None:
                release(self.state)
            self.state = None


def decode(target: Verifier, proposer: Proposer | None, req: Request, stats: Stats,
           tuning: Tuning | None = None, early_stop: bool = False) -> Iterator[list[int]]:
    """Generate tokens for one request; yields each round's committed tokens. Fills stats as it goes.
    tuning: what the engine learns across requests (gamma: auto, early stop); None: a fresh one.
    early_stop: end blocks at low draft confidence (proposers that report it: the onnx drafter)."""
    row = Row(target, proposer, req, stats, tuning, early_stop)
    try:
        row.start()
        while not row.done:
            k = row.plan()
            draft = row.propose(k)
            # 3) verify
            t = time.perf_counter()
            out = target.verify(row.state, row.ids[-1], draft.ids, req.params.greedy)
            verify_s = time.perf_counter() - t
            stats.time_verify_s += verify_s
            yield row.finish(draft, out, verify_s)
    finally:
        row.close()
