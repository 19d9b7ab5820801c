"""The two-process protocol, deterministic: the real target loop and the real worker code, connected by
in-memory channels (tests/fixtures/memworker.py) with a ticking clock. No second process, no threads
in the data path, no wall-clock outcomes: every count asserted here is a pure function of the inputs.

Covers: identity; corrections on the demo pair, repeated exactly; the worker dying in every state (speculating,
off; during Begin; mid-block) with identical output and a restart; a fuzz of 1000
malformed frames, all dropped and counted, with identical output.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hetero_spec import Engine

from hetero_spec.transport.protocol import Begin, End, Proposal, Sync
from tests.conftest import hf_greedy
from tests.fixtures.fuzz import fuzz_frames
from tests.fixtures.memworker import mem_engine, worker_of

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 17, 33, 2, 99, 100, 7]


def _cfg(target, draft, **runtime):
    rt = {"mode": "two_process", "pin_cpus": False, "restart_backoff_s": 0.01, "heartbeat_s": 1e6, **runtime}
    return {"target": {"model": str(target), "dtype": "float32", "device": "cpu"},
            "draft": {"kind": "onnx", "model": str(draft)}, "runtime": rt}


def wait_for_restart(eng, generation: int, timeout_s: float = 60.0):
    """The supervisor restarts in a background thread: wait (not a timing assertion) for a newer worker."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        w = worker_of(eng).sup.current()
        if w is not None and w.generation > generation:
            return w
        time.sleep(0.02)
    raise AssertionError("the draft worker was not restarted")


# -- identity and determinism -------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [1, 4])
def test_mem_identity_and_every_round_gets_a_full_block(monkeypatch, llama_target, llama_copy_onnx, gamma):
    eng, _ = mem_engine(monkeypatch, _cfg(llama_target, llama_copy_onnx, trace=True), llama_copy_onnx)
    with eng:
        out = eng.generate(PROMPT, max_new_tokens=30, gamma=gamma)
    assert out.token_ids == hf_greedy(llama_target, PROMPT, 30)
    # the worker drafts ahead (it runs until idle whenever the target looks), so every round finds its
    # whole block there: k = min(gamma, tokens left - 1), never fewer
    for _t0, _t1, pos, k in out.stats["extra"]["timeline"]["verify"]:
        left = 30 - (pos - len(PROMPT))
        assert k == min(gamma, left - 1), out.stats["extra"]["timeline"]["verify"]
    assert out.stats["extra"]["draft_failures"] == 0 and out.stats["extra"]["dropped_messages"] == 0


def test_mem_shadow_acceptance_turns_speculation_stuck_off_back_on(monkeypatch, llama_target, llama_copy_onnx):
    """The real controller, with gamma auto and an acceptance estimated near 0 (a cold start gone wrong): no gamma
    pays, so the target decodes alone; the worker keeps drafting the greedy request's stream in the background,
    the target compares those tokens with the ones it decodes alone (shadow acceptance: the copy draft agrees
    with all of them), and speculation comes back on within the request. A fixed cost model (the profile) and
    the ticking clock make every decision deterministic."""
    from hetero_spec.runtime import pipelined
    from hetero_spec.tuning.cost_model import CostModel

    monkeypatch.setattr(pipelined, "IDLE_CHECK_S", 0.001)  # the ticking clock: an idle check every few rounds
    eng, _ = mem_engine(monkeypatch, _cfg(llama_target, llama_copy_onnx), llama_copy_onnx, state=None)
    with eng:
        eng.tuning.profile = CostModel(verify_fixed_s=0.005, verify_per_token_s=0.0004, draft_token_s=0.001)
        for _ in range(20):
            eng.tuning.acceptance.observe(8, 0)
        assert eng.tuning.global_acceptance() < 0.12  # at 1 ms a draft token, no gamma pays below 0.15
        out = eng.generate(PROMPT, max_new_tokens=80, gamma="auto")
    assert out.token_ids == hf_greedy(llama_target, PROMPT, 80)
    choices = out.stats["extra"]["gamma_auto"]["choices"]
    assert choices.get("0", 0) > 0 and out.stats["drafted"] > 0, choices
    assert eng.tuning.global_acceptance() > 0.3  # from 0.12: what the shadow comparisons and rounds measured


def test_mem_rejections_identity(monkeypatch, llama_target, llama_random_onnx):
    eng, _ = mem_engine(monkeypatch, _cfg(llama_target, llama_random_onnx), llama_random_onnx)
    with eng:
        for gamma in (2, 5):
            out = eng.generate(PROMPT, max_new_tokens=30, gamma=gamma)
            assert out.token_ids == hf_greedy(llama_target, PROMPT, 30)
            assert out.stats["drafted"] > 0 and out.stats["accept_hist"][0] > 0


@pytest.mark.parametrize("schedule", ["idle", "lazy"])
def test_mem_coupled_sampling_equals_target_only_with_the_same_seed(monkeypatch, llama_target, llama_random_onnx,
                                                                    schedule):
    """Coupled sampling across processes: tokens only on the wire, and the output is target-only sampling
    with the same seed, whatever gamma and whenever the worker's tokens arrive."""
    with Engine.from_config({"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
                             "draft": {"kind": "none"}}) as alone:
        ref = {seed: alone.generate(PROMPT, max_new_tokens=30, temperature=0.8, top_k=40, seed=seed).token_ids
               for seed in (11, 2 ** 64 - 1)}
    cfg = _cfg(llama_target, llama_random_onnx)
    cfg["speculation"] = {"sampling": "coupled"}
    eng, _ = mem_engine(monkeypatch, cfg, llama_random_onnx, schedule=schedule)
    with eng:
        for seed in ref:
            for gamma in (1, 4, 8):
                out = eng.generate(PROMPT, max_new_tokens=30, temperature=0.8, top_k=40, seed=seed, gamma=gamma)
                assert out.token_ids == ref[seed], (seed, gamma)
                assert out.stats["drafted"] > 0


def test_demo_pair_corrections_repeat_exactly(monkeypatch, demo_draft_int4):
    """The shipped pair accepts most tokens but not all; a busy worker ("lazy": it runs only while the target
    waits) has not answered the target's Sync when the target looks again, so corrections meet stale streams.
    The output is the target's own, and every count repeats exactly."""
    cfg = {"target": {"model": str(ROOT / "models/target"), "dtype": "float32", "device": "cpu"},
           "draft": {"kind": "onnx", "model": str(demo_draft_int4)},
           "runtime": {"mode": "two_process", "pin_cpus": False, "heartbeat_s": 1e6}}
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(ROOT / "models/target/tokenizer.json")).encode(
        "def read_config(path):\n    with open(path) as f:\n").ids
    eng, launcher = mem_engine(monkeypatch, cfg, demo_draft_int4, schedule="lazy")
    with eng:
        a = eng.generate(ids, max_new_tokens=64, gamma=8)
        b = eng.generate(ids, max_new_tokens=64, gamma=8)
    assert a.token_ids == hf_greedy(ROOT / "models/target", list(ids), 64)[:len(a.token_ids)]
    assert a.stats["rounds"] > a.stats["accept_hist"][-1]  # some blocks were corrected
    for key in ("rounds", "drafted", "accepted", "accept_hist"):  # deterministic, run to run
        assert a.stats[key] == b.stats[key]
    assert a.stats["extra"]["stale_proposals"] == b.stats["extra"]["stale_proposals"]


# -- the worker dies, in every state ------------------------------------------------------------------
def _nth(kind, n):
    """A kill predicate: the n-th message of `kind` (in either direction)."""
    seen = {"n": 0}

    def pred(direction, msg):
        if isinstance(msg, kind):
            seen["n"] += 1
            return seen["n"] == n
        return False
    return pred


@pytest.mark.parametrize("state, kill", [
    ("on", (Sync, 3)),          # mid-request, while speculating
    ("on", (Proposal, 2)),      # mid-block: the worker dies as it sends
    ("on", (Begin, 1)),         # during Begin: the worker never sees the request
    ("off", (Sync, 1)),         # speculation off (the worker drafts in the background)
    ("off", (Sync, 2)),
    ("on", (End, 1)),           # as the request ends
])
def test_worker_death_in_every_state(monkeypatch, llama_target, llama_random_onnx, state, kill):
    eng, launcher = mem_engine(monkeypatch, _cfg(llama_target, llama_random_onnx), llama_random_onnx, state=state)
    ref = hf_greedy(llama_target, PROMPT, 30)
    with eng:
        launcher.kill_when(_nth(*kill))
        first = worker_of(eng).sup.current().generation
        out = eng.generate(PROMPT, max_new_tokens=30, gamma=3)
        assert out.token_ids == ref
        assert launcher.killed, "the kill never happened"
        eng.health()  # an idle Engine probes for real: a death not yet noticed is noticed here
        w = wait_for_restart(eng, first)
        assert worker_of(eng).sup.failures >= 1 and worker_of(eng).sup.restarts >= 1
        again = eng.generate(PROMPT, max_new_tokens=30, gamma=3)
        assert again.token_ids == ref
        assert worker_of(eng).sup.current() is w and launcher.workers[-1].alive


def test_fuzz_1000_frames_dropped_counted_and_output_identical(monkeypatch, llama_target, llama_copy_onnx):
    eng, launcher = mem_engine(monkeypatch, _cfg(llama_target, llama_copy_onnx), llama_copy_onnx)
    ref = hf_greedy(llama_target, PROMPT, 30)
    with eng:
        mw = launcher.workers[-1]
        real_send = mw.worker_end.send
        state = {"sent": 0}

        def send_with_fuzz(msg, *arrays):  # 500 bad frames before each of the worker's first 2 proposals
            if isinstance(msg, Proposal) and state["sent"] < 1000:
                for frames in fuzz_frames(500, msg.req_id, eng.target.vocab_width, seed=state["sent"]):
                    mw.target_end.inject(frames)
                state["sent"] += 500
            return real_send(msg, *arrays)

        mw.worker_end.send = send_with_fuzz
        out = eng.generate(PROMPT, max_new_tokens=30, gamma=3)
    assert state["sent"] == 1000
    assert out.token_ids == ref
    assert out.stats["extra"]["dropped_messages"] == 1000
    assert out.stats["drafted"] > 0


# -- one worker, several requests taking turns --------------------------------------------------------
def test_requests_batched_on_one_worker_with_joins_and_a_cancel(monkeypatch, llama_target, llama_copy_onnx):
    """Four requests start together (fixed gammas 1-4 and auto, greedy and seeded sampling), a fifth joins after
    the first's 2nd round, the third is cancelled after its 3rd: they run as one batch, and the one worker
    drafts for all of them (a stream each, with its own epochs). Each output equals its solo run; every stream
    is closed at the end."""
    from tests.test_batch import PROMPTS as BATCH_PROMPTS
    from tests.test_batch import _req, _run_batch

    cfg = _cfg(llama_target, llama_copy_onnx)
    eng, launcher = mem_engine(monkeypatch, cfg, llama_copy_onnx)
    with eng:
        solo = {i: eng.generate(BATCH_PROMPTS[i], **_req(i)) for i in range(5)}
        mw = launcher.workers[-1].worker
        streams_seen = []
        real_step = mw.step
        mw.step = lambda *a, **k: streams_seen.append(len(mw.streams)) or real_step(*a, **k)
        sinks, stats = _run_batch(eng)
        for i in (0, 1, 3, 4):
            assert sinks[i].ids == solo[i].token_ids, f"request {i} differs from its solo run"
            assert stats[i].finish_reason == "length" and stats[i].drafted > 0
        assert stats[2].finish_reason == "cancelled" and sinks[2].chunks == 3
        assert sinks[2].ids == solo[2].token_ids[:len(sinks[2].ids)]
        assert stats[0].extra["batch"]["largest_batch"] == 5 and stats[4].extra["batch"]["rounds_batched"] > 0
        assert max(streams_seen) == 5  # the worker held all five streams at once
        launcher.workers[-1].run()  # the in-memory worker reads what was sent since the target last looked
        assert mw.streams == {}  # each request's End closed its stream


def test_the_worker_dies_while_requests_share_rounds(monkeypatch, llama_target, llama_copy_onnx):
    """The worker is killed mid-way (at the 6th Sync, several streams open): every request finishes with its solo
    output (the target decodes alone until the restarted worker takes the streams up again)."""
    from hetero_spec.metrics import Stats
    from tests.test_batch import Collect, held

    cfg = _cfg(llama_target, llama_copy_onnx)
    eng, launcher = mem_engine(monkeypatch, cfg, llama_copy_onnx)
    prompts = [PROMPT, PROMPT[::-1], [40, 41, 42, 43, 44, 40, 41, 42]]
    with eng:
        solo = [eng.generate(p, max_new_tokens=24, gamma=3).token_ids for p in prompts]
        first = worker_of(eng).sup.current().generation
        launcher.kill_when(_nth(Sync, 6))
        sinks, stats = [Collect() for _ in prompts], [Stats() for _ in prompts]
        with held(eng):
            for p, sink, st in zip(prompts, sinks, stats):
                eng.submit(p, sink, stats=st, max_new_tokens=24, gamma=3)
        assert [s.wait() for s in sinks] == solo
        assert launcher.killed == [("to_worker", "Sync")]
        assert all(st.extra["batch"]["largest_batch"] == 3 and st.extra["batch"]["rounds_batched"] > 0
                   for st in stats)
        wait_for_restart(eng, first)
        assert eng.generate(prompts[0], max_new_tokens=24, gamma=3).token_ids == solo[0]


def test_requests_arriving_during_a_round_join_the_batch(monkeypatch, llama_target,
                                                                              llama_copy_onnx):
    """A request runs alone through the worker; three more arrive after its first round and join its batch: the
    worker drafts for all four (a stream each) and one verify_batch call per round verifies their blocks. Every
    output equals its solo run."""
    from hetero_spec.metrics import Stats
    from tests.test_batch import Collect

    eng, launcher = mem_engine(monkeypatch, _cfg(llama_target, llama_copy_onnx), llama_copy_onnx)
    prompts = [PROMPT, PROMPT[::-1], [40, 41, 42, 43, 44, 40, 41, 42], [9, 8, 7, 6, 5]]
    with eng:
        solo = [eng.generate(p, max_new_tokens=20, gamma=3).token_ids for p in prompts]
        stats = [Stats() for _ in prompts]
        sinks: list[Collect] = []

        def arrive(n):
            if n == 1:
                for p, st in zip(prompts[1:], stats[1:]):
                    sinks.append(Collect())
                    eng.submit(p, sinks[-1], stats=st, max_new_tokens=20, gamma=3)

        first = Collect(on_chunk=arrive)
        eng.submit(prompts[0], first, stats=stats[0], max_new_tokens=20, gamma=3)
        assert [first.wait()] + [s.wait() for s in sinks] == solo
        assert all(st.drafted > 0 and st.extra["batch"]["largest_batch"] == 4 for st in stats)
