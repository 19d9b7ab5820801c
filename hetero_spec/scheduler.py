"""The decode loop and the request queue in front of it: one loop thread decodes up to `serving.max_batch`
sequences together, joining and leaving between rounds; a round's five phases (plan, propose, verify, accept,
observe) are in docs/architecture.md#the-decode-loop. One sequence's failure is its own: the others go on.

Invariants between rounds: `seq.ids` = prompt + generated tokens; the target's state caches `ids[:-1]`; the draft
source has seen every committed token (it reads them from seq.ids). Callers never touch the models: they submit
a Ticket and read its sink (token-id lists, then DONE or the exception that ended the request).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .draft.base import Draft
from .errors import EngineClosedError, PromptTooLongError, QueueFullError, RequestError
from .metrics import Stats
from .runtime.cpus import pinned_thread
from .sampling import (STREAM_ACCEPT, STREAM_TARGET, SamplingParams, coupled_choice, coupled_weights,
                       exponential_noise, logits_to_probs, position_uniforms, rejection_accept, rejection_next,
                       verify_coupled, verify_greedy)
from .tuning.controller import RowPlan, StreamControl

if TYPE_CHECKING:
    from .config import Config
    from .draft.base import DraftSource
    from .target.base import Verifier
    from .tuning.controller import Controller

log = logging.getLogger("hetero_spec.scheduler")
#: the target alone, one greedy request: a round runs steps for about this long, at most PLAIN_STEPS_MAX of them
PLAIN_RUN_S, PLAIN_STEPS_MAX = 0.01, 8
#: a token tree's pass takes at most this many tokens (its branches are cut to fit): hetero_spec's 4-bit kernel
#: multiplies up to 8 rows per sweep of the weights, so 8 tokens cost about one step and 9 about two
TREE_MAX_TOKENS = 8


class Engine(Protocol):
    """What the loop needs of the Engine that owns it (engine.Engine)."""

    config: Config
    target: Verifier
    source: DraftSource | None
    controller: Controller
    lock: threading.Lock  # held for each round: health probes the models only when it can take it
    loop_cpus: list[int] | None  # the loop thread's cores (two_process: the target's)
    closed: bool

    def heartbeat(self) -> None: ...
    def request_done(self, stats: Stats, batched: bool) -> None: ...
    def between_requests(self) -> None: ...
    def release(self) -> None: ...


DONE = object()  # the last item of a ticket's sink when the request ended normally (stats.finish_reason says how)


@dataclass
class Request:
    """One generation request, resolved: token ids and every knob explicit."""

    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    gamma: int | str  # an int, or "auto" (tuning/controller.py)
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


def decide_block(target: Verifier, state: Any, params: SamplingParams, ids: list[int], draft: Draft,
                 out: Any) -> tuple[int, int]:
    """4) accept from the target's output for [ids[-1], *draft.ids] (argmax ids, or logits [k + 1, vocab]) and roll
    the target's cache back to what was accepted; returns (n_accepted, next_token). Uniform draws and noise are keyed
    by the absolute position of the token they decide, so seeded output does not depend on where round boundaries
    fall, nor on which requests shared the pass. Coupled sampling ignores draft.probs (None is fine)."""
    base = len(ids)
    if draft.alts:
        return _decide_tree(target, state, params, base, draft, out)
    if params.greedy:
        accepted, next_token = verify_greedy(draft.ids, out)
    elif params.coupled:  # a position's weights only where it is reached
        if out.shape[0] != len(draft.ids) + 1:
            raise ValueError(f"logits must be [k+1={len(draft.ids) + 1}, vocab], got shape {out.shape}")
        accepted, next_token = verify_coupled(draft.ids, lambda i: coupled_weights(out[i], params),
                                              lambda i: exponential_noise(params.seed, base + i, out.shape[1]))
    else:
        p = logits_to_probs(out, params)  # [k + 1, vocab]
        u_acc = np.array([position_uniforms(params.seed, base + i, STREAM_ACCEPT)[0] for i in range(len(draft.ids))])
        accepted = rejection_accept(draft.ids, draft.probs, p, u_acc)
        next_token = rejection_next(draft.ids, draft.probs, p, accepted,
                                    position_uniforms(params.seed, base + accepted, STREAM_TARGET)[0])
    target.rollback(state, base + accepted)
    return accepted, next_token


def _decide_tree(target: Verifier, state: Any, params: SamplingParams, base: int, draft: Draft,
                 out: Any) -> tuple[int, int]:
    """decide_block for a token tree (greedy or coupled): `out` holds the nodes [ids[-1], *draft.ids, *alt tokens]
    (argmax ids, or logits). From the root, the target's token after the current node (at absolute position
    base + depth, as target-only decoding picks it) is looked for among the node's children, the chain's first; a
    child that has it becomes the current node. The block ends with the target's token after the last node kept;
    where the path left the chain, its nodes' cached positions move into place (draft.path, draft.chain_kept)."""
    k = len(draft.ids)
    children: dict[int, dict[int, int]] = {n: {draft.ids[n]: n + 1} for n in range(k)}  # node -> token -> child
    for a, (parent, token) in enumerate(draft.alts):
        children.setdefault(parent, {}).setdefault(token, k + 1 + a)

    def choice(node: int, position: int) -> int:
        if params.greedy:
            return int(out[node])
        return coupled_choice(coupled_weights(out[node], params), exponential_noise(params.seed, position,
                                                                                    out.shape[1]))

    node, path = 0, []
    while (child := children.get(node, {}).get(y := choice(node, base + len(path)))) is not None:
        node = child
        path.append(node)
    chain = next((d for d, n in enumerate(path) if n != d + 1), len(path))
    if chain < len(path):  # node i was cached at base - 1 + i; the path's d-th token belongs at base + d
        for depth in range(chain, len(path)):
            target.move(state, base - 1 + path[depth], base + depth)
        draft.path = [draft.ids[n - 1] if n <= k else draft.alts[n - k - 1][1] for n in path]
        draft.chain_kept = chain
    target.rollback(state, base + len(path))
    return len(path), y


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


def is_last(item: Any) -> bool:
    """A sink item that ends its request: DONE (True), or the exception that ended it (raised here)."""
    if isinstance(item, BaseException):
        raise item
    return item is DONE


@dataclass
class Ticket:
    """One submitted request: what it asks, where its stats and tokens go, and how to cancel it."""

    req: Request
    stats: Stats
    sink: Callable[[Any], None]  # receives token-id lists, then DONE or an exception
    cancel: threading.Event = field(default_factory=threading.Event)

    def put(self, item: Any) -> None:
        try:
            self.sink(item)
        except Exception:  # noqa: BLE001 - the caller's sink is broken or gone: nobody reads this request any more
            log.debug("a request's sink raised; the request is cancelled", exc_info=True)
            self.cancel.set()


class Seq:
    """One running request in the loop: its target state, committed ids and the controller's part of it (the draft
    source reads only the request's tokens: draft/base.Seq)."""

    def __init__(self, seq_id: int, ticket: Ticket, control: StreamControl):
        req = ticket.req
        self.id, self.ticket, self.req, self.stats, self.control = seq_id, ticket, req, ticket.stats, control
        self.params, self.prompt_ids, self.ids = req.params, req.prompt_ids, list(req.prompt_ids)
        self.state: Any = None
        self.generated = 0
        self.t_start = time.perf_counter()
        self.batched_rounds, self.largest_batch = 0, 1
        self.trace: list[tuple[float, float, int, int]] = []
        self.prefilled, self.prefill_done = 0, False  # prompt tokens cached so far; all of them (it decodes)

    def room(self, context_len: int) -> int:
        """Tokens this sequence may still commit (max_new_tokens, the context)."""
        return min(self.req.max_new_tokens - self.generated, context_len - len(self.ids))


class Scheduler:
    """Owns the loop thread; holds the Engine weakly, so a dropped Engine is collected (its finalizer ends the loop)."""

    def __init__(self, engine: Engine):
        self._engine = weakref.ref(engine)
        self._cv = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._seqs: list[Seq] = []
        self._ids = itertools.count(1)
        self._stopping = False
        self._idle = threading.Event()
        self.batch_sizes: deque[int] = deque(maxlen=4096)  # rounds' batch sizes, drained by the server's metrics
        self.plain_steps_max = PLAIN_STEPS_MAX  # _plain_run's bound (tests set it)
        self._plain_step_s = 0.0  # the last plain run's seconds a step
        self._thread = threading.Thread(target=self._run, name="hetero-spec-scheduler", daemon=True)
        self._thread.start()

    # -- callers' side ---------------------------------------------------------------------------------
    def submit(self, ticket: Ticket, max_batch: int, max_waiting: int) -> None:
        with self._cv:
            if self._stopping:
                raise EngineClosedError("this Engine is closed; create a new one (Engine.from_config)")
            if len(self._waiting) + len(self._seqs) >= max_batch + max_waiting:
                raise QueueFullError(f"the server is full: {len(self._seqs)} requests decoding (serving.max_batch = "
                                     f"{max_batch}) and {len(self._waiting)} waiting for a place (serving.max_waiting "
                                     f"= {max_waiting}); try again later")
            self._waiting.append(ticket)
            self._idle.clear()
            self._cv.notify()

    @property
    def running(self) -> int:
        return len(self._seqs)  # decoding or prefilling

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no request runs or waits and the Engine's between-requests work (a re-placement) is done."""
        return self._idle.wait(timeout_s)

    @property
    def alive(self) -> bool:
        """The loop thread runs (a caller waiting on its request's queue checks this instead of blocking forever)."""
        return self._thread.is_alive()

    def stop(self, wait_s: float = 0.0) -> bool:
        """No new requests; waiting ones fail (EngineClosedError), running ones finish; True if it ended in wait_s."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if threading.current_thread() is self._thread:
            return False
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    # -- the loop --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._waiting or self._seqs or self._stopping):
                    self._idle.set()
                    self._cv.wait()
                if self._stopping:
                    while self._waiting:
                        self._waiting.popleft().put(EngineClosedError("this Engine was closed before the "
                                                                      "request started"))
                    if not self._seqs:
                        break
            engine = self._engine()
            if engine is None:  # collected: its finalizer released the models
                self._fail_all(EngineClosedError("the Engine was garbage-collected"))
                return
            try:
                self._round(engine)
            except BaseException as exc:  # noqa: BLE001 - every running request hears of it; the loop goes on
                log.exception("scheduler: a round failed")
                self._fail_all(exc)
            if not self._seqs and not self._waiting:
                engine.between_requests()  # after the finished callers heard DONE: off their path
            del engine
        self._idle.set()
        engine = self._engine()
        if engine is not None and engine.closed:  # close() did not wait for the last requests: release now
            engine.release()

    def _round(self, eng: Engine) -> None:
        with eng.lock, pinned_thread(eng.loop_cpus):
            eng.heartbeat()
            self._admit(eng)
            for seq in [s for s in self._seqs if s.ticket.cancel.is_set()]:
                seq.stats.finish_reason = seq.stats.finish_reason or "cancelled"
                self._end(eng, seq)
            self._prefill(eng)
            if any(s.prefill_done for s in self._seqs):
                self._step(eng)

    def _next_waiting(self) -> Ticket | None:
        """The first waiting request that is still wanted (one cancelled while it waited ends here)."""
        while True:
            with self._cv:
                if not self._waiting:
                    return None
                ticket = self._waiting.popleft()
            if not ticket.cancel.is_set():
                return ticket
            ticket.stats.finish_reason = "cancelled"
            ticket.put(DONE)

    def _admit(self, eng: Engine) -> None:
        """Waiting requests join while there is room (serving.max_batch, and serving.mode latency's limit):
        the source begins (a worker reads the prompt meanwhile); the target reads the prompt in _prefill."""
        if not self._waiting:  # read without the lock: one that arrives now joins next round
            return
        while len(self._seqs) < eng.config.serving.max_batch and eng.controller.may_join(len(self._seqs)):
            ticket = self._next_waiting()
            if ticket is None:
                return
            req, stats = ticket.req, ticket.stats
            seq_id, params = next(self._ids), req.params
            seq = Seq(seq_id, ticket, eng.controller.stream(req.gamma, seq_id, shadow=params.greedy or params.coupled))
            stats.prompt_tokens, stats.gamma = len(req.prompt_ids), req.gamma
            stats.proposer = eng.source.name if eng.source is not None else "none"
            try:
                if eng.source is not None:
                    eng.source.begin(seq, *eng.controller.first_block(seq.control))
                seq.state = eng.target.new_state()
            except Exception as exc:  # noqa: BLE001 - this request fails; the batch goes on
                self._release(eng, seq)
                ticket.put(exc)
                continue
            self._seqs.append(seq)

    def _prefill(self, eng: Engine) -> None:
        """Cache the prompts of the rows that joined, oldest first: whole while no row decodes (nobody waits), else at
        most serving.prefill_chunk tokens this round, so a long prompt never stalls the streams that decode."""
        chunk = eng.config.serving.prefill_chunk
        budget = chunk if chunk and any(s.prefill_done for s in self._seqs) else float("inf")
        for seq in [s for s in self._seqs if not s.prefill_done]:
            if budget <= 0:
                return
            total = len(seq.prompt_ids) - 1
            stop = min(total, seq.prefilled + budget)
            try:
                eng.target.prefill(seq.state, seq.prompt_ids, seq.prefilled, stop)
            except Exception as exc:  # noqa: BLE001 - this request fails; the batch goes on
                self._seqs = [s for s in self._seqs if s is not seq]
                self._release(eng, seq)
                seq.ticket.put(exc)
                continue
            budget -= stop - seq.prefilled
            seq.prefilled, seq.prefill_done = stop, stop >= total
            if seq.prefill_done:
                seq.stats.time_prefill_s = time.perf_counter() - seq.t_start

    def _step(self, eng: Engine) -> None:
        """One round for every running sequence (docs/architecture.md#the-decode-loop): the controller plans it, the
        loop carries the plan out and reports what it cost."""
        target, source, controller = eng.target, eng.source, eng.controller
        seqs = [s for s in self._seqs if s.prefill_done]  # the rows still prefilling wait for their prompt
        if source is None and len(self._seqs) == 1 and seqs[0].params.greedy and not self._waiting:
            self._plain_run(eng, seqs[0])
            return
        drafts = [Draft(ids=[]) for _ in seqs]
        rows, share = [RowPlan() for _ in seqs], None
        if source is not None:
            # 1) plan
            plan = controller.plan([s.control for s in seqs], [s.room(target.context_len) for s in seqs],
                                   offers=lambda caps: source.offers(seqs, caps),
                                   wait_default_s=max(0.001, max(s.stats.time_prefill_s for s in seqs)))
            rows = plan.rows
            if (len(self._seqs) == 1 and rows[0].k == 0 and rows[0].steps > 1 and seqs[0].params.greedy
                    and not source.drafts_ahead and not self._waiting):  # the target alone until the re-probe
                self._plain_run(eng, seqs[0], rows[0])
                return
            # 2) propose (only drafts made in another process are waited for, until the plan's deadline)
            started = time.perf_counter()
            drafts = source.propose(seqs, rows, plan.deadline_s or 0.0)
            share = (time.perf_counter() - started) / len(seqs)
            for seq in seqs:
                if plan.deadline_s is None:
                    seq.stats.time_draft_s += share
                else:
                    seq.stats.time_wait_s += share
        # 3) verify
        verify_started = time.monotonic()
        outs = self._verify(target, seqs, drafts)
        span = (verify_started, time.monotonic())
        verify_s = span[1] - span[0]
        self.batch_sizes.append(len(seqs))
        if source is not None:  # what a pass costs matters only where something drafts
            controller.observe_pass(len(seqs), len(seqs) * max(len(d.ids) + 1 + len(d.alts) for d in drafts),
                                    not any(d.ids for d in drafts), verify_s)
        for seq, row, draft, out in zip(seqs, rows, drafts, outs):
            try:  # 4) accept, commit + stop checks; 5) observe
                self._finish_round(eng, seq, row, draft, out, verify_s, span, n_rows=len(seqs), draft_s=share)
            except Exception as exc:  # noqa: BLE001 - this request fails; the others go on
                log.exception("scheduler: request %d failed", seq.id)
                self._end(eng, seq, exc)
                continue
            if seq.stats.finish_reason:
                self._end(eng, seq)
        if source is not None:
            costs = source.costs()
            controller.observe_costs(costs.token_s, costs.transfer_s)

    @staticmethod
    def _verify(target: Verifier, seqs: list[Seq], drafts: list[Draft]) -> list:
        """The round's pass(es): rows with second choices verify as token trees (one per pass) where the target can
        and their sampling allows (greedy, coupled); elsewhere the second choices are dropped."""
        trees = getattr(target, "supports_tree", False)
        for seq, draft in zip(seqs, drafts):
            # a tree's siblings take cache positions after its chain's: never past the context
            fits = len(seq.ids) + len(draft.ids) + len(draft.alts) <= target.context_len
            if draft.alts and not (trees and fits and (seq.params.greedy or seq.params.coupled)):
                draft.alts = []
            del draft.alts[max(0, TREE_MAX_TOKENS - 1 - len(draft.ids)):]  # a prefix: parents stay before children
        chains = [i for i, d in enumerate(drafts) if not d.alts]
        outs: list = [None] * len(seqs)
        if chains:
            rows = [(seqs[i].state, seqs[i].ids[-1], drafts[i].ids) for i in chains]
            for i, out in zip(chains, target.verify_batch(rows, [seqs[i].params.greedy for i in chains])):
                outs[i] = out
        for i, (seq, draft) in enumerate(zip(seqs, drafts)):
            if draft.alts:
                outs[i] = target.verify_tree(seq.state, seq.ids[-1], draft.ids, draft.alts, seq.params.greedy)
        return outs

    def _plain_run(self, eng: Engine, seq: Seq, row: RowPlan | None = None) -> None:
        """One greedy request runs alone and nothing drafts this round (no draft source; or a local one that the
        controller rests, row.steps rounds at k 0 before its re-probe): several steps in one round
        (Verifier.greedy_steps), as many as take about PLAIN_RUN_S (and row.steps), within the request's room. A
        round's Python costs 0.1-0.5 ms: on the demo pair a twentieth to a fifth of the target's step, which ONNX
        Runtime GenAI's loop does not pay. The tokens are those of one-step rounds, and the source and the controller
        hear of each step as of a round; a stop token inside the run ends it, the positions cached after it unused."""
        stats, req, source = seq.stats, seq.req, eng.source
        n = max(1, min(self.plain_steps_max, int(PLAIN_RUN_S / self._plain_step_s) if self._plain_step_s else 1,
                       seq.room(eng.target.context_len), row.steps if row is not None else self.plain_steps_max))
        span = (time.monotonic(), 0.0)
        tokens = eng.target.greedy_steps(seq.state, seq.ids[-1], n)
        span = (span[0], time.monotonic())
        self._plain_step_s = (span[1] - span[0]) / n
        self.batch_sizes.extend([1] * n)
        stats.time_verify_s += span[1] - span[0]
        if eng.config.runtime.trace:
            seq.trace.extend([(span[0], span[1], len(seq.ids), 0)] * n)
        emitted, seq.generated = commit_tokens(seq.ids, tokens, req, seq.generated, eng.target.context_len, stats)
        for i, token in enumerate(emitted):
            stats.record_round(0, 0)
            if source is not None:
                eng.controller.observe(seq.control, 0, 0, self._plain_step_s, row, draft_s=0.0)
                if not stats.finish_reason or i < len(emitted) - 1:  # as _finish_round: not the token that ends it
                    source.commit(seq, 0, token)
        if source is not None:
            eng.controller.ran_plain(seq.control, len(emitted))
        stats.new_tokens = seq.generated
        stats.time_total_s = time.perf_counter() - seq.t_start
        seq.ticket.put(emitted)
        if stats.finish_reason:
            self._end(eng, seq)

    def _finish_round(self, eng: Engine, seq: Seq, row: RowPlan, draft: Draft, out: Any, verify_s: float,
                      span: tuple[float, float], n_rows: int, draft_s: float | None = None) -> None:
        """n_rows: the rows of this round's pass (rows before this one may have left the batch already); draft_s:
        the row's share of the round's drafting."""
        stats, req = seq.stats, seq.req
        stats.time_verify_s += verify_s
        if eng.config.runtime.trace:
            seq.trace.append((span[0], span[1], len(seq.ids), len(draft.ids)))
        accepted, next_token = decide_block(eng.target, seq.state, req.params, seq.ids, draft, out)
        stats.record_round(len(draft.ids), accepted)
        # the chain's own acceptance: what the controller models (a branch taken is a bonus on top)
        chain = accepted if draft.path is None else draft.chain_kept
        stats.tree_tokens += len(draft.alts)
        stats.tree_taken += draft.path is not None
        if eng.source is not None:
            eng.controller.observe(seq.control, len(draft.ids), chain, verify_s if n_rows == 1 else None, row,
                                   draft_s=draft_s)
        if draft.shadow:
            eng.controller.observe_shadow(*draft.shadow)
        emitted, seq.generated = commit_tokens(seq.ids, [*draft.accepted_ids(accepted), next_token], req,
                                               seq.generated, eng.target.context_len, stats)
        if not stats.finish_reason and eng.source is not None:
            # a branch taken: the source kept `chain` of its tokens, then the text went on without it (it reads the
            # rest of the branch and the token after it from seq.ids, as after rounds it did not draft)
            eng.source.commit(seq, chain, next_token if draft.path is None else draft.path[chain])
        stats.new_tokens = seq.generated
        stats.time_total_s = time.perf_counter() - seq.t_start
        if n_rows > 1:
            seq.batched_rounds += 1
            seq.largest_batch = max(seq.largest_batch, n_rows)
        seq.ticket.put(emitted)

    def _release(self, eng: Engine, seq: Seq) -> dict:
        """Free the sequence's draft state and its target state (a KV slot); the source's summary of it."""
        try:
            return {} if eng.source is None else eng.source.end(seq)
        finally:
            if seq.state is not None:
                eng.target.release_state(seq.state)
                seq.state = None

    def _end(self, eng: Engine, seq: Seq, exc: BaseException | None = None) -> None:
        """The sequence leaves: summaries into its stats, its states freed, DONE (or the error) to its caller."""
        self._seqs = [s for s in self._seqs if s is not seq]
        stats, controller = seq.stats, eng.controller
        stats.time_total_s = time.perf_counter() - seq.t_start
        if eng.source is not None:
            stats.extra.update(controller.end(seq.control))
        try:
            extra = self._release(eng, seq)
        except Exception as err:  # noqa: BLE001 - freeing what is left; the request's own outcome stands
            log.exception("scheduler: releasing request %d", seq.id)
            extra, exc = {}, exc or err
        timeline = extra.pop("timeline", None)
        stats.extra.update(extra)
        if eng.config.runtime.trace:
            stats.extra["timeline"] = {"verify": seq.trace, **(timeline or {})}
        if seq.batched_rounds:
            stats.extra["batch"] = {"rounds_batched": seq.batched_rounds, "largest_batch": seq.largest_batch,
                                    "last_plan": controller.last_plan}
        seq.ticket.put(exc if exc is not None else DONE)
        if exc is None:
            eng.request_done(stats, batched=seq.batched_rounds > 0)

    def _fail_all(self, exc: BaseException) -> None:
        eng = self._engine()
        for seq in list(self._seqs):
            if eng is None:
                seq.ticket.put(exc)
            else:
                self._end(eng, seq, exc)
        self._seqs = []
