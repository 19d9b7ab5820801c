"""Glue between the Engine and the two-process runtime: CPU plan, supervisor, gate per request."""

from __future__ import annotations

import logging
import os

from ..config import Config
from ..metrics import Stats
from ..scheduler import Request
from ..target.verifier import TargetModel
from ..tuning.gate import CostGate
from .pipelined import decode_pipelined
from .supervisor import DraftSupervisor, WorkerSpec

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
    """Pins this (target) process to the cores the worker does not get, and undoes it on restore()."""

    def __init__(self, config: Config):
        import torch

        self._orig_cpus = set(_cpus())
        self._orig_threads = torch.get_num_threads()
        self.threads = plan_cpus(config)

    def restore(self) -> None:
        import torch

        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self._orig_cpus)
        torch.set_num_threads(self._orig_threads)


def plan_cpus(config: Config) -> int | None:
    """Size the target's torch threads to the cores the worker does not get; returns the thread count.

    Only the worker is pinned. Pinning the target process too would also pin ZeroMQ's I/O thread onto
    the target's compute core, and every send would then wait for a context switch (measured: ~2 ms per
    send on this 2-core machine). The target's compute thread lands on the free core by itself."""
    dc = draft_cpus(config)
    if dc is None:
        return config.target.threads
    target = [c for c in _cpus() if c not in dc]
    log.info("two_process: draft worker pinned to cpus %s; target uses %d torch thread(s)", dc, len(target))
    return config.target.threads or len(target)


class PipelinedRuntime:
    """Owns the draft worker for an Engine in two_process mode."""

    def __init__(self, config: Config, vocab_width: int):
        r, d = config.runtime, config.draft
        self.config = config
        self.sup = DraftSupervisor(WorkerSpec(
            model=d.model, providers=d.providers, threads=d.threads, vocab_width=vocab_width,
            transport=r.transport, host=r.host, port=r.port, curve=r.curve, cpus=draft_cpus(config),
            ready_timeout_s=r.ready_timeout_s, heartbeat_s=r.heartbeat_s,
            restart_backoff_s=r.restart_backoff_s, delay_ms=r.test_draft_delay_ms))
        self.sup.start()

    def decode(self, target: TargetModel, req: Request, stats: Stats):
        r = self.config.runtime
        gate = CostGate(enabled=r.gate.enabled, probe_interval_s=r.gate.probe_interval_s)
        max_ahead = r.max_ahead or 2 * req.gamma
        return decode_pipelined(target, self.sup, req, stats, gate, max_ahead, trace=r.trace)

    def close(self) -> None:
        self.sup.close()
