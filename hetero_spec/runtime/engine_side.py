"""Glue between the Engine and the two-process runtime: CPU plan, supervisor, gate per request."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..config import Config
from ..draft.ngram import NgramProposer
from ..draft.select import StrategyChooser, prompt_window
from ..metrics import Stats
from ..scheduler import Request
from ..tuning.cost_model import CostModel
from ..tuning.gamma import GammaPolicy, Tuning
from ..tuning.gate import CostGate
from .pipelined import LocalSelection, decode_pipelined
from .supervisor import DraftSupervisor, WorkerSpec

if TYPE_CHECKING:  # the onnx target backend never imports torch
    from ..target.base import Verifier


log = logging.getLogger(__name__)


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def draft_cpus(config: Config) -> list[int] | None:
    cpus = _cpus()
    if not config.runtime.pin_cpus or len(cpus) < 2:
        return None
    n = min(config.draft.threads, len(cpus) - 1)
    return cpus[-n:]


class CpuPlan:
    """Sizes the target's threads to the cores the worker does not get; restore() undoes it. Only the
    torch backend has process-wide torch threads to restore (the onnx backend never imports torch)."""

    def __init__(self, config: Config):
        self._torch = config.target.backend == "torch"
        self._orig_cpus = set(_cpus())
        if self._torch:
            import torch

            self._orig_threads = torch.get_num_threads()
        self.threads = plan_cpus(config)
        # target.prefill_threads auto: the prompt is read on every core of this process (the worker's core
        # is mostly free meanwhile: its own prefill takes about a third of the target's)
        self.prefill_threads = len(self._orig_cpus)

    def restore(self) -> None:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self._orig_cpus)
        if self._torch:
            import torch

            torch.set_num_threads(self._orig_threads)


def plan_cpus(config: Config) -> int | None:
    """Size the target's torch threads to the cores the worker does not get; returns the thread count."""
    dc = draft_cpus(config)
    if dc is None:
        return config.target.threads
    target = [c for c in _cpus() if c not in dc]
    log.info("two_process: draft worker pinned to cpus %s; target uses %d torch thread(s)", dc, len(target))
    return config.target.threads or len(target)


def pin_threads(thread_ids: list[int], cpus: list[int]) -> int:
    """Move the given threads of this process (an engine's own ZeroMQ I/O and reaper threads) onto
    `cpus` (the worker's cores); returns how many moved.

    Every message wakes the I/O thread. Left to float, it lands on the target's compute core in the
    middle of a verification (measured on 2 cores: verification about 10 % slower); inheriting the
    target's pinning instead makes each send wait for a context switch (about 2 ms). On the worker's
    core it only takes short slices from drafting, which the worker has to spare. Only this engine's
    threads are touched (found when its context started), never another engine's."""
    moved = 0
    for tid in thread_ids:
        try:
            os.sched_setaffinity(tid, set(cpus))
            moved += 1
        except OSError:  # the thread is gone, or this system does not allow it
            continue
    return moved


@contextmanager
def pinned_thread(cpus: list[int] | None):
    """Pin the calling thread (only) to `cpus` for the duration; its old affinity comes back after."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    tid = threading.get_native_id()
    before = os.sched_getaffinity(tid)
    os.sched_setaffinity(tid, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(tid, before)


def max_msg_bytes(vocab_width: int, context_len: int, max_ahead_cap: int) -> int:
    """Largest frame either side may send: a prompt of context_len ids, or the distributions of up to
    max_ahead_cap draft tokens (sampled requests); with room for the header."""
    return max(4 * context_len, 4 * vocab_width * max_ahead_cap) + (1 << 16)


class PipelinedRuntime:
    """Owns the draft worker for an Engine in two_process mode. `launcher`, `clock` and `make_gate`
    are seams for tests (an in-memory worker, a fake clock, a gate held in one state)."""

    def __init__(self, config: Config, vocab_width: int, context_len: int = 1 << 16, launcher=None,
                 clock=time.monotonic, tuning: Tuning | None = None):
        r, d = config.runtime, config.draft
        self.config = config
        self.tuning = tuning or Tuning()
        self.clock = clock
        self.make_gate = lambda: CostGate(enabled=r.gate.enabled, probe_interval_s=r.gate.probe_interval_s,
                                          tuning=self.tuning, clock=clock)
        self._gate: CostGate | None = None  # one gate for every request (made by make_gate, a test seam)
        self._gate_maker = None
        self.draft_cpus = draft_cpus(config)
        self.target_cpus = [c for c in _cpus() if c not in self.draft_cpus] if self.draft_cpus else None
        cap = r.max_ahead or 2 * 64 + 1  # gamma <= 64 (speculation.gamma)
        self.sup = DraftSupervisor(WorkerSpec(
            model=d.model, providers=d.providers, threads=d.threads, vocab_width=vocab_width,
            transport=r.transport, host=r.host, port=r.port, curve=r.curve, curve_keys=r.curve_keys,
            cpus=self.draft_cpus, ready_timeout_s=r.ready_timeout_s, heartbeat_s=r.heartbeat_s,
            restart_backoff_s=r.restart_backoff_s, delay_ms=r.test_draft_delay_ms,
            prompt_window=prompt_window(d.prompt_window, d.candidates, "two_process"),
            max_msg_bytes=max_msg_bytes(vocab_width, context_len, cap)), launcher=launcher, clock=clock)
        if self.draft_cpus and hasattr(os, "sched_setaffinity"):
            pin_threads(self.sup.thread_ids, self.draft_cpus)
        # draft.candidates: chosen per round among the worker's model and a target-side n-gram lookup; the
        # choice learns across requests, like the gate
        self.chooser = StrategyChooser(
            list(d.candidates), self._selection_model, prior_acceptance=self.tuning.prior_acceptance,
            layouts={"onnx": "two_process"}, cost_fns={"onnx": self._worker_token_s}) if d.candidates else None
        self.sup.start()

    def _worker_token_s(self) -> float | None:
        """The worker's drafting time per token, as its proposals report it (None before any)."""
        return self._gate.draft_tok_s.value if self._gate is not None else None

    def _selection_model(self) -> CostModel | None:
        """The cost model draft selection predicts with: the learned (or profiled) verify line, the
        worker's measured draft and transfer costs. None until the verify line is known."""
        line = self.tuning.verify_line()
        if line is None:
            return None
        d = self._worker_token_s() or self.tuning.draft_token_s or 0.0
        transfer = (self._gate.transfer_s.value if self._gate is not None else None) or 0.0
        return CostModel(line[0], line[1], d, transfer)

    def decode(self, target: Verifier, req: Request, stats: Stats, pin: bool = True):
        """The decode loop's thread runs on the target's cores while it serves the request (pin: False when the
        caller pins it, e.g. around requests that take turns in one thread)."""
        r = self.config.runtime
        # gamma auto: chosen each round by decode_pipelined; the worker starts at the gamma the cost model
        # predicts now, and may draft ahead as far as the largest gamma allows
        policy = GammaPolicy(self.tuning, "two_process", fixed=req.gamma if isinstance(req.gamma, int) else None)
        if policy.fixed is None:
            model = self.tuning.model()
            start = model.best_gamma(policy.estimate(), "two_process", policy.g_max)[0] if model else 4
            req = dataclasses.replace(req, gamma=max(1, start))
        max_ahead = r.max_ahead or 2 * (req.gamma if policy.fixed is not None else policy.g_max) + 1
        if self._gate is None or self._gate_maker is not self.make_gate:
            self._gate, self._gate_maker = self.make_gate(), self.make_gate
        # greedy and coupled: acceptance is token equality, so a probe measures it against the target's own tokens
        self._gate.begin_request(shadow=req.params.greedy or req.params.coupled)
        selection = None
        if self.chooser is not None:
            ng = self.config.draft.ngram
            selection = LocalSelection(self.chooser, NgramProposer(max_n=ng.max_n, min_n=ng.min_n)
                                       if "ngram" in self.chooser.names else None)
            if selection.ngram is not None:
                selection.ngram.begin(req.prompt_ids, req.params)
        with pinned_thread(self.target_cpus if pin else None):
            yield from decode_pipelined(target, self.sup, req, stats, self._gate, max_ahead,
                                        trace=r.trace, clock=self.clock, policy=policy, selection=selection)

    def close(self) -> None:
        self.sup.close()
