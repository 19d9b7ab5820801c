"""The cost gate, driven by an injected clock: every switch and every second of on/off time is exact."""

from __future__ import annotations

import pytest

from hetero_spec.tuning.gate import CostGate


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_slow_draft_turns_speculation_off_then_probes_and_comes_back():
    clk = Clock()
    g = CostGate(probe_interval_s=0.5, min_rounds=3, clock=clk)
    for _ in range(3):  # 30 ms per draft token against a 10 ms verification: gamma 4 costs 120 ms
        g.observe_proposal(draft_s=0.030, n_tokens=1, transfer_s=0.0001)
        g.observe_verify(0.010)
        g.observe_round(4, 0)
        clk.t += 0.1
        g.decide(4)
    assert not g.on and "draft+transfer" in g.switches[-1]["reason"]
    assert g.drafting is False
    clk.t += 0.4
    g.decide(4)
    assert not g.probing  # not yet: 0.4 s < probe_interval_s
    clk.t += 0.2
    g.decide(4)
    assert g.probing and g.drafting and not g.on  # the worker drafts in the background; the target does not wait
    assert g.wait_budget(4, default=0.01) == pytest.approx(0.010 * 0.5)  # no fresh timing yet: half a step
    g.observe_proposal(draft_s=0.001, n_tokens=1, transfer_s=0.0001)  # the draft is fast again
    clk.t += 0.05
    g.decide(4)
    assert g.on and not g.probing and g.switches[-1]["on"] and "probe" in g.switches[-1]["reason"]
    s = g.summary()
    assert s["n_switches"] == 2
    # on from 100.0 to 100.3 (third decide), off until the probe came back at 100.95
    assert s["time_spec_on_s"] == pytest.approx(0.3) and s["time_spec_off_s"] == pytest.approx(0.65)


def test_a_probe_that_is_still_slow_stays_off():
    clk = Clock()
    g = CostGate(probe_interval_s=0.5, min_samples=1, min_rounds=0, clock=clk)
    g.observe_verify(0.010)
    g.observe_proposal(0.050, 1, None)
    g.decide(4)
    assert not g.on
    clk.t += 1.0
    g.decide(4)
    assert g.probing
    g.observe_proposal(0.050, 1, None)
    g.decide(4)
    assert not g.on and not g.probing and len(g.switches) == 1


def test_rounds_without_draft_tokens_turn_it_off():
    g = CostGate(clock=Clock())
    g.observe_verify(0.010)
    for _ in range(2):
        g.observe_wait(0)
    g.decide(4)
    assert not g.on and "no draft tokens" in g.switches[-1]["reason"]


def test_empty_waits_count_as_misses_only_until_the_draft_has_reported_timings():
    """After min_samples draft timings, a wait that runs out empty is noise (a short budget on a busy machine),
    not evidence: the timings decide, and a draft that is fast enough stays on."""
    g = CostGate(clock=Clock())
    g.observe_verify(0.010)
    for _ in range(g.min_samples):
        g.observe_proposal(0.001, 1, 0.0002)
    for _ in range(10):
        g.observe_wait(0)
        g.decide(4)
    assert g.on and g.misses == 0 and g.switches == []
    # one timing short of min_samples: misses still count
    h = CostGate(clock=Clock())
    h.observe_verify(0.010)
    for _ in range(h.min_samples - 1):
        h.observe_proposal(0.001, 1, 0.0002)
    for _ in range(h.max_misses):
        h.observe_wait(0)
    h.decide(4)
    assert not h.on and "no draft tokens" in h.switches[-1]["reason"]


def test_wait_budget_is_the_predicted_draft_time_capped_at_one_verification():
    g = CostGate(clock=Clock())
    assert g.wait_budget(4, default=0.02) == pytest.approx(0.01)  # nothing known: half the default
    g.observe_verify(0.010)
    g.observe_proposal(0.0004, 1, 0.0002)
    assert g.wait_budget(4, default=0.02) == pytest.approx(min(0.010, (4 * 0.0004 + 0.0002) * 1.5 + 0.0005))
    g.observe_proposal(0.004, 1, 0.0002)  # slower: capped at one verification
    assert g.wait_budget(8, default=0.02) == pytest.approx(0.010)


def test_disabled_gate_never_switches():
    clk = Clock()
    g = CostGate(enabled=False, clock=clk)
    for _ in range(5):
        g.observe_proposal(1.0, 1, None)
        g.observe_verify(0.001)
        assert g.decide(4)
    assert g.on and g.switches == []


def test_a_block_is_worth_more_verifications_when_rounds_commit_more_tokens():
    """The measured case: a noisy draft sample of 15.5 ms per block against a 9.4 ms verify. With rounds
    committing ~4.8 tokens a block is worth 2.4 verifies, so speculation stays on; with nothing accepted it
    is worth one verify, so the same costs turn it off."""
    for per_round, on in ((4.8, True), (1.0, False)):
        g = CostGate(min_rounds=4, clock=Clock())
        for _ in range(4):
            g.observe_verify(0.0094)
            g.observe_proposal(0.0155 / 8, 1, 0.0)
            g.observe_round(8, int(per_round) - 1 if per_round > 1 else 0)
            g.tokens_per_round.value = per_round  # exact, not the moving average of the ints above
            g.decide(8)
        assert g.on is on, per_round
        assert g.worth() == pytest.approx(max(1.0, 0.5 * per_round))
    g = CostGate(clock=Clock())
    g.observe_round(0, 0)  # a round without drafts says nothing about acceptance
    assert g.tokens_per_round.value is None and g.worth() == 1.0


def test_no_cost_off_before_min_rounds():
    """A cold first round (a slow draft sample, nothing accepted) does not turn a request off."""
    g = CostGate(min_rounds=4, clock=Clock())
    for i in range(4):
        g.observe_verify(0.0074)
        g.observe_proposal(0.0077 / 6, 1, None)
        g.observe_round(6, 0)
        assert g.decide(6) is (i < 3), i  # off only once 4 rounds have shown the draft does not pay


def _tuned(acceptance: float):
    """A Tuning whose cost model is known: verify 5 ms + 0.4 ms per token, acceptance as given."""
    from hetero_spec.tuning.gamma import Tuning

    t = Tuning(prior_acceptance=acceptance, prior_weight=1e9)
    t.observe(2, 0, 0.005 + 0.0004 * 3, None)
    t.observe(8, 0, 0.005 + 0.0004 * 9, None)
    t.observe_draft_token(0.0006)
    return t


def test_with_a_cost_model_the_gate_decides_by_predicted_goodput():
    """Draft blocks dearer than a verify (the cost rule alone would turn this off) but accepted often:
    the model says speculation pays, so it stays on; with acceptance near zero it goes off."""
    for a, on in ((0.85, True), (0.02, False)):
        g = CostGate(tuning=_tuned(a), min_rounds=0, clock=Clock())
        for _ in range(4):
            g.observe_verify(0.005)
            g.observe_proposal(0.012, 1, 0.0001)  # 12 ms per draft token: gamma 4 costs 48 ms
            g.observe_round(4, 3)
            g.decide(4)
        assert g.pays() is on and g.on is on, a
        if not on:
            reason = g.switches[-1]["reason"]
            assert reason.startswith("cost model: no gamma beats the target alone (acceptance 0.02, draft ")
            assert "verify 5.00 + 0.40 ms/token" in reason


def test_a_probe_measures_acceptance_against_the_targets_own_tokens():
    """Turned off by an acceptance estimated low early on, the gate used to stay off for good: a probe refreshed
    only the draft's timings. With shadow comparisons (greedy, coupled) the probe waits for probe_tested of them,
    they join the estimate, and a draft that agrees turns speculation back on; one that does not stays off.
    A request that cannot compare (rejection sampling) decides at the first timings, as before."""
    for agree, shadow, on in ((True, True, True), (False, True, False), (True, False, False)):
        clk = Clock()
        tuning = _tuned(0.7)
        tuning.prior_weight = 4.0
        for _ in range(3):  # a cold start: nothing accepted in 5 tested, so 0.31 with the prior
            tuning.acceptance.observe(8, 0)
        g = CostGate(tuning=tuning, probe_interval_s=0.5, min_rounds=0, min_samples=1, clock=clk)
        g.begin_request(shadow=shadow)
        g.observe_verify(0.005)
        g.observe_proposal(0.024, 8, 0.0001)  # 3 ms a draft token: at 0.31 no gamma pays
        g.decide(4)
        assert not g.on and "acceptance 0.31, draft 3.00 ms/token" in g.switches[-1]["reason"]
        clk.t += 0.5
        g.decide(4)
        assert g.probing
        g.observe_proposal(0.024, 8, 0.0001)  # fresh timings
        if shadow:
            for _ in range(3):  # at most 6 compared, short of probe_tested: no decision yet
                g.observe_shadow(2, 2) if agree else g.observe_shadow(1, 0)
                g.decide(4)
                assert g.probing and not g.on
            for _ in range(20):
                g.observe_shadow(2, 2) if agree else g.observe_shadow(1, 0)
            g.decide(4)
        else:
            g.decide(4)
        assert not g.probing and g.on is on, (agree, shadow)


def test_the_gate_persists_across_requests():
    clk = Clock()
    g = CostGate(probe_interval_s=0.5, min_rounds=0, min_samples=1, clock=clk)
    g.observe_verify(0.010)
    g.observe_proposal(0.050, 1, None)
    g.decide(4)
    assert not g.on
    clk.t += 0.2
    g.begin_request()  # a new request: still off, the measurements kept, the accounting fresh
    assert not g.on and g.switches == [] and g.time_off_s == 0.0 and g.draft_tok_s.value == pytest.approx(0.050)
    clk.t += 0.4
    g.decide(4)  # the probe interval counts from the switch, across the request boundary
    assert g.probing and g.time_off_s == pytest.approx(0.4)


def test_the_runtime_keeps_one_gate_for_all_requests(monkeypatch, llama_target, llama_copy_onnx):
    from tests.fixtures.memworker import FixedGate
    from tests.test_pipelined_mem import mem_engine

    cfg = {"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
           "draft": {"kind": "onnx", "model": str(llama_copy_onnx)},
           "runtime": {"mode": "two_process", "pin_cpus": False, "heartbeat_s": 1e6}}
    eng, _ = mem_engine(monkeypatch, cfg, llama_copy_onnx)
    with eng:
        eng.generate([5, 17, 33, 2], max_new_tokens=6)
        first = eng.runtime._gate
        eng.generate([5, 17, 33, 2], max_new_tokens=6)
        assert eng.runtime._gate is first and isinstance(first, FixedGate)
        eng.runtime.make_gate = lambda: FixedGate("off")  # a new factory is honoured at the next request
        out = eng.generate([5, 17, 33, 2], max_new_tokens=6)
        assert eng.runtime._gate is not first and out.stats["drafted"] == 0


class _Chan:
    """A worker channel of the target side that delivers only what the test puts in."""

    def __init__(self, clock):
        self.clock, self.inbox, self.sent, self.closed, self.dropped = clock, [], [], False, 0

    def send(self, msg, *arrays):
        self.sent.append(msg)
        return True

    def recv(self, timeout_s):
        if self.inbox:
            return self.inbox.pop(0)
        self.clock.t += timeout_s or 0.0
        return None

    def reject(self, why):
        self.dropped += 1


def test_a_worker_still_reading_the_prompt_makes_no_misses():
    """Until the worker's first proposal of a request (it may still be reading the prompt, beside the target's
    prefill), rounds that wait in vain do not count as misses; after it they do (while the gate has fewer than
    min_samples timings)."""
    import numpy as np
    from types import SimpleNamespace

    from hetero_spec.runtime.pipelined import DraftLink
    from hetero_spec.sampling import SamplingParams
    from hetero_spec.scheduler import Request
    from hetero_spec.transport.protocol import Proposal

    clk = Clock()
    ch = _Chan(clk)
    w = SimpleNamespace(channel=ch, links={})
    sup = SimpleNamespace(current=lambda: w, check=lambda w: True, heard=lambda w, m: None, fail=lambda w, r: None)
    gate = CostGate(clock=clk)
    prompt = [5, 6, 7]
    link = DraftLink(sup, Request(prompt, 16, SamplingParams(), 3), gate, 7, None, 100, clock=clk)
    link.begin(prompt)
    ids = list(prompt)
    for _ in range(2 * gate.max_misses):  # the target decodes alone meanwhile
        assert link.gather(ids, 3, True, first_wait_s=0.01).ids == []
        ids.append(1)
        link.sync(ids)
        gate.decide(3)
    assert gate.misses == 0 and gate.on
    ch.inbox.append((Proposal(req_id=link.req_id, epoch=0, base=3, start=3, draft_s=0.003, draft_t0=0.0,
                              sent=clk.t, timed=3), [np.asarray([1, 1, 1, 1, 9], np.int32)]))
    assert link.gather(ids, 3, True, first_wait_s=0.01).ids == [9]  # heard: the part past what is committed
    ids.append(2)  # a correction: nothing usable until the worker drafts again
    link.sync(ids)
    for _ in range(gate.max_misses):
        assert link.gather(ids, 3, True, first_wait_s=0.01).ids == []
    assert gate.misses == gate.max_misses


def test_after_a_correction_the_target_verifies_the_new_streams_first_token_without_waiting_for_a_block():
    """A correction drops the worker's stream; the worker drafts a new one and sends its first token alone. The
    target verifies as soon as that token is here (the tokens drafted meanwhile make the next block) instead of
    waiting out the budget for a whole block."""
    import numpy as np
    from types import SimpleNamespace

    from hetero_spec.runtime.pipelined import DraftLink
    from hetero_spec.sampling import SamplingParams
    from hetero_spec.scheduler import Request
    from hetero_spec.transport.protocol import Proposal

    clk = Clock()
    ch = _Chan(clk)
    w = SimpleNamespace(channel=ch, links={})
    sup = SimpleNamespace(current=lambda: w, check=lambda w: True, heard=lambda w, m: None, fail=lambda w, r: None)
    gate = CostGate(clock=clk)
    gate.observe_verify(0.010)
    prompt = [5, 6, 7]
    link = DraftLink(sup, Request(prompt, 16, SamplingParams(), 4), gate, 9, None, 100, clock=clk)
    link.begin(prompt)

    def proposal(epoch, start, toks):
        return (Proposal(req_id=link.req_id, epoch=epoch, base=start, start=start, draft_s=0.001 * len(toks),
                         draft_t0=0.0, sent=clk.t, timed=len(toks)), [np.asarray(toks, np.int32)])

    ch.inbox.append(proposal(0, 3, [1, 2, 3, 4]))
    ids = list(prompt)
    assert link.gather(ids, 4, True, first_wait_s=0.01).ids == [1, 2, 3, 4]
    ids += [1, 9]  # the target accepted 1 and corrected 2 -> 9
    link.sync(ids)
    t = clk.t
    ch.inbox.append(proposal(1, 5, [11]))  # the new stream's first token, sent alone
    assert link.gather(ids, 4, True, first_wait_s=0.01).ids == [11]
    assert clk.t == t  # not one empty wait: a whole block would have waited out the budget
    ch.inbox.append(proposal(1, 6, [12, 13, 14, 15]))
    ids += [11, 12]  # the next round: back to whole blocks
    t = clk.t
    assert link.gather(ids, 4, True, first_wait_s=0.01).ids == [13, 14, 15]
    assert clk.t > t  # waited (in vain) for a 4th token
