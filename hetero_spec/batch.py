"""The request scheduler: every request of an Engine runs in one loop thread, which decodes up to
`serving.max_batch` of them together (continuous batching: they join and leave between rounds).

A round of the batch, in process (scheduler.Row holds each request's state):
  0) plan: each row's own gamma, then the batch's plan (tuning/batching.py: speculate, or one shared pass)
  1) propose: each row's proposer drafts its block; rows drafting with the ONNX model step together (one run per
     draft token for all of them), other proposers in turn
  3) verify: ONE `verify_batch` call for all rows (the backend shares passes as far as it can)
  4) commit + stop checks per row; its tokens go to its caller; a finished or cancelled row leaves at once,
     freeing its target state (a KV slot) and its draft state, and a waiting request takes its place.

In the two_process layout the draft worker drafts for several requests at once (one stream each,
runtime/draft_worker.py). Requests then take turns, a round each, in this thread (runtime/pipelined.py: each
verifies its own block while the worker drafts everyone's next one), and join and leave between rounds. When
shared target passes without drafts are predicted faster for everything running and waiting
(tuning/batching.streams_or_rows: on a CPU a shared pass of B tokens costs little more than one), the waiting
requests join as target-only rows instead: each round then runs the streams' turns and one round of the rows.

Callers never touch the models: they submit a Ticket and read its sink (a queue for threads, an asyncio queue
for the server). Items are lists of token ids, then DONE, or an exception that ends the request.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import EngineClosedError
from .metrics import Stats
from .scheduler import Request, Row
from .tuning.batching import BatchPlan, may_join, plan_batch, streams_or_rows

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("hetero_spec.batch")

DONE = object()  # the last item of a ticket's sink when the request ended normally (stats.finish_reason says how)


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
    batched_rounds: int = 0  # rounds that shared the target pass with other requests
    largest_batch: int = 1

    def put(self, item: Any) -> None:
        try:
            self.sink(item)
        except RuntimeError:  # the caller's event loop is gone: nobody reads this request any more
            self.cancel.set()


@dataclass
class Stream:
    """A two_process request taking turns with others: its decode loop (a generator, one round per next())."""

    rounds: Any
    ticket: Ticket


class RequestScheduler:
    """Owns the loop thread. Holds the Engine weakly, so a dropped Engine is still collected (and its finalizer
    stops this loop)."""

    def __init__(self, engine: Engine):
        self._engine = weakref.ref(engine)
        self._cv = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._rows: list[tuple[Row, Ticket]] = []
        self._streams: list[Stream] = []  # two_process: requests taking turns, drafted by the worker
        self.last_mode = ""  # two_process: why the last requests took turns or shared passes
        self._stopping = False
        self.last_plan: BatchPlan | None = None
        self._plain = (0, 0)  # (batch size, rounds left): a plain plan holds this long for an unchanged batch
        self.batch_sizes: deque[int] = deque(maxlen=4096)  # rounds' batch sizes, drained by the server's metrics
        self._thread = threading.Thread(target=self._run, name="hetero-spec-scheduler", daemon=True)
        self._thread.start()

    # -- callers' side ---------------------------------------------------------------------------------
    def submit(self, ticket: Ticket) -> None:
        with self._cv:
            if self._stopping:
                raise EngineClosedError("this Engine is closed; create a new one (Engine.from_config)")
            self._waiting.append(ticket)
            self._cv.notify()

    @property
    def running(self) -> int:
        return len(self._rows) + len(self._streams)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def stop(self, wait_s: float = 0.0) -> bool:
        """No new requests; waiting ones fail with EngineClosedError, running ones finish. Returns whether the
        loop ended within wait_s."""
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
                while not (self._waiting or self._rows or self._streams or self._stopping):
                    self._cv.wait()
                if self._stopping:
                    while self._waiting:
                        self._waiting.popleft().put(EngineClosedError("this Engine was closed before the "
                                                                      "request started"))
                    if not self._rows and not self._streams:
                        break
            engine = self._engine()
            if engine is None:  # collected: its finalizer released the models
                self._fail_all(EngineClosedError("the Engine was garbage-collected"))
                return
            try:
                self._round(engine)
            except BaseException as exc:  # noqa: BLE001 - every running request hears of it; the loop goes on
                log.exception("request scheduler: a round failed")
                self._fail_all(exc)
            del engine
        engine = self._engine()
        if engine is not None and engine._closed:  # close() did not wait for the last requests: release now
            engine._finalizer()

    def _round(self, eng: Engine) -> None:
        with eng._lock:
            eng._progress_at = time.monotonic()
            if eng.runtime is not None and self._waiting and self._take_turns(eng):
                self._admit_streams(eng)  # two_process: requests take turns, the worker drafts them all
            self._admit(eng)  # in process; or two_process when shared passes without drafts pay more
            if self._streams:
                self._step_streams(eng)
            self._drop_cancelled()
            if self._rows:
                self._step(eng)

    def _take_turns(self, eng: Engine) -> bool:
        """two_process: whether the waiting requests take turns drafted by the worker, or join target-only rows in
        shared passes (tuning/batching.streams_or_rows over everything running and waiting)."""
        b = min(len(self._waiting) + self.running, eng.config.serving.max_batch)
        setting = eng.config.serving.two_process
        if setting != "auto" or b < 2:
            turns, why = setting == "turns" or b < 2, f"serving.two_process: {setting}"
        else:
            turns, why = streams_or_rows(b, eng.tuning.global_acceptance(), eng.tuning.model(), eng.tuning.shared)
        if b > 1:
            self.last_mode = why
        return turns

    def _admit_streams(self, eng: Engine) -> None:
        while self.running < eng.config.serving.max_batch:
            ticket = self._next_waiting()
            if ticket is None:
                return
            # the loop thread is pinned around each round (_step_streams), not by each request
            self._streams.append(Stream(eng.runtime.decode(eng.target, ticket.req, ticket.stats, pin=False),
                                        ticket))

    def _step_streams(self, eng: Engine) -> None:
        """One round of every request taking turns (its tokens to its caller); a finished, failed or cancelled one
        leaves at once (its worker stream ends: End), and a waiting request takes its place next round."""
        from .runtime.engine_side import pinned_thread

        n = len(self._streams)
        self.batch_sizes.append(n)
        with pinned_thread(eng.runtime.target_cpus):
            for st in list(self._streams):
                ticket = st.ticket
                if ticket.cancel.is_set():
                    ticket.stats.finish_reason = ticket.stats.finish_reason or "cancelled"
                    self._end_stream(st, eng)
                    continue
                try:
                    chunk = next(st.rounds)
                except StopIteration:
                    self._end_stream(st, eng)
                    continue
                except Exception as exc:  # noqa: BLE001 - the request's caller gets it; the others go on
                    self._streams.remove(st)
                    st.rounds.close()
                    ticket.put(exc)
                    continue
                eng._progress_at = time.monotonic()
                if n > 1:
                    ticket.batched_rounds += 1
                    ticket.largest_batch = max(ticket.largest_batch, n)
                ticket.put(chunk)

    def _end_stream(self, st: Stream, eng: Engine) -> None:
        self._streams.remove(st)
        st.rounds.close()  # ends the request's draft state (worker End) now
        eng.observe_request(st.ticket.stats, batched=st.ticket.batched_rounds > 0)
        self._between_requests(eng)
        if st.ticket.batched_rounds:
            st.ticket.stats.extra["batch"] = {"rounds_taking_turns": st.ticket.batched_rounds,
                                              "largest_batch": st.ticket.largest_batch, "mode": self.last_mode}
        st.ticket.put(DONE)

    def _next_waiting(self) -> Ticket | None:
        """The first waiting request that is still wanted (one cancelled while it waited ends here); None when
        none waits."""
        while True:
            with self._cv:
                if not self._waiting:
                    return None
                ticket = self._waiting.popleft()
            if not ticket.cancel.is_set():
                return ticket
            ticket.stats.finish_reason = "cancelled"
            ticket.put(DONE)

    def _between_requests(self, eng: Engine) -> None:
        """The last running request has ended and none waits: the placement may move now (tuning/placement.py),
        before that request's caller hears it is done, so what it runs next sees the new layout."""
        if not self._rows and not self._streams and not self._waiting and not eng._closed:
            eng._maybe_replace()

    def _admit(self, eng: Engine) -> None:
        """Waiting requests join while there is room (serving.max_batch, and serving.mode latency's limit)."""
        serving = eng.config.serving
        while self.running < serving.max_batch:
            if not may_join(len(self._rows), serving.mode, eng.tuning.model(), eng.tuning.shared):
                break
            ticket = self._next_waiting()
            if ticket is None:
                return
            row = None
            try:
                row = Row(eng.target, eng._row_proposer(), ticket.req, ticket.stats, eng.tuning,
                          early_stop=eng.config.speculation.early_stop)
                row.start()
            except Exception as exc:  # noqa: BLE001 - this request fails; the batch goes on
                if row is not None:
                    self._close(row)
                ticket.put(exc)
                continue
            self._rows.append((row, ticket))

    def _drop_cancelled(self) -> None:
        for row, ticket in [rt for rt in self._rows if rt[1].cancel.is_set()]:
            row.stats.finish_reason = row.stats.finish_reason or "cancelled"
            self._end(row, ticket)

    def _step(self, eng: Engine) -> None:
        """One round for every running request (phases in the module docstring)."""
        target, rows = eng.target, [row for row, _ in self._rows]
        gammas = self._plan(eng, rows)  # 0) plan
        drafts = self._propose(rows, gammas)  # 1) propose
        t = time.perf_counter()  # 3) verify
        outs = target.verify_batch([(row.state, row.ids[-1], d.ids) for row, d in zip(rows, drafts)],
                                   [row.req.params.greedy for row in rows])
        verify_s = time.perf_counter() - t
        self.batch_sizes.append(len(rows))
        if len(rows) > 1:
            if target.batch_blocks:
                eng.tuning.shared.observe(len(rows) * max(len(d.ids) + 1 for d in drafts), verify_s)
            elif not any(d.ids for d in drafts):
                eng.tuning.shared.observe(len(rows), verify_s)
        for (row, ticket), draft, out in zip(list(self._rows), drafts, outs):  # 4) commit, per row
            row.stats.time_verify_s += verify_s
            if len(rows) > 1:
                ticket.batched_rounds += 1
                ticket.largest_batch = max(ticket.largest_batch, len(rows))
            ticket.put(row.finish(draft, out, verify_s if len(rows) == 1 else None))
            if row.done:
                self._end(row, ticket, eng)

    #: rounds a plain plan (one shared pass) holds before the rows' gammas and the plan are asked again, while
    #: the batch keeps its size: each row's choice searches gamma (~0.1 ms), the price of a shared pass row here
    PLAIN_HOLD = 16

    def _plan(self, eng: Engine, rows: list[Row]) -> list[int]:
        """0) the rows' own gammas, then the batch's plan (a fixed gamma is the user's: no batch plan)."""
        size, left = self._plain
        if len(rows) > 1 and size == len(rows) and left > 0:
            self._plain = (size, left - 1)
            return [0] * len(rows)
        gammas = [row.plan() for row in rows]
        if len(rows) > 1 and all(row.policy.fixed is None for row in rows):
            self.last_plan = plan_batch(gammas, [row.policy.estimate() for row in rows], eng.tuning.model(),
                                        eng.tuning.shared, eng.target.batch_blocks,
                                        draft_together=all(self._steps_together(row) for row in rows))
            gammas = self.last_plan.gammas
            held = any(g for g in self.last_plan.spec_gammas()) and not any(gammas)
            self._plain = (len(rows), self.PLAIN_HOLD if held else 0)
        return gammas

    @staticmethod
    def _steps_together(row: Row) -> bool:
        from .draft.onnx_drafter import OnnxDrafter

        return type(row.proposer) is OnnxDrafter and row.stop is None

    def _propose(self, rows: list[Row], gammas: list[int]) -> list:
        """1) each row's draft. Rows drafting with the ONNX model (no early stop) step together, one run per
        draft token for all of them (OnnxDrafter.propose_batch, each row's draft what it would be alone); the
        others (n-gram, draft selection, early stop) propose in turn."""
        from .draft.onnx_drafter import OnnxDrafter

        together = [i for i, (row, k) in enumerate(zip(rows, gammas)) if k > 0 and self._steps_together(row)]
        drafts: list = [None] * len(rows)
        if len(together) > 1:
            for i in together:
                rows[i].arm_probe_window()
            t = time.perf_counter()
            out = OnnxDrafter.propose_batch([rows[i].proposer for i in together], [gammas[i] for i in together])
            share = (time.perf_counter() - t) / len(together)
            for i, draft in zip(together, out):
                rows[i].drafted(share)
                drafts[i] = draft
        return [d if d is not None else row.propose(k) for d, row, k in zip(drafts, rows, gammas)]

    def _end(self, row: Row, ticket: Ticket, eng: Engine | None = None) -> None:
        self._rows = [rt for rt in self._rows if rt[0] is not row]
        self._close(row)
        if eng is not None:
            eng.observe_request(ticket.stats, batched=ticket.batched_rounds > 0)
            self._between_requests(eng)
        if ticket.batched_rounds:
            ticket.stats.extra["batch"] = {"rounds_batched": ticket.batched_rounds,
                                           "largest_batch": ticket.largest_batch,
                                           "last_plan": self.last_plan.reason if self.last_plan else ""}
        ticket.put(DONE)

    @staticmethod
    def _close(row: Row) -> None:
        """Free the request's target state (KV slot) and its draft state."""
        row.close()
        if row.proposer is not None:
            row.proposer.close()

    def _fail_all(self, exc: BaseException) -> None:
        for row, ticket in self._rows:
            try:
                self._close(row)
            except Exception:  # noqa: BLE001 - freeing what is left; the error below is what matters
                log.exception("request scheduler: releasing a failed request")
            ticket.put(exc)
        self._rows = []
        for st in self._streams:
            try:
                st.rounds.close()
            except Exception:  # noqa: BLE001 - as above
                log.exception("request scheduler: releasing a failed request")
            st.ticket.put(exc)
        self._streams = []
