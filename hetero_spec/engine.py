"""The public, embeddable API.

    from hetero_spec import Engine
    with Engine.from_config("configs/cpu-demo.yaml", overrides={"speculation.gamma": 4}) as eng:
        out = eng.generate("def parse(", max_new_tokens=64, temperature=0.0, seed=0)
        print(out.text, out.token_ids, out.stats)
        for piece in eng.stream("def parse(", max_new_tokens=64):
            print(piece, end="")
"""

from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import Config, load_config
from .preflight import check_paths
from .errors import ConfigError, EngineClosedError, VocabMismatchError
from .gguf_source import resolve as resolve_gguf
from .metrics import Stats
from .sampling import SamplingParams
from .scheduler import Request, check_request
from .target.backends import choose_backend, load_target
from .tuning.profile import load_tuning
from .validation import check_stop_ids, prompt_token_ids, request_args

if TYPE_CHECKING:
    from .scheduler import Ticket

log = logging.getLogger("hetero_spec")


@dataclass
class GenerationOutput:
    """Result of `Engine.generate`. token_ids holds the generated ids only (not the prompt)."""

    text: str
    token_ids: list[int]
    stats: dict[str, Any]
    finish_reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats}


def _tokenizer_vocab(model_dir: Path) -> dict[str, int] | None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def check_vocab(target_dir: Path, draft_dir: Path, source: str = "<config>") -> None:
    """The draft must emit the same token ids as the target: same tokenizer vocabulary.

    Logit widths may differ (transformers pads some vocabularies); what matters is the ids the
    tokenizers define. A draft directory without a tokenizer.json cannot be checked and is trusted.
    The error names the config (source), both keys and, in plain words, which tokens differ.
    """
    tv, dv = _tokenizer_vocab(target_dir), _tokenizer_vocab(draft_dir)
    if tv is None or dv is None or tv == dv:
        return
    raise VocabMismatchError(f"{source}: draft.model = {str(draft_dir)!r}: its tokenizer differs from the one "
                             f"of target.model ({target_dir}): {_vocab_diff(tv, dv)}; the draft must use "
                             "the target's tokenizer")


def _vocab_diff(tv: dict[str, int], dv: dict[str, int], examples: int = 3) -> str:
    """Sizes when they differ, then the first few tokens (by target id) whose ids differ."""
    out = [] if len(tv) == len(dv) else [f"the target's has {len(tv)} tokens, the draft's {len(dv)}"]
    diffs = []
    for tok, i in sorted(tv.items(), key=lambda kv: kv[1]):
        j = dv.get(tok)
        if j != i:
            where = "missing from the draft's" if j is None else f"id {j} in the draft's"
            diffs.append(f"token {tok!r} is id {i} in the target's tokenizer but {where}")
    diffs += [f"token {tok!r} is id {j} in the draft's tokenizer but missing from the target's"
              for tok, j in sorted(dv.items(), key=lambda kv: kv[1]) if tok not in tv]
    if diffs:
        out.append(f"{len(diffs)} tokens differ, e.g. " + "; ".join(diffs[:examples]))
    return "; ".join(out)


def _release(parts: dict[str, Any]) -> None:
    """Shut down what an Engine holds: the request loop, the draft, the worker process, the CPU plan. Runs once
    (it is the Engine's weakref finalizer), from close(), garbage collection, or interpreter exit."""
    if parts.get("scheduler") is not None:
        parts["scheduler"].stop()
    if parts.get("source") is not None:
        parts["source"].close()
    if parts.get("cpu_plan") is not None:
        parts["cpu_plan"].restore()
    parts.clear()


class Detokenizer:
    """Incremental detokenization (as vLLM does): decode only from prefix_off, so each round costs O(round)
    instead of re-decoding the whole output. ids[prefix_off:read_off] has been emitted. Text that ends in an
    incomplete UTF-8 sequence waits for the next tokens (unless final)."""

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
        return text[len(prefix):] if len(text) > len(prefix) else ""


class Engine:
    """Speculative decoding engine: a target (PyTorch or ONNX Runtime backend) verifying proposals of a draft.

    Thread-safe: `generate`/`stream` may be called from many threads; requests queue and are decoded
    together (serving.max_batch). `close()` (or leaving a `with` block, or dropping the Engine) shuts the draft worker down.
    """

    def __init__(self, config: Config, controller=None):
        """controller: a factory of the speculation controller, called as tuning/controller.Controller is
        (tests hold it in one state); None: the Controller."""
        self._make_controller = controller
        self._draft_checked: Config | None = None
        self._check_draft(config)  # preflight: fail on paths, host, providers, vocabulary before loading
        config = resolve_gguf(config)  # a GGUF target.model / draft.model: its Hugging Face conversion (cached)
        self._check_draft(config)  # the converted directories (the vocabulary); a no-op when nothing changed
        choice = choose_backend(config.target, config.blame("target.model"))
        if choice.backend != config.target.backend:
            config = config.model_copy(deep=True)
            config.target.backend = choice.backend
        log.info("target backend: %s (%s)", choice.backend, choice.reason)
        # what gamma: auto learns across requests (acceptance, costs), seeded by a profile if one is given
        self.tuning = load_tuning(config.speculation.profile, source=config.blame("speculation.profile"))
        config = self._resolve_precision(config, choice.backend)
        if config.serving.max_batch == "auto":
            config = config.model_copy(deep=True)
            config.serving.max_batch = self.tuning.recommended_batch or 8
            log.info("serving.max_batch auto: %d (%s)", config.serving.max_batch,
                     "the profile's recommendation" if self.tuning.recommended_batch else "no profile: the default")
        #: runtime.mode / runtime.cpus auto: the layout chosen by measurement, with every candidate's prediction;
        #: "switches" lists the re-placements made once the draft's acceptance was known (_replace)
        self.placement: dict[str, Any] = {}
        self._auto_config = config if config.runtime.mode == "auto" or config.runtime.cpus == "auto" else None
        self._replacer = None  # runtime.mode / runtime.cpus auto: tuning/placement.Replacer
        self._progress_at = time.monotonic()  # the request loop's last sign of life (health while busy)
        if self._auto_config is not None:
            from .tuning.placement import Replacer, resolve

            config, self.placement = resolve(config, self.tuning.prior_acceptance)
            self._seed_tuning()
            self.placement["switches"] = []
            self._replacer = Replacer(self._auto_config, self.placement)
        # Held by the scheduler's loop for each round: health probes the models only when it can take it
        self.lock = threading.Lock()
        # Held while a re-placement swaps the models: a caller validating a request waits for the new target
        self._swap = threading.Lock()
        self.closed = False
        # What close() releases; also released when the Engine is garbage-collected or at exit.
        self._parts: dict[str, Any] = {}
        self._finalizer = weakref.finalize(self, _release, self._parts)
        try:
            self._build(config)
        except BaseException:
            self._finalizer()
            raise
        from .scheduler import Scheduler

        self._scheduler = self._parts["scheduler"] = Scheduler(self)

    def _resolve_precision(self, config: Config, backend: str) -> Config:
        """target.precision (or its alias dtype) checked for the backend and made explicit (auto: see
        precision.resolve_auto); a Hugging Face draft with draft.precision replaced by its cached export."""
        from .precision import check_target, resolve_auto, resolve_draft
        from .target.backends import _device_is_cuda

        config = resolve_auto(config, self.tuning.recommended_precision)
        p = check_target(config, backend, _device_is_cuda(config.target.device) if backend == "torch" else False)
        if config.target.precision != p:
            config = config.model_copy(deep=True)
            config.target.precision = p
        return resolve_draft(config)

    def _build(self, config: Config) -> None:
        """Load the target and start the draft source (in process, or the worker) for a resolved config."""
        self.config = config
        log.info("resolved config (%s): %s", config.source, config.model_dump_json())
        self.source = None
        self.loop_cpus: list[int] | None = None  # the loop thread's cores (two_process: the target's)
        threads = config.target.threads
        cpu_plan = None
        if config.runtime.mode == "two_process":
            from .runtime.cpus import CpuPlan

            cpu_plan = self._parts["cpu_plan"] = CpuPlan(config)
            threads = cpu_plan.threads
        # ONNX Runtime's pool threads do not spin after a run unless target.spin: on a busy machine spinning
        # measured much slower, on an idle one faster (docs/configuration.md, target.spin)
        prefill = config.target.prefill_threads
        if prefill == "auto":
            prefill = cpu_plan.prefill_threads if cpu_plan is not None else None
        self.target = load_target(config.target, threads, spin=config.target.spin, prefill_threads=prefill)
        self.tokenizer = self.target.tokenizer
        self.target.enable_batching(config.serving.max_batch)
        from .tuning.controller import Controller

        self.controller = (self._make_controller or Controller)(self.tuning, "two_process" if config.runtime.mode == "two_process"
                                     else "in_process", self.target.batch_blocks, config.serving.mode)
        self.source = self._parts["source"] = self._make_source(config)

    #: a request decoded alone, with at least this many new tokens, tells the placement the layout's real goodput
    OBSERVE_MIN_TOKENS = 16

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

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no request runs or waits and any re-placement between requests is done."""
        return self._scheduler.wait_idle(timeout_s)

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
        from .tuning import placement as pl

        log.info("placement: switching layout; %s", why)
        old = self.config
        self._teardown()  # the old target goes first: never two targets in memory
        self.tuning.reset_costs()
        try:
            self._build(pl.apply(self._auto_config, best))
        except Exception:  # the new layout would not start: back to the one that ran
            log.exception("placement: %s failed to start; keeping the layout that ran", best.label())
            self._teardown()
            self._build(old)
            self._seed_tuning()
            return
        self._replacer.switched(best, why, rows, self.tuning.acceptance.tested)
        self._seed_tuning()

    def _seed_tuning(self) -> None:
        """The placement measured the chosen layout's costs: gamma auto starts from them (no exploration)."""
        from .tuning.placement import Costs, Layout

        if self.placement.get("costs") is None or self.tuning.profile is not None:
            return
        lay = Layout(**self.placement["chosen"])
        costs = Costs.from_dict(self.placement["costs"])
        if lay.target_threads in costs.verify and lay.draft_threads in costs.draft_token_s:
            self.tuning.seed_costs(costs.model(lay))

    def _teardown(self) -> None:
        """Release the draft source (and its worker), the CPU plan and the target (the Engine stays open)."""
        for key in ("source", "cpu_plan"):
            part = self._parts.pop(key, None)
            if part is None:
                continue
            if key == "cpu_plan":
                part.restore()
            else:
                part.close()
        self.source = self.target = None
        import gc

        gc.collect()  # the target's weights go now, before the next target loads

    @classmethod
    def from_config(cls, config: str | Path | Config | dict,
                    overrides: dict[str, Any] | None = None, controller=None) -> Engine:
        """Build from a YAML path, a Config, or a raw dict; overrides are dotted keys ("speculation.gamma")."""
        if isinstance(config, Config):
            if overrides:
                from .config import build_config

                config = build_config(config.model_dump(mode="json"), source=config.source, overrides=overrides)
            return cls(config, controller)
        if isinstance(config, dict):
            from .config import build_config

            return cls(build_config(config, overrides=overrides), controller)
        return cls(load_config(config, overrides=overrides), controller)

    def _make_source(self, config: Config):
        """The draft source of a built config: the worker (two_process), a selection among candidates
        (draft.candidates), one local proposer kind, or None (draft.kind none)."""
        d, slots = config.draft, config.serving.max_batch
        if d.kind == "ngram" and d.ngram.min_n > d.ngram.max_n:
            raise ConfigError(config.source, "draft.ngram.min_n", d.ngram.min_n,
                              f"must be <= draft.ngram.max_n ({d.ngram.max_n})")
        if config.runtime.mode == "two_process":
            from .runtime.worker_source import WorkerSource

            self._check_draft(config)
            worker = WorkerSource(config, self.target.vocab_width, context_len=self.target.context_len,
                                  max_streams=slots)
            self.loop_cpus = worker.target_cpus
            cands = {"onnx": worker, **({"ngram": self._local(config, "ngram", slots)}
                                        if "ngram" in d.candidates else {})}
        elif d.candidates:
            cands = {kind: self._local(config, kind, slots) for kind in d.candidates}
        else:
            return self._local(config, d.kind, slots)
        if not d.candidates:
            return cands["onnx"]
        from .draft.source import SelectingSource

        return SelectingSource({k: c for k, c in cands.items() if c is not None}, self.controller.selection,
                               names=[n for n in d.candidates if n in cands])

    def _local(self, config: Config, kind: str, slots: int):
        if kind == "none":
            return None
        from .draft.source import LocalSource

        if kind == "ngram":
            from .draft.ngram import NgramProposer

            return LocalSource(NgramProposer(max_n=config.draft.ngram.max_n, min_n=config.draft.ngram.min_n))
        from .draft.onnx_drafter import OnnxDrafter
        from .draft.select import prompt_window

        d = config.draft
        self._check_draft(config)
        return LocalSource(OnnxDrafter(d.model, providers=d.providers, threads=d.threads,
                                       vocab_width=self.target.vocab_width, spin=False,
                                       prompt_window=prompt_window(d.prompt_window, d.candidates, "in_process")),
                           slots=slots)

    def _check_draft(self, config: Config) -> None:
        """Preflight, before anything heavy loads (the target takes seconds to minutes): model paths, the
        worker's TCP bind address, the draft's execution providers and vocabulary. Runs once per config;
        the calls after the target has loaded find it done."""
        if self._draft_checked is config:
            return
        check_paths(config)
        rt = config.runtime
        if rt.mode != "in_process" and rt.transport == "tcp":
            from .transport.channel import check_bind_host

            why = check_bind_host(rt.host, rt.curve_keys is not None)
            if why:
                raise ConfigError(config.blame("runtime.host"), "runtime.host", rt.host, why)
        if rt.mode != "in_process" and rt.curve_keys is not None:
            from .transport.channel import CurveKeys

            try:
                CurveKeys.load(rt.curve_keys)
            except (OSError, ValueError) as exc:
                raise ConfigError(config.blame("runtime.curve_keys"), "runtime.curve_keys", str(rt.curve_keys),
                                  f"cannot read the CURVE keys ({exc}); make them with `hetero-spec keys --out DIR`"
                                  ) from None
        if config.draft.kind == "onnx":
            from .onnx_decoder import check_providers

            check_providers(config.draft.providers, source=config.blame("draft.providers"))
            check_vocab(config.target.model, config.draft.model, source=config.blame("draft.model"))
        self._draft_checked = config

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("this Engine is closed; create a new one (Engine.from_config)")

    def _submit(self, req: Request, stats: Stats, cancel: threading.Event | None, sink) -> Ticket:
        from .scheduler import Ticket

        self._check_open()
        ticket = Ticket(req, stats, sink, cancel if cancel is not None else threading.Event())
        self._scheduler.submit(ticket, self.config.serving.max_batch, self.config.serving.max_waiting)
        return ticket

    def _decode(self, req: Request, stats: Stats, cancel: threading.Event | None = None) -> Iterator[list[int]]:
        """Submit the request to the scheduler and yield its rounds' tokens. `cancel` set (a client gone), or
        the iterator closed early: the request leaves the batch before its next round, freeing its state."""
        from .scheduler import is_last

        items: queue.Queue = queue.Queue()
        ticket = self._submit(req, stats, cancel, items.put)
        item = None
        try:
            while not is_last(item := items.get()):
                yield item
        finally:
            if item is None or isinstance(item, list):  # left before the end: the request stops
                ticket.cancel.set()

    def health(self, timeout_s: float | None = None) -> dict:
        """Real probes when the Engine is idle: the target answers a one-token forward, the draft worker a
        ping. While a request runs, the probes would disturb it, so the answer comes from what the
        request loop knows (the worker process alive and heard from within the heartbeat).
        `draft_restarts`/`draft_failures` are running totals over the Engine's life. The worker must answer
        within timeout_s (default: runtime.heartbeat_s), else it is reported unresponsive."""
        self._check_open()
        locked = self.lock.acquire(blocking=False)
        if not locked or self._scheduler.running:
            # a round is on, or requests run between rounds (two_process: their proposals share the worker's
            # channel, which a ping would read): the request loop reports each round, and silent longer than the
            # heartbeat means stuck
            if locked:
                self.lock.release()
            stalled = time.monotonic() - self._progress_at
            limit = timeout_s or self.config.runtime.heartbeat_s
            return {"target": "ok" if stalled <= max(limit, 1.0) else "stalled", "busy": True,
                    "since_last_round_s": round(stalled, 3), **self._draft_health(probe=False)}
        try:
            t = time.perf_counter()
            state = self.target.new_state()
            try:
                self.target.verify(state, 0, [], True)  # a one-token pass on an empty cache
            finally:
                self.target.release_state(state)
            return {"target": "ok", "busy": False, "target_step_ms": round((time.perf_counter() - t) * 1e3, 3),
                    **self._draft_health(probe=True, timeout_s=timeout_s)}
        finally:
            self.lock.release()

    def _draft_health(self, probe: bool, timeout_s: float | None = None) -> dict[str, Any]:
        if self.source is None:
            return {"draft": "none"}
        return self.source.health(probe, timeout_s)

    # -- requests ----------------------------------------------------------------------------------
    def _request(self, prompt: str | list[int], max_new_tokens: int | None, temperature: float | None,
                 top_k: int | None, top_p: float | None, seed: int | None,
                 stop_token_ids: list[int] | None, gamma: int | None) -> Request:
        """Validate a request (each argument like the config field it overrides; None takes the config's
        value) and tokenize its prompt. RequestError names the argument and the value."""
        with self._swap:
            return self._resolve(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, gamma)

    def _resolve(self, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, gamma) -> Request:
        self._check_open()
        g = self.config.generation
        a = request_args(self.config, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                         top_p=top_p, seed=seed, stop_token_ids=stop_token_ids, gamma=gamma)
        vocab = self.target.vocab_width
        if [t for t in g.stop_token_ids if t >= vocab]:
            raise ConfigError(self.config.blame("generation.stop_token_ids"), "generation.stop_token_ids",
                              g.stop_token_ids,
                              f"ids outside the target's vocabulary [0, {vocab})")
        if stop_token_ids is not None:
            check_stop_ids(a["stop_token_ids"], vocab)
        prompt_ids = prompt_token_ids(prompt, self.tokenizer, self.target.vocab_width, self.target.model_dir)
        temperature, top_k, top_p = a["temperature"], a["top_k"], a["top_p"]
        seed = a["seed"] if a["seed"] is not None else secrets.randbits(48)
        params = SamplingParams(temperature=temperature, top_k=g.top_k if top_k is None else int(top_k),
                                top_p=top_p, seed=int(seed), sampling=self.config.speculation.sampling)
        stops = set(self.target.eos_token_ids) | set(g.stop_token_ids) | set(a["stop_token_ids"])
        req = Request(prompt_ids=prompt_ids, max_new_tokens=a["max_new_tokens"], params=params,
                      gamma=a["gamma"], stop_ids=frozenset(stops))
        check_request(req, self.target.context_len)  # an over-long prompt fails here, before anything streams
        return req

    def decode_text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def generate(self, prompt: str | list[int], max_new_tokens: int | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, stop_token_ids: list[int] | None = None,
                 gamma: int | None = None) -> GenerationOutput:
        """Generate a completion. Unset arguments come from the config's `generation` section."""
        req = self._request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, gamma)
        stats = Stats()
        ids: list[int] = []
        for chunk in self._decode(req, stats):
            ids.extend(chunk)
        return GenerationOutput(text=self.decode_text(ids), token_ids=ids, stats=stats.to_dict(),
                                finish_reason=stats.finish_reason)

    def stream(self, prompt: str | list[int], max_new_tokens: int | None = None,
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None, stop_token_ids: list[int] | None = None,
               gamma: int | None = None, stats: Stats | None = None) -> Iterator[str]:
        """An iterator of text pieces as rounds commit tokens. Pass a Stats object to read the statistics
        after. The request is validated here, when stream() is called (RequestError at once, before any
        output), not at the iterator's first next()."""
        stats = stats if stats is not None else Stats()
        chunks = self.stream_tokens(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                                    gamma, stats)

        def pieces() -> Iterator[str]:
            detok = Detokenizer(self.decode_text)
            for chunk in chunks:
                piece = detok.add(chunk, final=bool(stats.finish_reason))
                if piece:
                    yield piece

        return pieces()

    def stream_tokens(self, prompt: str | list[int], max_new_tokens: int | None = None,
                      temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                      seed: int | None = None, stop_token_ids: list[int] | None = None,
                      gamma: int | None = None, stats: Stats | None = None,
                      cancel: threading.Event | None = None) -> Iterator[list[int]]:
        """An iterator of each round's committed token ids (validated at once, like stream()). Closing it
        early, or setting `cancel` from any thread (a client gone), ends the request before its next round
        (finish_reason "cancelled") and frees the Engine for the next one."""
        req = self._request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, gamma)
        return self._decode(req, stats if stats is not None else Stats(), cancel)

    def submit(self, prompt: str | list[int], sink, stats: Stats | None = None,
               cancel: threading.Event | None = None, **kwargs) -> Ticket:
        """The request scheduler's own interface: validate a request (keyword arguments as generate's) and queue
        it; `sink(item)` is then called from the scheduler's thread with each round's token ids, and last with
        `scheduler.DONE` or the exception that ended it. Keep sink short (it runs between rounds); if it raises,
        nobody listens any more: the request is cancelled (the others go on)."""
        req = self._request(prompt, kwargs.pop("max_new_tokens", None), kwargs.pop("temperature", None),
                            kwargs.pop("top_k", None), kwargs.pop("top_p", None), kwargs.pop("seed", None),
                            kwargs.pop("stop_token_ids", None), kwargs.pop("gamma", None))
        if kwargs:
            raise TypeError(f"submit() got unexpected keyword arguments: {', '.join(sorted(kwargs))}")
        return self._submit(req, stats if stats is not None else Stats(), cancel, sink)

    # -- asyncio (the server): the same requests, read from an asyncio queue instead of a thread's -------------
    async def astream_tokens(self, prompt: str | list[int], max_new_tokens: int | None = None,
                             temperature: float | None = None, top_k: int | None = None,
                             top_p: float | None = None, seed: int | None = None,
                             stop_token_ids: list[int] | None = None, gamma: int | None = None,
                             stats: Stats | None = None, cancel: threading.Event | None = None):
        """An async iterator of each round's committed token ids, validated at once (like stream_tokens).
        Leaving the iteration early (a client gone) cancels the request before its next round."""
        from .scheduler import is_last

        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        ticket = self.submit(prompt, lambda item: loop.call_soon_threadsafe(items.put_nowait, item),
                             stats=stats, cancel=cancel, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, seed=seed, stop_token_ids=stop_token_ids, gamma=gamma)

        async def rounds():
            item = None
            try:
                while not is_last(item := await items.get()):
                    yield item
            finally:
                if item is None or isinstance(item, list):  # left before the end: the request stops
                    ticket.cancel.set()

        return rounds()

    async def astream(self, prompt: str | list[int], stats: Stats | None = None, **kwargs):
        """Async stream(): text pieces as rounds commit tokens (keyword arguments as generate's)."""
        stats = stats if stats is not None else Stats()
        chunks = await self.astream_tokens(prompt, stats=stats, **kwargs)

        async def pieces():
            detok = Detokenizer(self.decode_text)
            async for chunk in chunks:
                piece = detok.add(chunk, final=bool(stats.finish_reason))
                if piece:
                    yield piece

        return pieces()

    async def agenerate(self, prompt: str | list[int], **kwargs) -> GenerationOutput:
        """Async generate() (keyword arguments as generate's)."""
        stats = Stats()
        ids: list[int] = []
        async for chunk in await self.astream_tokens(prompt, stats=stats, **kwargs):
            ids.extend(chunk)
        return GenerationOutput(text=self.decode_text(ids), token_ids=ids, stats=stats.to_dict(),
                                finish_reason=stats.finish_reason)

    def batch_sizes(self) -> list[int]:
        """The batch size of each round since the last call (for metrics; the last 4096 rounds at most)."""
        sizes = self._scheduler.batch_sizes
        return [sizes.popleft() for _ in range(len(sizes))]

    def waiting_requests(self) -> int:
        """Requests queued for a place in the batch (serving.max_batch)."""
        return self._scheduler.waiting

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The token ids a prompt becomes (validated like a request's)."""
        with self._swap:
            return prompt_token_ids(prompt, self.tokenizer, self.target.vocab_width, self.target.model_dir)

    def close(self, wait_s: float = 10.0) -> None:
        """Release the draft; in two_process mode shut the worker down cleanly (no orphans). Running requests
        finish first (up to wait_s; otherwise the scheduler releases everything when they end); waiting ones
        fail with EngineClosedError, as do later calls. Safe to call twice."""
        self.closed = True
        if self._scheduler.stop(wait_s):
            self._finalizer()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
