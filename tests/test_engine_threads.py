"""A thread-safe Engine: generate/stream from several threads at once; requests go to the request scheduler
(decoded together, in process and in two processes), and each output equals its sequential run.
health() during a request does not disturb it."""

from __future__ import annotations

import threading

import pytest

from hetero_spec import Engine

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [40, 41, 42, 43, 44, 40, 41, 42], [9, 8, 7, 6, 5], [1, 2, 3, 1, 2]]


def _cfg(mode, target, draft):
    rt = {"mode": mode, "pin_cpus": False, "heartbeat_s": 120.0}
    return {"target": {"model": str(target), "dtype": "float32", "device": "cpu"},
            "draft": {"kind": "onnx", "model": str(draft)}, "runtime": rt}


def _run_threads(eng, jobs):
    """jobs: list of (thread index, call) -> {(thread, i): result}; every thread starts together."""
    results, errors = {}, []
    start = threading.Barrier(len(jobs))

    def worker(t, calls):
        start.wait()
        try:
            for i, call in enumerate(calls):
                results[(t, i)] = call()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(t, calls)) for t, calls in jobs]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=600)
    assert not any(th.is_alive() for th in threads), "a thread never finished (deadlock)"
    assert not errors, errors
    return results


@pytest.mark.parametrize("mode", ["in_process", "two_process"])
def test_4_threads_x_3_requests_equal_their_sequential_runs(llama_target, llama_random_onnx, mode):
    with Engine.from_config(_cfg(mode, llama_target, llama_random_onnx)) as eng:
        def req(t, i):
            return dict(prompt=PROMPTS[t], max_new_tokens=12 + 4 * i, gamma=1 + (t + i) % 4,
                        temperature=0.8 if i == 2 else 0.0, seed=100 * t + i)

        seq = {(t, i): eng.generate(**req(t, i)).token_ids for t in range(4) for i in range(3)}

        def call(t, i):
            if i == 1:  # a streaming request among them
                return "".join(eng.stream(**req(t, i)))
            return eng.generate(**req(t, i)).token_ids

        jobs = [(t, [lambda t=t, i=i: call(t, i) for i in range(3)]) for t in range(4)]
        got = _run_threads(eng, jobs)
        for (t, i), ids in seq.items():
            want = eng.tokenizer.decode(ids) if i == 1 else ids
            assert got[(t, i)] == want, (t, i)


def test_health_during_a_request_does_not_disturb_it(llama_target, llama_copy_onnx):
    """health() while requests run answers from what is known, without touching the worker's channel (its
    proposals share it): during a round (the scheduler holds the Engine), and between rounds while a request
    still runs. Only an idle Engine probes for real (a ping: rtt_ms)."""
    import threading

    from hetero_spec.metrics import Stats
    from tests.conftest import hf_greedy
    from tests.test_batch import Collect

    with Engine.from_config(_cfg("two_process", llama_target, llama_copy_onnx)) as eng:
        pings = []
        real_health = eng.source.sup.health
        eng.source.sup.health = lambda *a, **k: pings.append(1) or real_health(*a, **k)
        # during a round: the sink runs in the scheduler's thread, which holds the Engine until we are done
        asked, answered, seen = threading.Event(), threading.Event(), []

        def on_chunk(n):
            if n == 1:
                asked.set()
                assert answered.wait(60)

        sink, stats = Collect(on_chunk=on_chunk), Stats()
        eng.submit(PROMPTS[0], sink, stats=stats, max_new_tokens=40, gamma=3)
        assert asked.wait(60)
        seen.append(eng.health())
        answered.set()
        # whatever the timing, a health() in the stream is busy unless the request had already ended
        assert not pings  # no probe during the round
        records = []
        for _piece in eng.stream(PROMPTS[1], max_new_tokens=40, gamma=3, stats=(s2 := Stats())):
            before = len(pings)
            h = eng.health()
            records.append((h, s2.finish_reason, len(pings) > before))
        assert sink.wait() == hf_greedy(llama_target, PROMPTS[0], 40)
        assert stats.extra["stale_proposals"] == 0 and s2.extra["stale_proposals"] == 0
        assert seen[0]["busy"] and seen[0]["draft"] == "ok" and "rtt_ms" not in seen[0]
        # busy and no probe, unless the request had already ended (then an idle Engine probes)
        assert all((h["busy"] and h["draft"] == "ok" and not pinged) or (done and not h["busy"])
                   for h, done, pinged in records)
        pings.clear()
        # between rounds, a request still running (as the scheduler reports it): no probe either
        real_running = type(eng._scheduler).running
        try:
            type(eng._scheduler).running = property(lambda self: 1)
            between = eng.health()
        finally:
            type(eng._scheduler).running = real_running
        assert between["busy"] and "rtt_ms" not in between and not pings
        idle = eng.health()
        assert not idle["busy"] and idle["draft"] == "ok" and "rtt_ms" in idle and pings
        assert idle["draft_restarts"] == 0 and idle["draft_failures"] == 0


@pytest.fixture
def plain_engine(llama_target):
    eng = Engine.from_config({"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
                              "draft": {"kind": "none"}, "runtime": {"mode": "in_process"}})
    yield eng
    eng.close()


def test_a_stream_dropped_unread_is_cancelled(plain_engine):
    """Cleanup does not live in a generator's `finally` (which never runs for one never started): dropping the
    iterator, read or not, cancels the request; one read to its end is not cancelled."""
    import asyncio
    import gc

    from tests.test_batch import held

    eng = plain_engine
    cancels = [threading.Event() for _ in range(3)]
    with held(eng):  # nothing runs yet: the requests wait at the round lock
        unread = eng.stream_tokens([5, 6, 7], cancel=cancels[0], max_new_tokens=50)
        del unread
        gc.collect()

        async def drop_async():
            unread = await eng.astream_tokens([5, 6, 7], cancel=cancels[1], max_new_tokens=50)
            del unread
            gc.collect()

        asyncio.run(drop_async())
    assert cancels[0].is_set() and cancels[1].is_set()
    done = eng.stream_tokens([5, 6, 7], cancel=cancels[2], max_new_tokens=3)
    assert sum(len(chunk) for chunk in done) == 3
    del done
    gc.collect()
    assert not cancels[2].is_set()


def test_a_caller_does_not_wait_forever_on_a_dead_request_loop(plain_engine, monkeypatch):
    """The request loop's thread died (nothing will ever come): the caller's next read raises EngineClosedError."""
    import asyncio

    from hetero_spec import engine as engine_mod
    from hetero_spec.errors import EngineClosedError

    eng = plain_engine
    monkeypatch.setattr(engine_mod, "LOOP_POLL_S", 0.01)
    monkeypatch.setattr(eng, "submit", lambda *args, **kw: None)  # accepted, and never served
    monkeypatch.setattr(type(eng._scheduler), "alive", property(lambda self: False))
    with pytest.raises(EngineClosedError, match="request loop stopped"):
        next(iter(eng.stream_tokens([5, 6, 7], max_new_tokens=4)))
    with pytest.raises(EngineClosedError, match="request loop stopped"):
        eng.generate([5, 6, 7], max_new_tokens=4)  # it waits for the end only, and checks the loop the same way

    async def read():
        async for _ in await eng.astream_tokens([5, 6, 7], max_new_tokens=4):
            pass

    with pytest.raises(EngineClosedError, match="request loop stopped"):
        asyncio.run(read())


def test_a_generate_interrupted_while_it_waits_cancels_its_request(plain_engine, monkeypatch):
    """generate() waits on one event for its request's end (checking the loop every LOOP_POLL_S); a caller
    interrupted while it waits (KeyboardInterrupt) cancels the request, which then leaves."""
    eng = plain_engine
    seen = []
    real_submit = eng.submit

    def submit(prompt, sink, stats=None, cancel=None, **kw):
        seen.append(cancel)
        return real_submit(prompt, sink, stats, cancel, **kw)

    monkeypatch.setattr(eng, "submit", submit)
    out = eng.generate([5, 6, 7], max_new_tokens=6)
    assert len(out.token_ids) == 6 and out.finish_reason in ("length", "stop")
    waits = []

    class Interrupted(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            raise KeyboardInterrupt

    monkeypatch.setattr(threading, "Event", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.generate([5, 6, 7], max_new_tokens=50)
    cancel = seen[-1]
    assert isinstance(cancel, Interrupted) and threading.Event.is_set(cancel)  # set before the interrupt rose
    from hetero_spec.engine import LOOP_POLL_S
    assert waits == [LOOP_POLL_S]
    assert eng.wait_idle(30)  # the cancelled request left
