"""Continuous batching: requests decoded together (scheduler.py) give each exactly its solo output, with mixed
accepted lengths, joins, leaves and cancellations, on both target backends; batched verification itself
(torch: one padded pass; onnx: one-token rows of a KvPool in one pass); the batch plan on constructed costs.

Batches are made deterministic, never by timing: while a test holds the Engine's round lock, the scheduler
waits at its next round, so every request submitted meanwhile starts in the same round; a request joins a
running batch from another request's sink (the scheduler's thread, between two rounds)."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

import numpy as np
import pytest

from hetero_spec import Engine
from hetero_spec.scheduler import DONE
from hetero_spec.errors import EngineClosedError
from hetero_spec.metrics import Stats
from hetero_spec.tuning.controller import SHARED_SIZES, Controller, SharedPassCost, Tuning
from hetero_spec.tuning.profile import recommended_batch
from hetero_spec.tuning.cost_model import CostModel

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [40, 41, 42, 43, 44, 40, 41, 42], [9, 8, 7, 6, 5], [1, 2, 3, 1, 2],
           [77], [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]]


def _cfg(target, draft, backend="torch", max_batch=8):
    d = {"kind": "onnx", "model": str(draft)} if draft is not None else {"kind": "none"}
    return {"target": {"model": str(target), "dtype": "float32", "device": "cpu", "backend": backend},
            "draft": d, "runtime": {"mode": "in_process"}, "serving": {"max_batch": max_batch}}


class Collect:
    """A ticket's sink: the tokens, DONE, errors; on_chunk(n) runs in the scheduler's thread after chunk n."""

    def __init__(self, on_chunk=None):
        self.ids: list[int] = []
        self.chunks = 0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.on_chunk = on_chunk

    def __call__(self, item) -> None:
        if item is DONE:
            self.done.set()
        elif isinstance(item, BaseException):
            self.error = item
            self.done.set()
        else:
            self.ids.extend(item)
            self.chunks += 1
            if self.on_chunk is not None:
                self.on_chunk(self.chunks)

    def wait(self) -> list[int]:
        assert self.done.wait(300), "the request never ended"
        assert self.error is None, repr(self.error)
        return self.ids


@contextmanager
def held(eng: Engine):
    """The scheduler waits at its next round until the block ends: what is submitted inside starts together."""
    eng.lock.acquire()
    try:
        yield
    finally:
        eng.lock.release()


def _req(i: int) -> dict:
    """Mixed requests: fixed gammas 1..4 and auto, greedy and seeded sampling, different lengths (leaves)."""
    gamma = [1, 2, 3, 4, None, 2][i]
    return dict(max_new_tokens=10 + 3 * i, gamma=gamma, temperature=0.9 if i in (1, 4) else 0.0, seed=50 + i)


def _run_batch(eng: Engine):
    """Four requests start together; a fifth joins after the first's 2nd round; the third is cancelled after
    its 3rd round. Returns (collectors, stats, the cancelled index, the joined index)."""
    from hetero_spec.metrics import Stats

    stats = {i: Stats() for i in range(6)}
    sinks: dict[int, Collect] = {}
    tickets = {}

    def join(n):
        if n == 2 and 4 not in sinks:
            sinks[4] = Collect()
            tickets[4] = eng.submit(PROMPTS[4], sinks[4], stats=stats[4], **_req(4))

    def cancel(n):
        if n == 3:
            tickets[2].cancel.set()

    with held(eng):
        for i in range(4):
            sinks[i] = Collect(on_chunk=join if i == 0 else cancel if i == 2 else None)
            tickets[i] = eng.submit(PROMPTS[i], sinks[i], stats=stats[i], **_req(i))
    for i in (0, 1, 3):
        sinks[i].wait()
    sinks[2].wait()
    assert 4 in sinks, "the joining request was never submitted"
    sinks[4].wait()
    return sinks, stats


@pytest.mark.parametrize("backend,draft", [("torch", "random"), ("torch", "copy"), ("onnx", "random"),
                                           ("onnx", None)])
def test_batched_requests_equal_their_solo_runs(llama_target, llama_random_onnx, llama_copy_onnx, backend, draft):
    draft_dir = {"random": llama_random_onnx, "copy": llama_copy_onnx, None: None}[draft]
    with Engine.from_config(_cfg(llama_target, draft_dir, backend)) as eng:
        solo = {i: eng.generate(PROMPTS[i], **_req(i)).token_ids for i in range(5)}
        steps = []  # the draft model's runs shared by several requests
        if draft is not None:
            dec = eng.source.proposer.decoder
            real = dec.append_batch
            dec.append_batch = lambda states, toks: steps.append(len(states)) or real(states, toks)
        sinks, stats = _run_batch(eng)
        for i in (0, 1, 3, 4):
            assert sinks[i].ids == solo[i], f"request {i} differs from its solo run"
            assert stats[i].finish_reason == "length"
        assert stats[2].finish_reason == "cancelled"
        assert sinks[2].chunks == 3 and sinks[2].ids == solo[2][:len(sinks[2].ids)]
        # the four started in one batch, and the fifth joined it in round 3 (request 2 left in round 4)
        assert stats[0].extra["batch"]["largest_batch"] == 5
        assert stats[4].extra["batch"]["rounds_batched"] > 0
        if draft is not None:  # the rows drafted together: one draft run per token for several requests
            assert steps and max(steps) >= 3
        if draft == "random":  # blocks of different lengths, and different accepted lengths, shared passes
            assert {stats[i].drafted for i in (0, 3)} != {0} and stats[0].accepted < stats[0].drafted
        if backend == "onnx":  # every slot of the batched KV buffer is free again
            assert not eng.target._pool._states


def test_max_batch_limits_the_rows_and_the_rest_wait(llama_target):
    with Engine.from_config(_cfg(llama_target, None, "torch", max_batch=2)) as eng:
        solo = [eng.generate(p, max_new_tokens=6).token_ids for p in PROMPTS[:5]]
        sinks, stats = [], []
        from hetero_spec.metrics import Stats

        with held(eng):
            for p in PROMPTS[:5]:
                sinks.append(Collect())
                stats.append(Stats())
                eng.submit(p, sinks[-1], stats=stats[-1], max_new_tokens=6)
        assert [s.wait() for s in sinks] == solo
        assert max(s.extra.get("batch", {}).get("largest_batch", 1) for s in stats) == 2
        assert max(eng.batch_sizes()) == 2


def test_stopping_fails_the_waiting_requests_and_finishes_the_running_one(llama_target):
    eng = Engine.from_config(_cfg(llama_target, None, "torch", max_batch=1))
    # the scheduler is told to stop (as close() does) after the first request's first round, while the
    # second waits for its place (max_batch 1)
    first = Collect(on_chunk=lambda n: eng.close(wait_s=0) if n == 1 else None)
    second = Collect()
    with held(eng):
        eng.submit(PROMPTS[0], first, max_new_tokens=8)
        eng.submit(PROMPTS[1], second, max_new_tokens=8)
    assert len(first.wait()) == 8
    assert second.done.wait(300) and isinstance(second.error, EngineClosedError)
    with pytest.raises(EngineClosedError):
        eng.generate(PROMPTS[0], max_new_tokens=2)
    eng.close()
    assert eng.wait_idle(60)


def test_async_api_equals_generate(llama_target):
    with Engine.from_config(_cfg(llama_target, None, "torch")) as eng:
        want = [eng.generate(p, max_new_tokens=8).token_ids for p in PROMPTS[:3]]

        async def main():
            outs = await asyncio.gather(*(eng.agenerate(p, max_new_tokens=8) for p in PROMPTS[:3]))
            pieces = [x async for x in await eng.astream(PROMPTS[0], max_new_tokens=8)]
            # leaving an async stream early cancels its request
            chunks = await eng.astream_tokens(PROMPTS[1], max_new_tokens=200)
            async for _ in chunks:
                break
            await chunks.aclose()
            return outs, pieces

        outs, pieces = asyncio.run(main())
        assert [o.token_ids for o in outs] == want
        assert "".join(pieces) == eng.generate(PROMPTS[0], max_new_tokens=8).text


# -- batched verification, backend by backend ---------------------------------------------------------------
def test_torch_batched_pass_over_the_kept_cache_equals_one_pass_per_row(llama_target):
    """The rows' caches are slots of one kept buffer, read in place: a pass over them gives each row what it gets
    alone, rollbacks included, and the buffer is neither rebuilt nor copied from a round to the next."""
    from hetero_spec.target.verifier import TargetModel

    t = TargetModel(llama_target, device="cpu", dtype="float32", threads=1)
    solo_target = TargetModel(llama_target, device="cpu", dtype="float32", threads=1)  # caches of their own
    t.enable_batching(5)
    rows_spec = [([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]), ([4], []), ([5, 6], [7, 8, 9, 10, 11, 12]), ([3] * 20, [1])]
    solo, rows = [], []
    gap = t.new_state()  # a slot between the rows that is not in the pass (a request still prefilling)
    t.prefill(gap, [2, 2, 2])
    for prompt, draft in rows_spec:
        a, b = solo_target.new_state(), t.new_state()
        assert a.slot is None and b.slot is not None
        solo_target.prefill(a, prompt)
        t.prefill(b, prompt)
        solo.append((a, solo_target.verify(a, prompt[-1], draft, greedy=False)))
        rows.append((b, prompt[-1], draft))
    rows = [rows[2], rows[0], rows[3], rows[1]]  # any order: results come back in the rows' order
    solo = [solo[2], solo[0], solo[3], solo[1]]
    outs = t.verify_batch(rows, [False] * len(rows))
    for (a, ref), (b, _, draft), out in zip(solo, rows, outs):
        assert out.shape == ref.shape == (len(draft) + 1, t.vocab_width)
        np.testing.assert_allclose(out, ref, atol=1e-4)
        assert (out.argmax(-1) == ref.argmax(-1)).all()
        assert b.n_cached == a.n_cached == b.cache.get_seq_length()
    kept = [t.kept.keys[0].data_ptr(), t.kept.values[-1].data_ptr()]
    # after a rollback each row continues exactly as alone, in the same buffer
    for (a, _), (b, _, draft) in zip(solo, rows):
        solo_target.rollback(a, a.n_cached - len(draft))
        t.rollback(b, b.n_cached - len(draft))
    again = t.verify_batch([(b, 5, [6]) for b, _, _ in rows], [True] * len(rows))
    assert again == [solo_target.verify(a, 5, [6], greedy=True) for a, _ in solo]
    assert [t.kept.keys[0].data_ptr(), t.kept.values[-1].data_ptr()] == kept
    # the slot between them kept its own past: it continues as a fresh request on the same tokens would
    fresh = solo_target.new_state()
    solo_target.prefill(fresh, [2, 2, 2])
    assert t.verify(gap, 2, [5], greedy=True) == solo_target.verify(fresh, 2, [5], greedy=True)
    # rows in slots apart are gathered for the pass (not a view), with the same result
    apart = [i for i, (b, _, _) in enumerate(rows) if b.slot in (1, 3)]
    got = t.verify_batch([(rows[i][0], 7, [8]) for i in apart], [True, True])
    assert got == [solo_target.verify(solo[i][0], 7, [8], greedy=True) for i in apart]
    # a slot freed is taken by the next request; past the slots, a request gets a cache of its own
    freed = rows[0][0].slot
    t.release_state(rows[0][0])
    assert t.new_state().slot == freed and t.new_state().slot is None


def test_onnx_pool_steps_many_rows_in_one_run_exactly(llama_copy_onnx):
    from hetero_spec.onnx_decoder import OnnxDecoder

    dec = OnnxDecoder(llama_copy_onnx, threads=1, role="target")
    assert dec.shared
    dec.initial_capacity = 8  # the pasts below make the pool grow, rebinding every slot
    pool = dec.new_pool(4)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [4], [7, 7, 7]]
    solo_states, slots = [], [pool.acquire() for _ in range(4)]
    gap = slots.pop(1)  # a running slot between them that is not stepped (a dummy row in the run)
    dec.append(gap, [9, 9])
    for prompt, s in zip(prompts, slots):
        ref = dec.new_state()
        dec.append(ref, prompt)
        solo_states.append(ref)
        dec.append(s, prompt)
    assert pool.capacity >= 11
    for step_tok in (3, 8):
        got = dec.append_batch(slots, [step_tok] * 3)
        want = np.stack([dec.append(ref, [step_tok])[0] for ref in solo_states])
        np.testing.assert_array_equal(got, want)
    assert [s.n_past for s in slots] == [r.n_past for r in solo_states]
    assert gap.n_past == 2 and np.array_equal(dec.append(gap, [1]), dec.append(_fresh(dec, [9, 9]), [1]))
    freed = slots[0].slot
    pool.release(slots[0])
    again = pool.acquire()
    assert again.slot == freed and pool.acquire() is None  # 4 slots, all taken again
    # a state dropped without release() (a probe that forgot) frees its slot once collected
    del again
    import gc

    gc.collect()
    assert pool.acquire().slot == freed


def _fresh(dec, tokens):
    s = dec.new_state()
    dec.append(s, tokens)
    return s


def test_onnx_target_shares_a_pass_only_between_one_token_rows(llama_target):
    from hetero_spec.target.backends import load_target

    from hetero_spec.config import build_config

    t = load_target(build_config(_cfg(llama_target, None, "onnx")).target, 1)
    t.enable_batching(4)
    calls = []
    real = t.decoder.append_batch
    t.decoder.append_batch = lambda states, toks: calls.append(len(states)) or real(states, toks)
    rows = []
    for prompt in ([1, 2, 3], [4, 5], [6]):
        s = t.new_state()
        t.prefill(s, prompt)
        rows.append((s, prompt[-1], []))
    rows[2] = (rows[2][0], 6, [7, 8])  # a block: verified alone
    outs = t.verify_batch(rows, [True, True, True])
    assert calls == [2] and [len(o) for o in outs] == [1, 1, 3]
    for s, _, _ in rows:
        t.release_state(s)
    assert not t._pool._states


# -- the batch plan -----------------------------------------------------------------------------------------
CPU = CostModel(verify_fixed_s=1e-3, verify_per_token_s=1e-4, draft_token_s=2e-4)  # compute-bound verify
GPU = CostModel(verify_fixed_s=10e-3, verify_per_token_s=1e-5, draft_token_s=5e-4)  # bandwidth-bound verify


def plan(model, ks, acc, batch_blocks, together=False, shared=None):
    ctl = Controller(Tuning(profile=model, shared=shared or SharedPassCost()), "in_process", batch_blocks)
    return ctl.plan_batch(ks, acc, together), ctl


def test_plan_turns_speculation_off_for_a_compute_bound_batch_and_keeps_it_when_verify_is_flat():
    ks, ctl = plan(CPU, [4] * 8, [0.8] * 8, batch_blocks=False)
    assert ks == [0] * 8 and ctl.last_rates[1] > ctl.last_rates[0]
    ks, ctl = plan(GPU, [4] * 8, [0.8] * 8, batch_blocks=True)
    assert ks == [4] * 8 and ctl.last_rates[0] > ctl.last_rates[1]
    # drafting together makes speculation cheaper than drafting in turn
    apart = plan(GPU, [4] * 8, [0.8] * 8, True)[1].last_rates[0]
    together = plan(GPU, [4] * 8, [0.8] * 8, True, together=True)[1].last_rates[0]
    assert together > apart
    # acceptance 0: drafting never pays, even on the flat verify
    assert plan(GPU, [4] * 8, [0.0] * 8, True)[0] == [0] * 8
    # one row, nothing measured, or no drafts: the rows' own choices
    assert plan(CPU, [4], [0.8], False)[0] == [4]
    assert plan(None, [4, 2], [0.8, 0.8], False)[0] == [4, 2]
    assert plan(CPU, [0, 0], [0.8, 0.8], False)[0] == [0, 0]


def test_plan_uses_the_measured_shared_pass_once_two_sizes_are_seen():
    shared = SharedPassCost()
    assert shared.line() is None and shared.cost(8, CPU) == pytest.approx(CPU.verify(7))
    for _ in range(3):
        shared.observe(2, 0.010)
        shared.observe(8, 0.040)  # a machine where a shared pass costs 5 ms per row
    assert shared.cost(4, CPU) == pytest.approx(0.020)
    # now a shared pass is dear: speculating each row alone beats it
    assert plan(CPU, [4] * 8, [0.8] * 8, False, shared=shared)[0] == [4] * 8


def test_a_stalled_shared_pass_moves_neither_its_size_nor_the_line():
    """A loop that shares its core (a Ray Serve replica) sees some passes run 2-3x long. The shared-pass cost is the
    median per size and a line through those medians, so the stalls move neither; a least-squares line through every
    pass took a negative slope from them (clamped to 0, it priced a pass of 2 rows like one of 8)."""
    def true(t):  # 8 ms a pass plus 0.7 ms a row
        return 0.008 + 0.0007 * t

    shared = SharedPassCost()
    for i in range(20):
        for t in (2, 4, 8):
            stalled = i % 5 == 0 and t < 8  # one pass in five of the smaller batches (rows joining or leaving)
            shared.observe(t, true(t) * (3.0 if stalled else 1.0))
    for t in (2, 4, 8):
        assert shared.cost(t, CPU) == pytest.approx(true(t))
    assert shared.cost(6, CPU) == pytest.approx(true(6))  # unseen: the line through the medians
    c0, c1 = shared.line()
    assert c0 == pytest.approx(0.008) and c1 == pytest.approx(0.0007)
    for t in range(10, 10 + SHARED_SIZES):  # padded block passes: many sizes; the oldest seen go first
        shared.observe(t, true(t))
    assert [t for t, _ in shared.points] == list(range(10, 10 + SHARED_SIZES))


def test_a_plain_plan_holds_for_an_unchanged_batch_then_is_asked_again():
    from hetero_spec.tuning.controller import PLAIN_HOLD

    ctl = Controller(Tuning(profile=CPU, prior_acceptance=0.8), "in_process", batch_blocks=False)
    streams = [ctl.stream("auto") for _ in range(8)]
    assert ctl.plan(streams, [100] * 8).ks == [0] * 8 and "one shared pass" in ctl.last_plan
    for _ in range(PLAIN_HOLD):  # held: no row's gamma is searched
        assert ctl.plan(streams, [100] * 8).ks == [0] * 8
    rounds = streams[0]._round
    ctl.plan(streams, [100] * 8).ks
    assert streams[0]._round == rounds + 1  # asked again


def test_latency_mode_holds_a_request_back_when_it_would_slow_the_batch():
    def may_join(n, mode):
        return Controller(Tuning(profile=CPU), "in_process", False, mode).may_join(n)

    assert may_join(7, "throughput")
    assert may_join(0, "latency")
    # CPU: verify(0) = 1.1 ms alone; a shared pass of n rows ~ 1 + 0.1 n ms: joins until 1.5 x 1.1 ms
    assert may_join(5, "latency")
    assert not may_join(6, "latency")


def test_recommended_batch_is_where_throughput_stops_growing():
    # 1 -> 2 -> 4 more than 10 % each; 4 -> 8 only 5 %: 4
    assert recommended_batch([(1, 1.0), (2, 1.2), (4, 1.6), (8, 3.05)]) == 4
    assert recommended_batch([(1, 1.0), (2, 1.5)]) == 2
    assert recommended_batch([(1, 1.0), (2, 2.0)]) == 1  # no gain at all
    assert recommended_batch([(1, 1.0)]) == 1


def test_two_process_requests_share_rounds_drafted_by_one_worker(llama_target, llama_copy_onnx):
    """two_process with a real worker process: requests started together run as one batch while the one worker
    drafts for all of them (a stream each); each output equals its own solo run."""
    from hetero_spec.metrics import Stats
    from tests.fixtures.memworker import FixedController

    cfg = {**_cfg(llama_target, llama_copy_onnx, "torch"),
           "runtime": {"mode": "two_process", "pin_cpus": False, "heartbeat_s": 120.0}, "speculation": {"gamma": 4}}
    # held on, waiting for each block: on a loaded machine a slow worker would otherwise be waited for less
    with Engine.from_config(cfg, controller=FixedController.factory("on", budget_s=60.0)) as eng:
        alone = [eng.generate(p, max_new_tokens=12) for p in PROMPTS[:3]]
        assert all(o.stats["proposer"] == "onnx-pipelined" and o.stats["drafted"] > 0 for o in alone)
        sinks, stats = [Collect() for _ in range(3)], [Stats() for _ in range(3)]
        with held(eng):
            for p, sink, st in zip(PROMPTS[:3], sinks, stats):
                eng.submit(p, sink, stats=st, max_new_tokens=12)
        assert [s.wait() for s in sinks] == [o.token_ids for o in alone]
        assert all(st.extra["batch"]["largest_batch"] == 3 and st.extra["batch"]["rounds_batched"] > 0
                   and st.drafted > 0 for st in stats)


def test_a_row_that_leaves_mid_round_does_not_make_the_next_one_look_alone(llama_target):
    """Scheduler bug: a round's row count was read after earlier rows of the same round had left, so the next row's
    verify was recorded as a one-request cost, and the request reported unbatched. Two rows share a pass; the
    first ends in it (max_new_tokens 1): the second's observation is still a shared pass."""
    eng = Engine.from_config({"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
                              "draft": {"kind": "ngram"}, "speculation": {"gamma": 2},
                              "runtime": {"mode": "in_process"}, "serving": {"max_batch": 2}})
    try:
        seen = []
        real = eng.controller.observe

        def observe(control, drafted, n_accepted, verify_s, row=None, draft_s=None):
            seen.append(verify_s)
            return real(control, drafted, n_accepted, verify_s, row, draft_s)

        eng.controller.observe = observe
        short, long_, stats = Collect(), Collect(), Stats()
        with held(eng):
            eng.submit([5, 6, 5, 6, 5, 6], short, max_new_tokens=1)  # the first row: it ends in round 1
            eng.submit([7, 8, 7, 8, 7, 8], long_, stats=stats, max_new_tokens=6)
        short.wait(), long_.wait()
        assert seen[:2] == [None, None]  # round 1: both rows of a shared pass, neither a one-request cost
        assert stats.extra["batch"]["rounds_batched"] >= 1 and stats.extra["batch"]["largest_batch"] == 2
    finally:
        eng.close()


def test_a_selection_batch_is_priced_on_what_it_will_draft():
    """Under draft selection each row may draft up to G_MAX (16), but the chooser drafts what predicts best (4
    here). Priced at 16 drafts a row, speculation lost to one shared pass (and the batch then held that for
    PLAIN_HOLD rounds); the plan prices the strategies' own choices, and wins. A held plain round asks no source."""
    from hetero_spec.tuning.controller import G_MAX

    model = CostModel(verify_fixed_s=1e-3, verify_per_token_s=1e-5, draft_token_s=2e-5)

    class Chooser:  # the selection's choice, fixed: the cost model's best gamma
        def next_round(self):
            pass

        def choose(self, cap, names, stream, round_started):
            return names[0], min(cap, model.best_gamma(0.5, "in_process", G_MAX)[0])

    def controller():
        ctl = Controller(Tuning(profile=model, shared=SharedPassCost(), prior_acceptance=0.5), "in_process", True)
        ctl.chooser = Chooser()
        return ctl

    assert model.best_gamma(0.5, "in_process", G_MAX)[0] == 4
    assert not any(controller().plan_batch([G_MAX] * 4, [0.5] * 4))  # what pricing at the caps concluded
    ctl, asked = controller(), []
    streams = [ctl.stream("auto", i) for i in range(4)]
    plan = ctl.plan(streams, [100] * 4, offers=lambda caps: asked.append(caps) or [["onnx"]] * 4)
    assert asked == [[G_MAX] * 4] and plan.ks == [4] * 4 and [r.strategy for r in plan.rows] == ["onnx"] * 4
    assert "speculation predicts" in ctl.last_plan and not plan.shared
    ctl._plain = (4, 2)  # a plain plan held: no lookup is asked, no row drafts
    plan = ctl.plan(streams, [100] * 4, offers=lambda caps: asked.append(caps) or [["onnx"]] * 4)
    assert plan.shared and plan.ks == [0] * 4 and len(asked) == 1
