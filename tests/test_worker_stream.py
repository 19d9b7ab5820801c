"""Streaming in the two-process runtime: the target's stream buffer, the worker's protocol side (driven
in-process with a fake channel and a frozen clock), and CPU pinning. The end-to-end runs are in
test_pipelined_mem.py (deterministic, in-memory worker)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hetero_spec.draft.onnx_drafter import OnnxDrafter
from hetero_spec.runtime.draft_worker import Worker
from hetero_spec.runtime.pipelined import StreamBuffer
from hetero_spec.transport.protocol import Begin, End, Proposal, Sync



# -- the target's stream buffer -------------------------------------------------------------------
def _prop(epoch, base, start, toks, probs=None):
    return Proposal(req_id=1, epoch=epoch, base=base, start=start, draft_s=0.0, draft_t0=0.0, sent=0.0), \
        np.asarray(toks, dtype=np.int32), probs


def test_stream_buffer_shadow_compares_what_the_target_decoded_alone():
    """While the target decodes alone, the worker's tokens are compared with the committed ones as a verification
    would: (tested, accepted) up to and including the first mismatch, which drops the stream."""
    buf = StreamBuffer()
    buf.add(*_prop(0, 10, 10, [1, 2, 3, 4, 5]))
    assert buf.shadow(list(range(10))) == (0, 0)  # nothing committed past the prompt yet
    assert buf.shadow(list(range(10)) + [1, 2]) == (2, 2) and buf.base == 12
    assert buf.usable(list(range(10)) + [1, 2]) == ([3, 4, 5], [])  # the rest stays usable
    assert buf.shadow(list(range(10)) + [1, 2, 3, 9, 5]) == (2, 1)  # 3 agreed, 4 did not
    assert buf.min_epoch == 1 and buf.tokens == []
    buf.add(*_prop(0, 10, 15, [6]))
    assert buf.stale == 1  # the dropped stream's late tokens
    buf.add(*_prop(1, 14, 14, [5, 6, 8]))  # the worker re-based after the target's 9
    assert buf.shadow(list(range(10)) + [1, 2, 3, 9, 5, 6]) == (2, 2)  # 5, 6 agreed; 8 not decoded yet
    assert buf.shadow(list(range(10)) + [1, 2, 3, 9, 5, 6, 7]) == (1, 0)


def test_sampled_stream_needs_a_distribution_per_token():
    buf = StreamBuffer(sampled=True)
    buf.add(*_prop(0, 5, 5, [1, 2]))
    assert buf.stale == 1 and buf.tokens == []
    q = np.full((2, 4), 0.25, np.float32)
    buf.add(*_prop(0, 5, 5, [1, 2], q))
    toks, probs = buf.usable(list(range(5)))
    assert toks == [1, 2] and len(probs) == 2


# -- the worker, driven in-process -----------------------------------------------------------------
class FakeChannel:
    def __init__(self):
        self.sent, self.dropped = [], 0

    def poll(self):
        return False

    def reject(self, why):
        self.dropped += 1

    def send(self, msg, *arrays):
        self.sent.append((msg, [np.array(a) for a in arrays]))
        return True

    def recv(self, timeout_s):
        return None

    def take(self, kind):
        out = [(m, a) for m, a in self.sent if isinstance(m, kind)]
        self.sent = [(m, a) for m, a in self.sent if not isinstance(m, kind)]
        return out


def _run_until_idle(w: Worker, limit: int = 500) -> None:
    """The worker loop's decisions, without the socket: flush, draft, until nothing is left."""
    for _ in range(limit):
        n = w.want_to_draft()
        if w.should_flush(n):
            w.flush()
        elif n:
            w.draft_once(1)
        else:
            return
    raise AssertionError("worker never went idle")


def _begin(w: Worker, prompt: list[int], gamma: int, max_ahead: int) -> None:
    """A greedy request begun on the worker, drafted until it is idle."""
    w.handle(Begin(req_id=1, temperature=0.0, top_k=0, top_p=1.0, seed=0, gamma=gamma, max_ahead=max_ahead),
             [np.asarray(prompt, np.int32)])
    _run_until_idle(w)


@pytest.fixture()
def worker(llama_target, llama_copy_onnx):
    ch = FakeChannel()
    # a frozen clock: the 2 ms send-batching deadline never passes, however slow this machine is
    w = Worker(ch, OnnxDrafter(llama_copy_onnx), parent_pid=os.getppid(), clock=lambda: 0.0)
    return w, ch


def test_worker_batches_sends(worker):
    w, ch = worker
    prompt = [5, 17, 33, 2, 99]
    gamma = 4
    w.handle(Begin(req_id=1, temperature=0.0, top_k=0, top_p=1.0, seed=0, gamma=gamma,
                   max_ahead=2 * gamma + 1), [np.asarray(prompt, np.int32)])
    _run_until_idle(w)
    props = ch.take(Proposal)
    stream = [t for _, a in props for t in a[0].tolist()]
    assert len(stream) == 2 * gamma + 1
    # batched: one send when the target's next block is complete, one at max_ahead
    assert [(m.start, len(a[0])) for m, a in props] == [(len(prompt), gamma), (len(prompt) + gamma, gamma + 1)]
    assert all(m.timed == len(a[0]) for m, a in props)  # every token sent was timed as it was drafted


def test_after_a_correction_the_first_token_goes_out_alone(worker):
    """The target waits for the first token of a rebased stream: the worker sends it at once, not with its block."""
    w, ch = worker
    prompt = [40, 41, 42, 43]
    _begin(w, prompt, 4, 9)
    ch.take(Proposal)
    n = len(prompt)
    wrong = (w.cur.drafter.ids[n] + 1) % w.cur.drafter.vocab_width  # the target corrects the first drafted token
    w.handle(Sync(req_id=1, pos=n, epoch=1), [np.asarray([wrong], np.int32)])
    _run_until_idle(w)
    sizes = [(m.epoch, m.start, len(a[0])) for m, a in ch.take(Proposal)]
    assert sizes[0] == (1, n + 1, 1) and sizes[1] == (1, n + 2, 3), sizes  # then the rest of the block


def test_worker_restarts_its_stream_when_the_target_dropped_it(worker):
    w, ch = worker
    prompt = [40, 41, 42, 43]
    _begin(w, prompt, 3, 7)
    ch.sent.clear()
    accepted = w.cur.drafter.ids[len(prompt):len(prompt) + 2]
    # no divergence, but the target asks for epoch 3: the worker re-drafts from the committed length
    w.handle(Sync(req_id=1, pos=len(prompt), epoch=3), [np.asarray(accepted, np.int32)])
    assert w.cur.epoch == 3 and len(w.cur.drafter.ids) == len(prompt) + 2
    _run_until_idle(w)
    first = ch.take(Proposal)[0][0]
    assert (first.epoch, first.start, first.base) == (3, len(prompt) + 2, len(prompt) + 2)


# -- CPU placement ---------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
def test_pinning_moves_only_this_engines_zmq_threads_and_restores_the_decode_thread():
    from hetero_spec.runtime.cpus import pin_threads, pinned_thread
    from hetero_spec.transport.channel import ServerContext

    cpus = sorted(os.sched_getaffinity(0))
    other = ServerContext()  # another engine's context: must not be touched
    mine = ServerContext()
    try:
        assert mine.thread_ids and not set(mine.thread_ids) & set(other.thread_ids)
        before_other = {t: os.sched_getaffinity(t) for t in other.thread_ids}
        assert pin_threads(mine.thread_ids, [cpus[-1]]) == len(mine.thread_ids)
        assert all(os.sched_getaffinity(t) == {cpus[-1]} for t in mine.thread_ids)
        assert {t: os.sched_getaffinity(t) for t in other.thread_ids} == before_other
        # the I/O thread names itself once it runs, which on a loaded machine may be a while after it
        # was created: wait for that event (no timing is asserted)
        deadline = time.monotonic() + 60
        names: set[str] = set()
        while time.monotonic() < deadline and not any(n.startswith("ZMQbg/IO") for n in names):
            names = {Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in mine.thread_ids}
            time.sleep(0.01)
        assert any(n.startswith("ZMQbg/IO") for n in names), names
        tid = threading.get_native_id()
        before = os.sched_getaffinity(tid)
        with pinned_thread([cpus[0]]):
            assert os.sched_getaffinity(tid) == {cpus[0]}
        assert os.sched_getaffinity(tid) == before
    finally:
        mine.close()
        other.close()


def test_one_worker_drafts_several_streams(llama_copy_onnx):
    """Each Begin opens a stream with its own draft state; streams take turns a token at a time (step), a Sync
    rebases only its own stream, End closes one and the others go on, and beyond max_streams the stream heard
    of least recently is closed."""
    ch = FakeChannel()
    w = Worker(ch, OnnxDrafter(llama_copy_onnx), parent_pid=os.getppid(), clock=lambda: 0.0, max_streams=2)
    prompts = {1: [5, 17, 33, 2, 99], 2: [40, 41, 42, 43]}
    for rid, p in prompts.items():
        w.handle(Begin(req_id=rid, temperature=0.0, top_k=0, top_p=1.0, seed=0, gamma=3, max_ahead=7),
                 [np.asarray(p, np.int32)])
    assert set(w.streams) == {1, 2}
    for _ in range(200):
        if not w.step(idle_wait_s=0.0):
            break
    props = ch.take(Proposal)
    got = {rid: [t for m, a in props if m.req_id == rid for t in a[0].tolist()] for rid in prompts}
    ref = OnnxDrafter(llama_copy_onnx)
    for rid, p in prompts.items():  # each stream drafted alone, to max_ahead
        ref.begin(p, w.model.params)
        assert got[rid] == ref.extend(7).ids
    # request 2's target rejects at its first draft token: only stream 2 starts a new epoch
    w.handle(Sync(req_id=2, pos=4, epoch=0), [np.asarray([7], np.int32)])
    assert (w.streams[1].epoch, w.streams[2].epoch) == (0, 1)
    assert w.streams[2].drafter.ids == prompts[2] + [7] and len(w.streams[1].drafter.ids) == 5 + 7
    w.handle(End(req_id=1), [])
    assert set(w.streams) == {2} and w.cur is w.streams[2]
    # a third and a fourth request with max_streams=2: the least recently heard of (2, then 3) is closed
    for rid in (3, 4):
        w.handle(Begin(req_id=rid, temperature=0.0, top_k=0, top_p=1.0, seed=0, gamma=3, max_ahead=7),
                 [np.asarray([1, 2, 3], np.int32)])
    assert set(w.streams) == {3, 4}
    w.handle(Sync(req_id=2, pos=5, epoch=1), [np.asarray([8], np.int32)])  # a closed stream: ignored
    assert set(w.streams) == {3, 4}


def test_a_round_waits_for_drafts_once_not_once_a_row():
    """WorkerSource.propose: one deadline a round. Each link here waits out whatever budget it is given (a worker
    with nothing drafted): three rows together wait budget_s, not three times it."""
    from types import SimpleNamespace

    from hetero_spec.draft.base import Draft
    from hetero_spec.runtime.worker_source import WorkerSource
    from hetero_spec.sampling import SamplingParams
    from hetero_spec.tuning.controller import RowPlan

    now = [100.0]
    given = []

    class Link:
        shadow = (0, 0)

        def control(self, *args):
            pass

        def gather(self, ids, k, budget_s):
            given.append(budget_s)
            now[0] += budget_s  # waited the whole budget: nothing came
            return Draft(ids=[])

    source = object.__new__(WorkerSource)
    source.clock = lambda: now[0]
    seqs = [SimpleNamespace(id=i, ids=[1, 2, 3], gamma=4, params=SamplingParams()) for i in range(3)]
    source.links = {seq.id: Link() for seq in seqs}
    drafts = source.propose(seqs, [RowPlan(k=4, ahead=4) for _ in seqs], budget_s=0.5)
    assert [d.ids for d in drafts] == [[], [], []]
    assert given == [0.5, 0.0, 0.0] and now[0] == 100.5
