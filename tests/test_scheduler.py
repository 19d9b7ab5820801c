"""The decode loop's own promises (scheduler.py): one request's failure is its own, a finished request never
waits on the Engine's between-requests work, the queue is bounded, request ids are a counter. Deterministic:
batches are formed while the test holds the round lock (tests/test_batch.held), never by timing."""

from __future__ import annotations

import threading

import pytest

from hetero_spec import Engine
from hetero_spec.errors import QueueFullError
from hetero_spec.metrics import Stats
from tests.conftest import hf_greedy
from tests.test_batch import PROMPTS, Collect, _cfg, held


def test_a_sink_that_raises_cancels_only_its_request(llama_target):
    """A caller's sink raising anything (not only RuntimeError) cancels that request; the batch goes on."""
    with Engine.from_config(_cfg(llama_target, None)) as eng:
        stats = [Stats() for _ in range(3)]

        def broken(item):
            raise ValueError("the caller's code is broken")

        sinks = [Collect(), broken, Collect()]
        with held(eng):
            for p, sink, st in zip(PROMPTS[:3], sinks, stats):
                eng.submit(p, sink, stats=st, max_new_tokens=8)
        assert sinks[0].wait() == hf_greedy(llama_target, PROMPTS[0], 8)
        assert sinks[2].wait() == hf_greedy(llama_target, PROMPTS[2], 8)
        assert eng.wait_idle(120)
        assert stats[1].finish_reason == "cancelled" and stats[1].new_tokens < 8


def test_a_row_that_fails_fails_only_its_request(monkeypatch, llama_target, llama_copy_onnx):
    """An error while one row is accepted and committed reaches only that request; the others finish with their
    solo output, and the Engine serves the next request."""
    from hetero_spec import scheduler

    real = scheduler.decide_block

    def decide(target, state, params, ids, draft, out):
        if ids[:len(PROMPTS[1])] == PROMPTS[1] and len(ids) > len(PROMPTS[1]) + 2:
            raise RuntimeError("a broken row")
        return real(target, state, params, ids, draft, out)

    with Engine.from_config(_cfg(llama_target, llama_copy_onnx)) as eng:
        solo = [eng.generate(p, max_new_tokens=10, gamma=2).token_ids for p in PROMPTS[:3]]
        monkeypatch.setattr(scheduler, "decide_block", decide)
        sinks = [Collect() for _ in range(3)]
        with held(eng):
            for p, sink in zip(PROMPTS[:3], sinks):
                eng.submit(p, sink, max_new_tokens=10, gamma=2)
        assert sinks[0].wait() == solo[0] and sinks[2].wait() == solo[2]
        assert sinks[1].done.wait(120) and isinstance(sinks[1].error, RuntimeError)
        monkeypatch.setattr(scheduler, "decide_block", real)
        assert eng.generate(PROMPTS[1], max_new_tokens=10, gamma=2).token_ids == solo[1]


def test_the_waiting_queue_is_bounded(llama_target):
    """serving.max_waiting: beyond the batch and that many waiting, a request is refused at once (QueueFullError),
    and the ones accepted all finish."""
    cfg = {**_cfg(llama_target, None, max_batch=1), "serving": {"max_batch": 1, "max_waiting": 1}}
    with Engine.from_config(cfg) as eng:
        sinks = [Collect(), Collect()]
        with held(eng):
            for p, sink in zip(PROMPTS, sinks):
                eng.submit(p, sink, max_new_tokens=4)
            with pytest.raises(QueueFullError, match="serving.max_waiting = 1"):
                eng.submit(PROMPTS[2], Collect(), max_new_tokens=4)
        assert [s.wait() for s in sinks] == [hf_greedy(llama_target, p, 4) for p in PROMPTS[:2]]
        assert eng.generate(PROMPTS[2], max_new_tokens=4).token_ids == hf_greedy(llama_target, PROMPTS[2], 4)


def test_a_finished_request_hears_done_before_the_between_requests_work_which_may_fail(monkeypatch,
                                                                                        llama_target):
    """The re-placement between requests runs after the last caller heard DONE, off its path; when it raises,
    that caller is already done, and the next request runs on the layout that ran."""
    order: list[str] = []
    with Engine.from_config(_cfg(llama_target, None)) as eng:
        def replace():
            order.append("replace")
            raise RuntimeError("the new layout would not start")

        monkeypatch.setattr(eng, "_maybe_replace", replace)
        sink = Collect()
        real_call = sink.__call__
        done = threading.Event()

        def record(item):
            real_call(item)
            if sink.done.is_set() and not done.is_set():
                done.set()
                order.append("done")

        eng.submit(PROMPTS[0], record, max_new_tokens=4)
        assert sink.wait() == hf_greedy(llama_target, PROMPTS[0], 4)
        assert eng.wait_idle(120)
        assert order == ["done", "replace"]
        assert eng.generate(PROMPTS[1], max_new_tokens=4).token_ids == hf_greedy(llama_target, PROMPTS[1], 4)


def test_request_ids_are_a_counter_and_the_worker_keeps_every_stream_of_a_big_batch(monkeypatch, llama_target,
                                                                                     llama_copy_onnx):
    """The worker keeps as many streams as serving.max_batch allows (and a few more), and each request's id on the
    wire is the next of a counter."""
    from hetero_spec.transport.protocol import Begin
    from tests.fixtures.memworker import mem_engine, worker_of

    cfg = {"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
           "draft": {"kind": "onnx", "model": str(llama_copy_onnx)},
           "runtime": {"mode": "two_process", "pin_cpus": False, "heartbeat_s": 1e6}, "serving": {"max_batch": 100}}
    eng, launcher = mem_engine(monkeypatch, cfg, llama_copy_onnx)
    begins = []
    with eng:
        assert worker_of(eng).sup.spec.max_streams >= 100
        assert launcher.workers[-1].worker.max_streams >= 100
        real = launcher.workers[-1].worker.handle
        launcher.workers[-1].worker.handle = lambda msg, arrays: (begins.append(msg.req_id)
                                                                 if isinstance(msg, Begin) else None,
                                                                 real(msg, arrays))
        for p in PROMPTS[:3]:
            assert eng.generate(p, max_new_tokens=4, gamma=2).token_ids == hf_greedy(llama_target, p, 4)
    assert begins == [1, 2, 3]


def test_a_sync_for_a_stream_the_worker_does_not_have_is_counted():
    """An evicted (or ended) stream does not ignore the target's Sync in silence: the worker rejects and counts it."""
    import numpy as np

    from hetero_spec.runtime.draft_worker import Worker
    from hetero_spec.transport.protocol import Sync

    class Chan:
        dropped = 0
        why: list[str] = []

        def reject(self, why):
            self.dropped += 1
            self.why.append(why)

    class Drafter:
        vocab_width = 100

    ch = Chan()
    w = Worker(ch, Drafter(), parent_pid=1)
    w.handle(Sync(req_id=7, pos=3, epoch=0), [np.asarray([1, 2], np.int32)])
    assert ch.dropped == 1 and "request 7" in ch.why[0]


def test_acceptance_has_one_definition_also_for_rounds_cut_short(llama_target, llama_copy_onnx):
    """A round cut short by max_new_tokens tests only the drafts it verified: the copy draft (always accepted) has
    acceptance 1.0 in the stats and in the profile's calibration, whatever max_new_tokens leaves of a block."""
    from hetero_spec.profile_cmd import _acceptance

    with Engine.from_config(_cfg(llama_target, llama_copy_onnx)) as eng:
        out = eng.generate(PROMPTS[0], max_new_tokens=11, gamma=8)  # rounds of 8 drafts, the last one cut to 1
        assert out.stats["tested"] == out.stats["accepted"] == out.stats["drafted"] > 0
        a, info = _acceptance(eng, PROMPTS[:2], max_new=11, gamma=8)
    assert a == 1.0 and info["rejections"] == 0
