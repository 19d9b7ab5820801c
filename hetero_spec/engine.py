"""The public, embeddable API: `Engine` (its use: docs/python-api.md)."""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .config import Config, build_config, load_config
from .draft.select import LOOKUPS, prompt_window
from .draft.source import LocalSource, SelectingSource
from .errors import ConfigError, EngineClosedError
from .gguf_source import resolve as resolve_gguf
from .metrics import Stats
from .precision import check_target, resolve_auto, resolve_draft
from .preflight import check_config
from .sampling import SamplingParams
from .scheduler import DONE, Request, Scheduler, Ticket, check_request, is_last
from .target.backends import _device_is_cuda, choose_backend, load_target, target_spin
from .tuning import placement as pl
from .tuning.controller import Controller
from .tuning.profile import load_tuning, seed_verify_curve
from .validation import check_stop_ids, prompt_token_ids, request_args

log = logging.getLogger("hetero_spec")


@dataclass
class GenerationOutput:
    """Result of `Engine.generate`. token_ids holds the generated ids only (not the prompt)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: how often a caller waiting for its request's next round checks that the request loop still runs
LOOP_POLL_S = 1.0
LOOP_DIED = "the request loop stopped (its thread died; the log says why): the request cannot finish"


class Rounds:
    """A request's rounds, each a list of committed token ids (Engine.stream_tokens). Leaving before the end, by
    close() or by dropping the iterator (even one never read), cancels the request before its next round; a
    request loop that died raises EngineClosedError instead of leaving the caller blocked forever."""

    def __init__(self, items, cancel: threading.Event, loop_alive: Callable[[], bool]):
        self._items, self._cancel, self._loop_alive = items, cancel, loop_alive
        self._over = False
        self._on_drop = weakref.finalize(self, cancel.set)

    def __iter__(self) -> Rounds:
        return self

    def __next__(self) -> list[int]:
        if self._over:
            raise StopIteration
        while True:
            try:
                item = self._items.get(timeout=LOOP_POLL_S)
                break
            except queue.Empty:
                if not self._loop_alive():
                    self.close()
                    raise EngineClosedError(LOOP_DIED) from None
        return self._take(item)

    def _take(self, item: Any) -> list[int]:
        try:
            last = is_last(item)  # raises the exception that ended the request
        except BaseException:
            self._end()
            raise
        if last:
            self._end()
            raise StopIteration
        return item

    def _end(self) -> None:
        self._over = True
        self._on_drop.detach()

    def close(self) -> None:
        """Stop reading: the request is cancelled unless it had already ended."""
        if not self._over:
            self._cancel.set()
            self._end()


class AsyncRounds(Rounds):
    """Rounds for asyncio (Engine.astream_tokens): the same contract, read from an asyncio queue."""

    def __aiter__(self) -> AsyncRounds:
        return self

    async def __anext__(self) -> list[int]:
        if self._over:
            raise StopAsyncIteration
        while True:
            try:
                item = self._items.get_nowait() if not self._items.empty() else \
                    await asyncio.wait_for(self._items.get(), LOOP_POLL_S)
                break
            except asyncio.TimeoutError:
                if not self._loop_alive():
                    self.close()
                    raise EngineClosedError(LOOP_DIED) from None
        try:
            return self._take(item)
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        self.close()


def _release(parts: dict[str, Callable[[], Any]], keys=("scheduler", "source", "cpu_plan")) -> None:
    """Call the releases of what an Engine holds: the request loop, the draft source (and worker), the CPU plan.
    As the Engine's weakref finalizer it runs once: from close(), garbage collection, or interpreter exit."""
    for key in keys:
        if (close := parts.pop(key, None)) is not None:
            close()


class Detokenizer:
    """Incremental detokenization (as vLLM does): decode only from prefix_off, so each round costs O(round)
    instead of re-decoding the whole output. ids[prefix_off:read_off] has been emitted. Text that ends in an
    incomplete UTF-8 sequence waits for the next tokens (or the end: final)."""

    def __init__(self, decode):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix_off = self.read_off = 0

    def add(self, tokens: list[int], final: bool = False) -> str:
        self.ids.extend(tokens)
        prefix = self.decode(self.ids[self.prefix_off:self.read_off])
        text = self.decode(self.ids[self.prefix_off:])
        if text.endswith("\ufffd") and not final:
            return ""
        self.prefix_off, self.read_off = self.read_off, len(self.ids)
        return text[len(prefix):]

    def pieces(self, chunks: Iterator[list[int]]) -> Iterator[str]:
        """The new text of each round's tokens (when there is some), then the text that waited to the end."""
        for chunk in chunks:
            if piece := self.add(chunk):
                yield piece
        if rest := self.add([], final=True):
            yield rest

    async def apieces(self, chunks: AsyncIterator[list[int]]) -> AsyncIterator[str]:
        """pieces() of an async iterator."""
        async for chunk in chunks:
            if piece := self.add(chunk):
                yield piece
        if rest := self.add([], final=True):
            yield rest


class Engine:
    """Speculative decoding engine: a target (PyTorch or ONNX Runtime backend) verifying proposals of a draft.
    Thread-safe; requests, their keywords (`**kw`) and the lifecycle: docs/python-api.md."""

    #: a request decoded alone, with at least this many new tokens, tells the placement the layout's real goodput
    OBSERVE_MIN_TOKENS = 16

    def __init__(self, config: Config, controller=None):
        """controller: the speculation controller's factory, called like tuning/controller.Controller (default)."""
        self._make_controller = controller or Controller
        self._checked: Config | None = None
        self._preflight(config)  # paths, host, providers, vocabulary: before anything loads
        config = resolve_gguf(config)  # a GGUF target.model / draft.model: its Hugging Face conversion (cached)
        self._preflight(config)  # the converted directories (the vocabulary); a no-op when nothing changed
        choice = choose_backend(config.target, config.blame("target.model"))
        config = config.model_copy(deep=True)
        config.target.backend = choice.backend
        log.info("target backend: %s (%s)", choice.backend, choice.reason)
        # what gamma: auto learns across requests (acceptance, costs), seeded by a profile if one is given
        self.tuning = load_tuning(config.speculation.profile, source=config.blame("speculation.profile"))
        # target.precision (or dtype) checked for the backend and made explicit; draft.precision: its cached export
        config = resolve_auto(config, self.tuning.recommended_precision)
        cuda = choice.backend == "torch" and _device_is_cuda(config.target.device)
        config.target.precision = check_target(config, choice.backend, cuda)
        config = resolve_draft(config)
        if config.serving.max_batch == "auto":
            config.serving.max_batch = self.tuning.recommended_batch or 8
            log.info("serving.max_batch auto: %d (%s)", config.serving.max_batch,
                     "the profile's recommendation" if self.tuning.recommended_batch else "no profile: the default")
        #: runtime.mode / runtime.cpus auto: the layout chosen by measurement, with every candidate's prediction;
        #: "switches" lists the re-placements made once the draft's acceptance was known (_maybe_replace)
        self.placement: dict[str, Any] = {}
        self._auto_config = config if config.runtime.mode == "auto" or config.runtime.cpus == "auto" else None
        self._replacer: pl.Replacer | None = None
        self._progress_at = time.monotonic()  # the request loop's last sign of life (health while busy)
        if self._auto_config is not None:
            config, self.placement = pl.resolve(config, self.tuning.prior_acceptance)
            self._seed_tuning()
            self.placement["switches"] = []
            self._replacer = pl.Replacer(self._auto_config, self.placement)
        self.lock = threading.Lock()  # held for each round: health probes the models only when it can take it
        self._swap = threading.Lock()  # held while a re-placement swaps the models: requests wait for the new target
        self.closed = False
        self.failure: str | None = None  # why the Engine can serve no more (a re-placement left it without models)
        self._parts: dict[str, Callable[[], Any]] = {}  # what close() releases; also at garbage collection or exit
        self._finalizer = weakref.finalize(self, _release, self._parts)
        try:
            self._build(config)
            if self._auto_config is None and config.speculation.gamma == "auto" and self.tuning.profile is None \
                    and self.source is not None:
                started = time.perf_counter()
                curve = seed_verify_curve(self.tuning, self.target, prompt_len=min(32, self.target.context_len // 2))
                log.info("gamma auto: the verify curve, measured in %.1f s (ms per k drafts): %s",
                         time.perf_counter() - started, {k: round(v * 1e3, 2) for k, v in curve.items()})
        except BaseException:
            self._finalizer()
            raise
        self._scheduler = Scheduler(self)
        self._parts["scheduler"] = self._scheduler.stop

    @classmethod
    def from_config(cls, config: str | Path | Config | dict, overrides: dict[str, Any] | None = None,
                    controller=None) -> Engine:
        """Build from a YAML path, a Config, or a raw dict; overrides are dotted keys ("speculation.gamma")."""
        if isinstance(config, Config):
            if overrides:
                config = build_config(config.model_dump(mode="json"), source=config.source, overrides=overrides)
        elif isinstance(config, dict):
            config = build_config(config, overrides=overrides)
        else:
            config = load_config(config, overrides=overrides)
        return cls(config, controller)

    def _preflight(self, config: Config) -> None:
        """preflight.check_config, before anything heavy loads; once per config object."""
        if self._checked is not config:
            check_config(config)
            self._checked = config

    def _build(self, config: Config) -> None:
        """Load the target and start the draft source (in process, or the worker) for a resolved config."""
        self._preflight(config)
        self.config = config
        log.info("resolved config (%s): %s", config.source, config.model_dump_json())
        self.source = None
        self.loop_cpus: list[int] | None = None  # the loop thread's cores (two_process: the target's)
        threads, prefill, cpu_plan = config.target.threads, config.target.prefill_threads, None
        if config.runtime.mode == "two_process":
            from .runtime.cpus import CpuPlan
            cpu_plan = CpuPlan(config)
            self._parts["cpu_plan"] = cpu_plan.restore
            threads = cpu_plan.threads
        if prefill == "auto":
            prefill = cpu_plan.prefill_threads if cpu_plan is not None else None
        self.target = load_target(config.target, threads, spin=target_spin(config), prefill_threads=prefill,
                                  kernels=config.runtime.kernels)
        self.tokenizer = self.target.tokenizer
        self.target.enable_batching(config.serving.max_batch)
        self.controller = self._make_controller(self.tuning, config.runtime.mode, self.target.batch_blocks,
                                                config.serving.mode, plain_hold=config.serving.plain_hold)
        self.source = self._make_source(config)
        if self.source is not None:
            self._parts["source"] = self.source.close
            self.controller.together = self.source.drafts_together

    def _make_source(self, config: Config):
        """The draft source: the worker (two_process), a selection (draft.candidates), one local kind, or None."""
        draft, slots = config.draft, config.serving.max_batch
        if draft.kind == "ngram" and draft.ngram.min_n > draft.ngram.max_n:
            raise ConfigError(config.source, "draft.ngram.min_n", draft.ngram.min_n,
                              f"must be <= draft.ngram.max_n ({draft.ngram.max_n})")
        cands: dict[str, Any] = {}
        if config.runtime.mode == "two_process":
            from .runtime.worker_source import WorkerSource
            cands["onnx"] = WorkerSource(config, self.target.vocab_width, context_len=self.target.context_len,
                                         max_streams=slots)
            self.loop_cpus = cands["onnx"].target_cpus
            if not draft.candidates:
                return cands["onnx"]
        elif not draft.candidates:
            return self._local(config, draft.kind, slots)
        lookup = any(kind in LOOKUPS for kind in draft.candidates)  # a model candidate feeds only the last catchup_skip
        for kind in draft.candidates:  # the worker runs even when only the n-gram lookup is chosen among
            if kind not in cands:
                cands[kind] = self._local(config, kind, slots, catchup_skip=draft.catchup_skip if lookup else None)
        names = list(draft.candidates)
        self.controller.selection(names, {n: "two_process" if cands[n].drafts_ahead else "in_process" for n in names},
                                  {n: cands[n].costs for n in names})
        return SelectingSource(cands, names=names)

    def _local(self, config: Config, kind: str, slots: int, catchup_skip: int | None = None):
        """An in-process source of one kind (None for none); the onnx draft's rows step together in one buffer."""
        if kind == "none":
            return None
        from .draft.ngram import NgramProposer
        from .draft.onnx_drafter import OnnxDrafter
        draft = config.draft
        if kind == "ngram":
            trees = getattr(self.target, "supports_tree", False)
            return LocalSource(NgramProposer(max_n=draft.ngram.max_n, min_n=draft.ngram.min_n,
                                             branches=draft.ngram.branches if trees else 0))
        if kind == "corpus":
            from .draft.corpus import CorpusProposer, cached_table
            if not (tok := Path(self.target.model_dir) / "tokenizer.json").is_file():
                raise config.error("draft.candidates", draft.candidates,
                                   f"corpus needs the target's tokenizer.json, not found in {self.target.model_dir}")
            return LocalSource(CorpusProposer(cached_table(tok)))
        window = prompt_window(draft.prompt_window, draft.candidates, "in_process")
        drafter = OnnxDrafter(draft.model, providers=draft.providers, threads=draft.threads,
                              vocab_width=self.target.vocab_width, spin="run", prompt_window=window,
                              catchup_skip=catchup_skip, kernels=self.config.runtime.kernels,
                              second_choices=draft.second_choices if getattr(self.target, "supports_tree", False)
                              else 0)
        drafter.enable_batching(slots)
        return LocalSource(drafter, together=OnnxDrafter.propose_batch)

    # -- what the scheduler's loop calls ------------------------------------------------------------------
    def heartbeat(self) -> None:
        """The loop is alive (health reads it while a request runs)."""
        self._progress_at = time.monotonic()

    def release(self) -> None:
        """Release everything now (the loop calls it when close() did not wait for the last requests)."""
        self._finalizer()

    def between_requests(self) -> None:
        """No request runs or waits: the placement may move now (tuning/placement.py), after the last callers
        heard they are done. A re-placement that fails is logged; the Engine keeps the layout that ran."""
        if self.closed:
            return
        try:
            with self.lock, self._swap:
                self._maybe_replace()
        except Exception:  # noqa: BLE001 - no request is waiting on this; the next one hears if the Engine broke
            log.exception("placement: re-placement failed")

    def request_done(self, stats: Stats, batched: bool) -> None:
        """A finished request: what the re-placement learns from it (tuning/placement.Replacer)."""
        if self._replacer is not None:
            self._replacer.observe(stats.new_tokens, stats.time_total_s - stats.time_prefill_s, stats.drafted,
                                   batched, self.OBSERVE_MIN_TOKENS)

    def _maybe_replace(self) -> None:
        """Apply the layout the placement asks for, between requests. The learned verify line belongs to the old
        thread count, so it starts afresh; acceptance is kept. A layout that will not start: back to the old."""
        if self._replacer is None:
            return
        move = self._replacer.decide(self.config.runtime.mode, self.tuning.acceptance.tested,
                                     self.tuning.global_acceptance())
        if move is None:
            return
        best, why, rows = move
        log.info("placement: switching layout; %s", why)
        old = self.config
        self._teardown()  # the old target goes first: never two targets in memory
        self.tuning.reset_costs()
        try:
            self._build(pl.apply(self._auto_config, best))
        except Exception:  # the new layout would not start: back to the one that ran
            log.exception("placement: %s failed to start; keeping the layout that ran", best.label())
            self._teardown()
            try:
                self._build(old)
            except Exception as exc:  # neither starts: no model is loaded, and every later call says why
                self._fail(f"a re-placement to {best.label()} failed, and the layout that ran would not start "
                           f"again: {type(exc).__name__}: {exc}")
                raise
        else:
            self._replacer.switched(best, why, rows, self.tuning.acceptance.tested)
        self._seed_tuning()

    def _seed_tuning(self) -> None:
        """The placement measured the chosen layout's costs: gamma auto starts from them (no exploration)."""
        if self.placement.get("costs") is None or self.tuning.profile is not None:
            return
        lay, costs = pl.Layout(**self.placement["chosen"]), pl.Costs.from_dict(self.placement["costs"])
        if costs.covers(lay):
            self.tuning.seed_costs(costs.model(lay))

    def _fail(self, why: str) -> None:
        """The Engine cannot serve: later calls raise EngineClosedError with `why`, /health answers 503."""
        self.failure = why
        self.closed = True
        log.error("engine failed: %s", why)

    def _teardown(self) -> None:
        """Release the draft source (and its worker), the CPU plan and the target (the Engine stays open)."""
        _release(self._parts, ("source", "cpu_plan"))
        self.source = self.target = None
        gc.collect()  # the target's weights go now, before the next target loads

    # -- health --------------------------------------------------------------------------------------
    def health(self, timeout_s: float | None = None) -> dict:
        """Real probes when idle (the worker's ping within timeout_s, default runtime.heartbeat_s); while a request
        runs, probes would disturb it: what the request loop knows (docs/python-api.md)."""
        self._check_open()
        locked = self.lock.acquire(blocking=False)
        if not locked or self._scheduler.running:
            # a round is on, or requests run between rounds (two_process: a ping would read their proposals'
            # channel): the request loop reports each round, and silent longer than the heartbeat means stuck
            if locked:
                self.lock.release()
            stalled = time.monotonic() - self._progress_at
            limit = timeout_s or self.config.runtime.heartbeat_s
            return {"target": "ok" if stalled <= max(limit, 1.0) else "stalled", "busy": True,
                    "since_last_round_s": round(stalled, 3), **self._draft_health(False)}
        try:
            started = time.perf_counter()
            state = self.target.new_state()
            try:
                self.target.verify(state, 0, [], True)  # a one-token pass on an empty cache
            finally:
                self.target.release_state(state)
            step_ms = round((time.perf_counter() - started) * 1e3, 3)
            return {"target": "ok", "busy": False, "target_step_ms": step_ms,
                    **self._draft_health(True, timeout_s)}
        finally:
            self.lock.release()

    def _draft_health(self, probe: bool, timeout_s: float | None = None) -> dict[str, Any]:
        return {"draft": "none"} if self.source is None else self.source.health(probe, timeout_s)

    # -- requests ----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.failure is not None:
            raise EngineClosedError(f"this Engine failed ({self.failure}); create a new one (Engine.from_config)")
        if self.closed:
            raise EngineClosedError("this Engine is closed; create a new one (Engine.from_config)")

    def _request(self, prompt: str | list[int], kw: dict[str, Any]) -> Request:
        """Validate a request (RequestError names argument and value), tokenize its prompt; waits out a re-placement."""
        with self._swap:
            self._check_open()
            gen, vocab = self.config.generation, self.target.vocab_width
            args = request_args(self.config, **kw)
            if [t for t in gen.stop_token_ids if t >= vocab]:
                raise self.config.error("generation.stop_token_ids", gen.stop_token_ids,
                                        f"ids outside the target's vocabulary [0, {vocab})")
            check_stop_ids(args["stop_token_ids"], vocab)
            params = SamplingParams(temperature=args["temperature"], top_k=args["top_k"], top_p=args["top_p"],
                                    seed=args["seed"] if args["seed"] is not None else secrets.randbits(48),
                                    sampling=self.config.speculation.sampling)
            stops = set() if args["ignore_eos"] else set(self.target.eos_token_ids)
            stops |= set(gen.stop_token_ids) | set(args["stop_token_ids"])
            req = Request(prompt_ids=self._prompt_ids(prompt), max_new_tokens=args["max_new_tokens"], params=params,
                          gamma=args["gamma"], stop_ids=frozenset(stops))
            check_request(req, self.target.context_len)  # an over-long prompt fails here, before anything streams
        return req

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        return prompt_token_ids(prompt, self.tokenizer, self.target.vocab_width, self.target.model_dir)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The token ids a prompt becomes (validated like a request's)."""
        with self._swap:
            self._check_open()
            return self._prompt_ids(prompt)

    def decode_text(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=False)

    def submit(self, prompt: str | list[int], sink, stats: Stats | None = None,
               cancel: threading.Event | None = None, **kw) -> Ticket:
        """Validate a request and queue it; `sink(item)` gets each round's token ids, then `scheduler.DONE` or the
        exception that ended it. Keep sink short (it runs between rounds); if it raises, the request is cancelled."""
        req = self._request(prompt, kw)
        ticket = Ticket(req, Stats() if stats is None else stats, sink, threading.Event() if cancel is None else cancel)
        self._scheduler.submit(ticket, self.config.serving.max_batch, self.config.serving.max_waiting)
        return ticket

    def _output(self, ids: list[int], stats: Stats) -> GenerationOutput:
        return GenerationOutput(text=self.decode_text(ids), token_ids=ids, finish_reason=stats.finish_reason,
                                stats=stats.to_dict())

    def generate(self, prompt: str | list[int], **kw) -> GenerationOutput:
        """Generate a completion. Unset arguments come from the config's `generation` section. The caller sleeps
        until the request ends: no thread wakes per round (on a 2-core machine a wake-up per token competes with
        the target's pool threads for the cores)."""
        stats, ids, ended, cancel = Stats(), [], threading.Event(), threading.Event()

        def sink(item) -> None:
            if item is DONE or isinstance(item, BaseException):
                ids.append(item)
                ended.set()
            else:
                ids.extend(item)

        self.submit(prompt, sink, stats, cancel, **kw)
        try:
            while not ended.wait(LOOP_POLL_S):
                if not self._scheduler.alive:
                    raise EngineClosedError(LOOP_DIED)
        except BaseException:  # KeyboardInterrupt too: the request leaves before its next round
            cancel.set()
            raise
        is_last(ids.pop())  # raises the exception that ended the request
        return self._output(ids, stats)

    def stream(self, prompt: str | list[int], stats: Stats | None = None, **kw) -> Iterator[str]:
        """An iterator of text pieces as rounds commit tokens (pass a Stats to read the statistics after); the request
        is validated when stream() is called, not at the first next()."""
        return Detokenizer(self.decode_text).pieces(self.stream_tokens(prompt, stats=stats, **kw))

    def stream_tokens(self, prompt: str | list[int], stats: Stats | None = None,
                      cancel: threading.Event | None = None, **kw) -> Iterator[list[int]]:
        """An iterator of each round's committed token ids (validated at once, like stream()). Closing it early, or
        setting `cancel` from any thread (a client gone), ends the request before its next round ("cancelled")."""
        items: queue.Queue = queue.Queue()
        cancel = cancel if cancel is not None else threading.Event()
        self.submit(prompt, items.put, stats, cancel, **kw)
        return Rounds(items, cancel, lambda: self._scheduler.alive)

    # -- asyncio (the server): the same requests, read from an asyncio queue instead of a thread's -------------
    async def astream_tokens(self, prompt: str | list[int], stats: Stats | None = None,
                             cancel: threading.Event | None = None, **kw) -> AsyncIterator[list[int]]:
        """An async iterator of each round's committed token ids, validated at once (like stream_tokens)."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        cancel = cancel if cancel is not None else threading.Event()
        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed: nobody reads this request any more
                cancel.set()

        self.submit(prompt, put, stats, cancel, **kw)
        return AsyncRounds(items, cancel, lambda: self._scheduler.alive)

    async def astream(self, prompt: str | list[int], stats: Stats | None = None, **kw) -> AsyncIterator[str]:
        """Async stream(): text pieces as rounds commit tokens."""
        return Detokenizer(self.decode_text).apieces(await self.astream_tokens(prompt, stats=stats, **kw))

    async def agenerate(self, prompt: str | list[int], **kw) -> GenerationOutput:
        """Async generate()."""
        stats = Stats()
        return self._output([t async for chunk in await self.astream_tokens(prompt, stats=stats, **kw)
                             for t in chunk], stats)

    # -- the scheduler's state, and the end --------------------------------------------------------------
    def batch_sizes(self) -> list[int]:
        """The batch size of each round since the last call (for metrics; the last 4096 rounds at most)."""
        sizes = self._scheduler.batch_sizes
        return [sizes.popleft() for _ in range(len(sizes))]

    def waiting_requests(self) -> int:
        """Requests queued for a place in the batch (serving.max_batch)."""
        return self._scheduler.waiting

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no request runs or waits and any re-placement between requests is done."""
        return self._scheduler.wait_idle(timeout_s)

    def close(self, wait_s: float = 10.0) -> None:
        """Release the draft (and shut the worker down). Running requests finish first (up to wait_s; otherwise the
        scheduler releases everything when they end); waiting ones and later calls fail. Safe to call twice."""
        self.closed = True
        if self._scheduler.stop(wait_s):
            self._finalizer()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
