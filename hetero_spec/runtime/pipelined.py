"""Target-side half of the two-process runtime: the worker drafts block n+1 while the target verifies block n
(docs/features-two-process.md). Proposals of stale epochs are dropped and every proposal is checked against what
the target has committed, so output stays token-identical to target-only decoding; a dead or hung worker costs
nothing but speed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..draft.base import Draft
from ..sampling import SamplingParams
from ..transport.protocol import Begin, Control, End, Proposal, Sync, ids_within
from ..tuning.cost_model import Ema
from .supervisor import DraftSupervisor, Worker

IDLE_CHECK_S = 0.05
#: the most a draft probability may be off a distribution (its row's sum) before its proposal is rejected
PROB_SUM_TOL = 1e-3


@dataclass
class LinkCosts:
    """What the worker's proposals say drafting costs (shared by every request of the worker source)."""

    draft_tok_s: Ema = field(default_factory=Ema)
    transfer_s: Ema = field(default_factory=Ema)


@dataclass
class StreamBuffer:
    """The worker's current stream as received: tokens at absolute positions [base, base + len)."""

    epoch: int = -1
    min_epoch: int = 0
    base: int = 0
    tokens: list[int] = field(default_factory=list)
    probs: list[np.ndarray] = field(default_factory=list)
    stale: int = 0
    sampled: bool = False  # then every token must come with its draft distribution
    # a correction dropped the stream, or a new one has started since the target last verified: the worker
    # drafts it afresh while the target waits (DraftLink.gather then waits only for its first token)
    redrafting: bool = False

    def add(self, msg: Proposal, ids: np.ndarray, probs: np.ndarray | None) -> None:
        fresh = msg.epoch > self.epoch
        # stale: a sampled token without its q, a dropped epoch, or a proposal that does not continue the stream: a
        # new epoch starts at its base, and within one the worker sends each position once, in order (a gap: lost)
        if ((self.sampled and (probs is None or len(probs) != len(ids)))
                or msg.epoch < max(self.epoch, self.min_epoch)
                or msg.start != (msg.base if fresh else self.base + len(self.tokens))):
            self.stale += 1
            return
        if fresh:
            self.epoch, self.base, self.tokens, self.probs, self.redrafting = msg.epoch, msg.base, [], [], True
        self.tokens.extend(int(t) for t in ids)
        if probs is not None:
            self.probs.extend(probs)

    def _match(self, ids: list[int]) -> tuple[int, bool]:
        """Compare the stream's tokens with the committed ones they cover: (how many agree, whether all do). A
        mismatch drops the stream; otherwise the covered part (verified, or compared) is dropped."""
        cut = max(0, min(len(ids), self.base + len(self.tokens)) - self.base)
        for j in range(cut):
            if self.tokens[j] != ids[self.base + j]:
                self.min_epoch, self.tokens, self.probs, self.redrafting = self.epoch + 1, [], [], True
                return j, False
        self.tokens, self.probs, self.base = self.tokens[cut:], self.probs[cut:], self.base + cut
        return cut, True

    def shadow(self, ids: list[int]) -> tuple[int, int]:
        """While the target decodes alone: compare the stream with the committed tokens it covers, as a verification
        would have, for free; (tested, accepted) as `Acceptance.observe` counts them (greedy and coupled requests:
        acceptance is token equality). A mismatch drops the stream (the worker rebases on the Sync, one epoch on)."""
        matched, agree = self._match(ids)
        return (matched, matched) if agree else (matched + 1, matched)

    def usable(self, ids: list[int]) -> tuple[list[int], list[np.ndarray]]:
        """Tokens for positions >= len(ids), if the stream agrees with every committed token it covers."""
        if not self._match(ids)[1] or self.base < len(ids):  # (or it has not reached the committed length yet)
            return [], []
        return self.tokens, self.probs


class DraftLink:
    """One request's view of the draft worker: begin, gather proposals, sync, control, end. Every exchange goes
    through `_worker` (which (re)starts the request on a new worker) and `_send` (which treats a failed send as a
    possible death). Whatever state the request is in (speculating, off, mid-Begin, mid-block), a dead worker only
    sets `self.worker` to None: the target decodes alone and picks up the restarted worker at its next look."""

    def __init__(self, sup: DraftSupervisor, req_id: int, params: SamplingParams, gamma: int, max_ahead: int,
                 costs: LinkCosts, routes: dict[int, DraftLink], trace: list | None, vocab_width: int,
                 clock=time.monotonic):
        self.sup, self.req_id, self.params, self.max_ahead = sup, req_id, params, max_ahead
        self.costs, self.routes = costs, routes  # routes: req_id -> link, for every request on the worker
        self.trace = trace  # with runtime.trace: each proposal's drafting interval (t0, t1, start position)
        self.vocab_width, self.clock = vocab_width, clock
        self.worker: Worker | None = None
        self.sampled = not (params.greedy or params.coupled)  # q travels with each token
        self.buf = StreamBuffer(sampled=self.sampled)
        self.synced, self.drafting = 0, True
        self.gamma = gamma  # the worker's block length (gamma: auto changes it between rounds)
        self.shadow = (0, 0)  # draft tokens compared with what the target decoded alone: (tested, accepted)
        self.rejected = 0  # messages of this request refused for bad contents (ids out of range, ...)
        self.dropped = 0   # malformed messages seen by this request's channels
        self._last_idle_check = -IDLE_CHECK_S
        self._dropped_base = 0

    def _leave(self, worker: Worker | None) -> None:
        """Stop using worker; count what its channel dropped while this request used it."""
        if worker is not None and worker is self.worker:
            self.dropped += worker.channel.dropped - self._dropped_base
            self.worker = None
            if self.routes.get(self.req_id) is self:
                del self.routes[self.req_id]

    def _send(self, msg, *arrays) -> bool:
        """Send to the current worker; a failed send on a dead (or reaped) worker drops it."""
        if (worker := self.worker) is None:
            return False
        if worker.channel.send(msg, *arrays):
            return True
        if worker.channel.closed or not self.sup.check(worker):
            self._leave(worker)
        return False

    def _worker(self, ids: list[int]) -> Worker | None:
        worker = self.sup.current()
        if worker is None or worker.channel.closed:
            self._leave(self.worker)
            return None
        if worker is not self.worker:  # first use, or a restarted worker: (re)start the request on it
            self._leave(self.worker)
            self.worker, self._dropped_base = worker, worker.channel.dropped
            self.buf = StreamBuffer(sampled=self.sampled)
            self.routes[self.req_id] = self
            self.synced = len(ids)
            params = self.params
            if not self._send(Begin(req_id=self.req_id, temperature=params.temperature, top_k=params.top_k,
                                    top_p=params.top_p, seed=params.seed, gamma=self.gamma, max_ahead=self.max_ahead,
                                    drafting=self.drafting, coupled=params.coupled), np.asarray(ids, dtype=np.int32)):
                if self.worker is worker:  # alive but not reading: treat it as hung
                    self._leave(worker)
                    self.sup.fail(worker, "not accepting messages")
                return None
        return self.worker

    def begin(self, ids: list[int]) -> None:
        self._worker(ids)

    def _pump(self, worker: Worker, timeout_s: float) -> bool:
        """Receive at most one message (waiting up to timeout_s); False when nothing came. Transfer time is sampled
        only for messages that arrive while we wait: one that sat in the queue while the target was busy verifying
        measures the queueing, not the transfer."""
        if (got := worker.channel.recv(timeout_s)) is None:
            return False
        msg, arrays = got
        self.sup.heard(worker, msg)
        if isinstance(msg, Proposal):
            # another request drafted on this worker (interleaved in this thread) gets its own proposals
            link = self if msg.req_id == self.req_id else self.routes.get(msg.req_id)
            if link is not None and link.worker is worker:
                link._accept(worker, msg, arrays, waited=timeout_s > 0 and link is self)
        return True

    def _accept(self, worker: Worker, msg, arrays: list[np.ndarray], waited: bool) -> None:
        """A Proposal of this request's stream (transfer time sampled only when we waited for it)."""
        if why := self._check_arrays(arrays):
            worker.channel.reject(f"{type(msg).__name__}: {why}")
            self.rejected += 1
            return
        if msg.timed > 0:
            self.costs.draft_tok_s.add(msg.draft_s / msg.timed)
        if waited:
            self.costs.transfer_s.add(max(0.0, self.clock() - msg.sent))
        self.buf.add(msg, arrays[0], arrays[1] if len(arrays) > 1 else None)
        if self.trace is not None:
            self.trace.append((msg.draft_t0, msg.draft_t0 + msg.draft_s, msg.start))

    def _check_arrays(self, arrays: list[np.ndarray]) -> str:
        """Draft token ids must index the target's embedding (on CUDA a bad id is a device assert), and a draft
        distribution q must be one (finite, >= 0, summing to 1): exact rejection sampling divides by it."""
        ids = arrays[0]
        if not ids_within(ids, self.vocab_width):
            return f"token ids outside [0, {self.vocab_width})"
        if len(arrays) > 1:
            q = arrays[1]
            if q.ndim != 2 or q.shape[1] != self.vocab_width:
                return f"distributions of shape {q.shape}, the vocabulary is {self.vocab_width} wide"
            if not np.isfinite(q).all() or (q < 0).any():
                return "distributions with NaN, infinite or negative probabilities"
            if (off := np.abs(q.sum(axis=1, dtype=np.float64) - 1.0).max(initial=0.0)) > PROB_SUM_TOL:
                return f"distributions that do not sum to 1 (off by up to {off:.3g})"
            if len(q) != len(ids):
                return f"{len(q)} distributions for {len(ids)} tokens"
        return ""

    def gather(self, ids: list[int], k: int, budget_s: float) -> Draft:
        """Collect up to k draft tokens for positions len(ids).., waiting at most budget_s for k of them."""
        if k <= 0:
            self._idle_check(ids)
            return Draft(ids=[])
        if (worker := self._worker(ids)) is None:
            return Draft(ids=[])
        while self._pump(worker, 0.0):  # drain what is queued
            pass
        toks, probs = self.buf.usable(ids)
        # after a correction the worker drafts the stream afresh while the target waits: verify as soon as its first
        # token is here (sent alone, at once: Worker.should_flush); the tokens drafted meanwhile make the next block
        want = 1 if self.buf.redrafting else k
        deadline = self.clock() + budget_s * want / k
        while (now := self.clock()) < deadline and len(toks) < want:
            if not self.sup.check(worker):
                self._leave(worker)
                return Draft(ids=[])
            self._pump(worker, min(deadline - now, 0.05))
            toks, probs = self.buf.usable(ids)
        self.buf.redrafting = False
        if not self.sampled:
            return Draft(ids=list(toks[:k]))
        k = min(k, len(toks), len(probs))  # a sampled draft token is usable only with its distribution
        return Draft(ids=list(toks[:k]), probs=np.stack(probs[:k])) if k else Draft(ids=[])

    def _idle_check(self, ids: list[int]) -> None:
        """While not speculating, look at the worker only every IDLE_CHECK_S (keeps the loop cheap):
        drain its messages (probe timings), and notice a death (then restart it)."""
        now = self.clock()
        if now - self._last_idle_check < IDLE_CHECK_S:
            return
        self._last_idle_check = now
        if (worker := self._worker(ids)) is None:
            return
        while self._pump(worker, 0.0):
            pass
        if not self.sampled:  # what a probe drafted, checked against what the target decoded alone
            tested, accepted = self.buf.shadow(ids)
            self.shadow = (self.shadow[0] + tested, self.shadow[1] + accepted)
        if not self.sup.check(worker):
            self._leave(worker)

    def sync(self, ids: list[int]) -> None:
        """2) announce the committed tokens (the correction, when they differ from the draft's stream)."""
        if self.worker is None or not self.drafting or self.synced >= len(ids):
            return
        if self._send(Sync(req_id=self.req_id, pos=self.synced, epoch=self.buf.min_epoch),
                      np.asarray(ids[self.synced:], dtype=np.int32)):
            self.synced = len(ids)

    def control(self, drafting: bool, ids: list[int], gamma: int | None = None) -> None:
        """Drafting on/off and the block length the worker drafts and sends in (gamma: auto)."""
        gamma = self.gamma if gamma is None else max(1, gamma)
        if drafting == self.drafting and gamma == self.gamma:
            return
        self.drafting, self.gamma = drafting, gamma
        if drafting:
            self.sync(ids)
        self._send(Control(req_id=self.req_id, drafting=drafting, gamma=gamma))  # (without a worker: neither sends)

    def end(self) -> None:
        self._send(End(req_id=self.req_id))
        self._leave(self.worker)
