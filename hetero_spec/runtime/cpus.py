"""CPU placement of the two-process layout: which cores the draft worker gets, the target's threads on the
rest, and pinning of this process's threads."""

import logging
import os
from contextlib import contextmanager, suppress

from ..config import Config

log = logging.getLogger(__name__)


def allowed() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def draft_cpus(config: Config) -> list[int] | None:
    cpus = allowed()
    if not config.runtime.pin_cpus or len(cpus) < 2:
        return None
    return cpus[-min(config.draft.threads, len(cpus) - 1):]


class CpuPlan:
    """Sizes the target's threads to the cores the worker does not get; restore() undoes it. Only the
    torch backend has process-wide torch threads to restore (the onnx backend never imports torch)."""

    def __init__(self, config: Config):
        self._torch = config.target.backend == "torch"
        self._orig_cpus = set(allowed())
        if self._torch:
            import torch
            self._orig_threads = torch.get_num_threads()
        self.threads = config.target.threads
        if (worker_cpus := draft_cpus(config)) is not None:
            spare = len(self._orig_cpus - set(worker_cpus))  # the cores left to the target
            log.info("two_process: draft worker pinned to cpus %s; target uses %d torch thread(s)", worker_cpus, spare)
            self.threads = self.threads or spare
        # target.prefill_threads auto: the prompt is read on every core (docs/features-two-process.md)
        self.prefill_threads = len(self._orig_cpus)

    def restore(self) -> None:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self._orig_cpus)
        if self._torch:
            import torch
            torch.set_num_threads(self._orig_threads)


def pin_threads(thread_ids: list[int], cpus: list[int]) -> int:
    """Move the given threads of this process (an engine's own ZeroMQ I/O and reaper threads, found when its context
    started) onto `cpus` (the worker's cores); returns how many moved. Why: docs/features-two-process.md#design."""
    moved = 0
    for tid in thread_ids:
        with suppress(OSError):  # the thread is gone, or this system does not allow it
            os.sched_setaffinity(tid, set(cpus))
            moved += 1
    return moved


@contextmanager
def pinned_thread(cpus: list[int] | None):
    """Pin the calling thread (only) to `cpus` for the duration; its old affinity comes back after."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)  # on Linux, pid 0 is the calling thread
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
