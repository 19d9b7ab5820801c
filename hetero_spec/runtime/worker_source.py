"""The worker draft source (draft/base.py's interface): the draft model runs in its own process and drafts each
sequence's next block while the target verifies the current one (runtime/pipelined.py has the protocol). It owns
the supervisor, one DraftLink per sequence, and the routing of the worker's messages to them (requests drafted
together share one channel). A dead worker only empties the drafts: the target decodes alone meanwhile."""

import os
import time
from typing import Any

from ..config import Config
from ..draft.base import Draft, DraftCosts, Seq
from ..draft.select import prompt_window
from ..tuning.controller import RowPlan
from .cpus import allowed, draft_cpus, pin_threads
from .pipelined import DraftLink, LinkCosts
from .supervisor import DraftSupervisor, WorkerSpec

#: streams the worker keeps beyond serving.max_batch (ended requests whose End is still on the way)
STREAM_SLACK = 8


class WorkerSource:
    """`launcher` and `clock` are seams for tests (an in-memory worker, a ticking clock)."""

    name = "onnx-pipelined"
    drafts_ahead = True
    drafts_together = True  # the worker steps its streams together

    def __init__(self, config: Config, vocab_width: int, context_len: int = 1 << 16, max_streams: int = 8,
                 launcher=None, clock=time.monotonic):
        runtime, draft = config.runtime, config.draft
        self.config, self.clock, self.vocab_width, self.trace = config, clock, vocab_width, runtime.trace
        worker_cpus = draft_cpus(config)
        self.target_cpus = [c for c in allowed() if c not in worker_cpus] if worker_cpus else None
        # the largest frame either side may send: a prompt of context_len ids, or the distributions of up to
        # max_ahead draft tokens (sampled requests; by default 129: two blocks of at most 64, and one), and the header
        spec = WorkerSpec(runtime, draft, vocab_width, cpus=worker_cpus,
                          max_msg_bytes=max(4 * context_len, 4 * vocab_width * (runtime.max_ahead or 129)) + (1 << 16),
                          max_streams=max_streams + STREAM_SLACK,
                          prompt_window=prompt_window(draft.prompt_window, draft.candidates, "two_process"))
        self.sup = DraftSupervisor(spec, launcher=launcher, clock=clock)
        if worker_cpus and hasattr(os, "sched_setaffinity"):
            pin_threads(self.sup.thread_ids, worker_cpus)
        self.link_costs = LinkCosts()
        self.links: dict[int, DraftLink] = {}  # by sequence
        self.routes: dict[int, DraftLink] = {}  # by req_id, the links drafted on the current worker
        self._counts: dict[int, tuple[int, int]] = {}  # supervisor failures and restarts when a sequence began
        self.sup.start()

    def begin(self, seq: Seq, ahead: int, most: int) -> None:
        """The worker starts drafting block 1 (`ahead` tokens) while the target reads the prompt; it keeps at most
        runtime.max_ahead drafts (default: two of the longest blocks the plan may ask, `most`, and one)."""
        gamma = max(1, ahead)
        max_ahead = self.config.runtime.max_ahead or 2 * max(gamma, most) + 1
        trace = [] if self.trace else None
        self.links[seq.id] = link = DraftLink(self.sup, seq.id, seq.params, gamma, max_ahead, self.link_costs,
                                              self.routes, trace, self.vocab_width, clock=self.clock)
        self._counts[seq.id] = (self.sup.failures, self.sup.restarts)
        link.begin(seq.ids)

    def offers(self, seqs: list[Seq], caps: list[int]) -> None:
        return None  # one kind: nothing to choose among

    def propose(self, seqs: list[Seq], rows: list[RowPlan], budget_s: float) -> list[Draft]:
        """Each row's draft; the worker drafts ahead at each row's `ahead` (0: it rests); the whole round waits for
        drafts at most budget_s (one deadline, not one a row)."""
        out, deadline = [], self.clock() + budget_s
        for seq, row in zip(seqs, rows):
            link = self.links[seq.id]
            link.control(row.ahead > 0, seq.ids, row.ahead or None)
            out.append(link.gather(seq.ids, row.k, max(0.0, deadline - self.clock())))
            if link.shadow[0]:
                out[-1].shadow, link.shadow = link.shadow, (0, 0)
        return out

    def commit(self, seq: Seq, n_accepted: int, next_token: int) -> None:
        self.links[seq.id].sync(seq.ids)  # the correction (or confirmation) goes out before anything else

    def end(self, seq: Seq) -> dict[str, Any]:
        link = self.links.pop(seq.id, None)
        if link is None:
            return {}
        link.end()
        failures0, restarts0 = self._counts.pop(seq.id)
        out: dict[str, Any] = {"stale_proposals": link.buf.stale, "draft_failures": self.sup.failures - failures0,
                               "draft_restarts": self.sup.restarts - restarts0,
                               "dropped_messages": link.dropped, "rejected_messages": link.rejected}
        if link.trace is not None:
            out["timeline"] = {"draft": link.trace}
        if fallback := self.sup.status().get("draft_fallback"):
            out["draft_fallback"] = fallback
        return out

    def costs(self) -> DraftCosts:
        return DraftCosts(self.link_costs.draft_tok_s.value, self.link_costs.transfer_s.value)

    def health(self, probe: bool, timeout_s: float | None = None) -> dict[str, Any]:
        return self.sup.health(timeout_s or self.sup.spec.runtime.heartbeat_s) if probe else self.sup.status()

    def close(self) -> None:
        self.sup.close()
