"""The speculation controller (tuning/controller.py) on constructed costs, and the worker link's waiting, driven
by an injected clock: every decision here is a pure function of the inputs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hetero_spec.tuning.controller import EXPLORE, PROBE_BUDGET, PROBE_EVERY, PROBE_GAMMA, Controller, Tuning
from hetero_spec.tuning.cost_model import CostModel, expected_tokens


def _tuned(acceptance: float, draft_token_s: float = 0.0006, weight: float = 1e9) -> Tuning:
    """A Tuning whose cost model is known: verify 5 ms + 0.4 ms per token, acceptance as given."""
    t = Tuning(prior_acceptance=acceptance, prior_weight=weight)
    t.observe_verify(2, 0.005 + 0.0004 * 3)
    t.observe_verify(8, 0.005 + 0.0004 * 9)
    t.draft_token_s = draft_token_s
    return t


def test_it_explores_then_follows_the_model_and_learns_across_streams():
    t = Tuning(prior_acceptance=0.7)
    ctl = Controller(t, "in_process", batch_blocks=False)
    sc = ctl.stream("auto")
    assert [ctl.plan([sc], [100]).ks[0] for _ in range(3)] == list(EXPLORE) and "exploring" in sc.reason
    for k, n, v in zip(EXPLORE, (1, 1, 3), (0.006, 0.007, 0.009)):
        ctl.observe(sc, k, n, v)
    ctl.observe_costs(0.0005, None)
    g = ctl.plan([sc], [100]).ks[0]
    a = ctl.estimate(sc)
    assert g == t.model().best_gamma(a, "in_process")[0] and f"a={a:.3f}" in sc.reason
    # the next stream starts from what this one learned (the engine-wide estimate), not from the prior
    other = ctl.stream("auto")
    assert ctl.estimate(other) == pytest.approx(t.global_acceptance()) != pytest.approx(0.7)
    fixed = ctl.stream(5)
    assert ctl.plan([fixed], [100]).ks == [5] and ctl.plan([fixed], [3]).ks == [2]  # the room left: max_new, context
    want = {str(e): 1 for e in EXPLORE}
    want[str(g)] = 1 + (g in EXPLORE)
    assert ctl.end(sc)["gamma_auto"]["choices"] == want


def test_streams_keep_their_own_state():
    """One controller serves every stream: a new stream resets nothing of another's, and one stream's rejections
    lower its own estimate more than the engine-wide one the others start from."""
    t = _tuned(0.8, weight=4.0)
    ctl = Controller(t, "two_process", batch_blocks=False)
    a, b = ctl.stream("auto"), ctl.stream("auto")
    for _ in range(5):
        ctl.observe(a, 4, 0, None)
    ga = ctl.plan([a], [100]).ks[0]
    before = (ctl.estimate(a), dict(a.choices))
    c = ctl.stream("auto")  # a third request begins
    assert (ctl.estimate(a), dict(a.choices)) == before
    assert ctl.estimate(a) < ctl.estimate(b) == pytest.approx(ctl.estimate(c))
    assert ga == 0 and ctl.plan([b], [100]).ks[0] > 0  # a is off; b, with the shared estimate, is not


def test_a_drafting_row_tells_a_source_that_drafts_ahead_to_go_on():
    """In two processes the worker drafts ahead at the row's `ahead`: a sampled stream (no shadow drafting) that
    the plan asks for k > 0 drafts keeps the worker drafting, and one planned at gamma 0 lets it rest."""
    t = _tuned(0.8, weight=4.0)
    ctl = Controller(t, "two_process", batch_blocks=False)
    fixed, auto = ctl.stream(6), ctl.stream("auto")
    row = ctl.plan([fixed], [100]).rows[0]
    assert (row.k, row.ahead) == (6, 6)
    row = ctl.plan([auto], [100]).rows[0]
    assert row.k > 0 and row.ahead == row.k
    for _ in range(5):
        ctl.observe(auto, 4, 0, None)  # rejected: the stream is switched off
    row = ctl.plan([auto], [100]).rows[0]
    assert (row.k, row.ahead) == (0, 0)


def test_reprobes_back_off_while_they_fail_and_reset_on_a_hit():
    """gamma 0 (the target alone): one probe round every probe_every rounds; a failed probe doubles the period
    (kept across streams, on the Tuning), one with an accepted token resets it."""
    t = Tuning(profile=CostModel(0.005, 0.0005, 0.001), prior_acceptance=0.0, prior_weight=1e6)  # never pays
    ctl = Controller(t, "in_process", batch_blocks=False)
    probes_at = []
    sc = ctl.stream("auto")
    for r in range(1, 16 * PROBE_EVERY):
        if r % 200 == 0:
            sc = ctl.stream("auto")  # a new request: the period carries over
        g = ctl.plan([sc], [1000]).ks[0]
        if g:
            assert g == PROBE_GAMMA and sc.probing and "re-probe" in sc.reason
            probes_at.append(r)
        ctl.observe(sc, g, 0, 0.005)  # every probe fails
    gaps = [b - a for a, b in zip([0, *probes_at], probes_at)]
    assert gaps[:4] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY]
    while not ctl.plan([sc], [1000]).ks[0]:
        ctl.observe(sc, 0, 0, 0.005)
    ctl.observe(sc, PROBE_GAMMA, 1, 0.005)  # this probe hits
    assert t.probe_every == PROBE_EVERY


def test_rounds_at_gamma_0_run_as_one_until_the_re_probe():
    """A row planned at k 0 may stand for the rounds left before its re-probe (RowPlan.steps); the loop reports the
    rounds it ran (ran_plain), all of them or fewer, and the probes come on the same rounds as when every round is
    planned alone, with far fewer plans."""
    def probes(run: str) -> tuple[list[int], int]:
        t = Tuning(profile=CostModel(0.005, 0.0005, 0.001), prior_acceptance=0.0, prior_weight=1e6)  # never pays
        ctl = Controller(t, "in_process", batch_blocks=False)
        sc, r, at, plans = ctl.stream("auto"), 0, [], 0
        while r < 8 * PROBE_EVERY:
            row = ctl.plan([sc], [1000]).rows[0]
            plans, ran = plans + 1, 1
            if row.k:
                assert row.steps == 1
                at.append(r + 1)
            elif run != "one":
                assert 1 <= row.steps <= t.probe_every
                ran = row.steps if run == "all" else max(1, row.steps - 3)  # "fewer": a run cut short
                ctl.ran_plain(sc, ran)
            ctl.observe(sc, row.k, 0, 0.005)
            r += ran
        assert sum(sc.choices.values()) == r and sc.choices[PROBE_GAMMA] == len(at)  # every round counted once
        return at, plans

    one, every, fewer = probes("one"), probes("all"), probes("fewer")
    assert one[0] == every[0] == fewer[0] and len(one[0]) >= 3
    assert every[1] <= 2 * len(one[0]) + 2 < one[1] // 4


def test_a_draft_that_never_pays_costs_at_most_the_probe_budget():
    """Failed re-probes wait until the rounds at gamma 0 since cost 1 / PROBE_BUDGET times the probe's measured
    cost above a plain round. A useless draft whose probe costs 8 steps (a catch-up of the text, then its drafts):
    from its first probe on (the one before any cost is known), on the clock the costs make, the probes' share of
    the time is within the budget, where doubling alone (the period capped at PROBE_EVERY_MAX) spends more."""
    step_s, probe_draft_s = 0.03, 0.2

    def share_of_time(rounds: int, measured: bool) -> tuple[float, int]:
        profile = CostModel(verify_fixed_s=0.02, verify_per_token_s=0.01, draft_token_s=0.02)  # V(0) = step_s
        t = Tuning(profile=profile, prior_acceptance=0.0, prior_weight=1e6)
        ctl = Controller(t, "in_process", batch_blocks=False)
        sc, probe_s, total_s, probed = ctl.stream("auto"), 0.0, 0.0, False
        for _ in range(rounds):
            g = ctl.plan([sc], [1000]).ks[0]
            verify_s = profile.verify(g)
            round_s = verify_s + (probe_draft_s if g else 0.0)
            ctl.observe(sc, g, 0, verify_s, draft_s=(probe_draft_s if g else 0.0) if measured else None)
            if probed:
                probe_s, total_s = probe_s + round_s - step_s, total_s + round_s
            probed = probed or g > 0
        return probe_s / total_s, t.probe_every

    share, period = share_of_time(20000, measured=True)
    assert share <= PROBE_BUDGET and period >= (probe_draft_s + 0.02) / (PROBE_BUDGET * step_s)
    unpriced, _ = share_of_time(20000, measured=False)
    assert unpriced > 1.2 * PROBE_BUDGET  # the floor is what keeps it in budget


def test_never_slower_than_the_target_alone_by_prediction():
    """Draft blocks dearer than a verify, but accepted often: speculation pays and stays; with acceptance near zero,
    or a draft slower than verification in two processes, no gamma beats the target alone: 0."""
    for a, d, layout, on in ((0.85, 0.0006, "in_process", True), (0.02, 0.0006, "in_process", False),
                             (0.85, 0.012, "two_process", True), (0.85, 0.030, "in_process", False)):
        t = _tuned(a, d)
        ctl = Controller(t, layout, batch_blocks=False)
        sc = ctl.stream("auto")
        g = ctl.plan([sc], [100]).ks[0]
        model = t.model()
        assert (g > 0) is on, (a, d, layout)
        if g:
            assert model.goodput(g, ctl.estimate(sc), layout) > 1 / model.verify(0)


def test_a_slow_worker_turns_speculation_off_and_fast_timings_bring_it_back():
    """Two processes: the worker's proposals report its cost per token (WorkerSource.costs); at 30 ms a token
    against a 6 ms step nothing pays, and once it drafts fast again (it keeps drafting in the background) the next
    plan speculates. No probe round is needed: the costs come with the proposals."""
    t = _tuned(0.6)
    ctl = Controller(t, "two_process", batch_blocks=False)
    sc = ctl.stream("auto")
    ctl.observe_costs(0.030, 0.0001)
    assert ctl.plan([sc], [100]).ks == [0]
    ctl.observe_costs(0.001, 0.0001)
    assert ctl.plan([sc], [100]).ks[0] > 0


def test_the_wait_budget_is_what_the_drafts_cost_capped_at_one_step():
    t = Tuning()
    ctl = Controller(t, "two_process", batch_blocks=False)
    assert ctl.wait_budget(4, default_s=0.010) == pytest.approx(0.005)  # nothing measured: half the default
    t.draft_token_s = 0.001  # still no verify line: capped by the default
    assert ctl.wait_budget(4, default_s=0.004) == pytest.approx(0.004)
    t = _tuned(0.8, 0.001)
    t.transfer_s = 0.0002
    ctl = Controller(t, "two_process", batch_blocks=False)
    assert ctl.wait_budget(2, 1.0) == pytest.approx((2 * 0.001 + 0.0002) * 1.5 + 0.0005)
    assert ctl.wait_budget(16, 1.0) == pytest.approx(t.model().verify(0))  # never more than one step


def test_local_source_times_drafting_without_the_catch_up():
    """A round whose first draft step also fed the prompt (or a backlog) is timed without that step: one slow
    prefill must not make the controller believe the draft is slow (it once chose gamma 0 for a request)."""
    from hetero_spec.draft.base import Draft
    from hetero_spec.draft.ngram import NgramProposer
    from hetero_spec.draft.source import LocalSource

    src = LocalSource(NgramProposer())
    src._observe(0.004, [SimpleNamespace(last_catchup_s=0.0)], [Draft(ids=[1] * 8)], [False])
    assert src.costs().token_s == pytest.approx(0.0005)
    src = LocalSource(NgramProposer())
    src._observe(0.0335, [SimpleNamespace(last_catchup_s=0.030)], [Draft(ids=[1] * 8)], [True])
    assert src.costs().token_s == pytest.approx(0.0005) and src.costs().catchup_s == 0.0  # the prompt: not catch-up
    src._observe(0.030, [SimpleNamespace(last_catchup_s=0.030)], [Draft(ids=[1])], [False])
    assert src.costs().token_s == pytest.approx(0.0005) and src.costs().catchup_s > 0  # one token: no sample


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class _Chan:
    """A worker channel of the target side that delivers only what the test puts in."""

    def __init__(self, clock):
        self.clock, self.inbox, self.sent, self.closed, self.dropped = clock, [], [], False, 0

    def send(self, msg, *arrays):
        self.sent.append((msg, arrays))
        return True

    def recv(self, timeout_s):
        if self.inbox:
            return self.inbox.pop(0)
        self.clock.t += timeout_s or 0.0
        return None

    def reject(self, why):
        self.dropped += 1


def _link(clk, gamma=4, params=None, vocab=100):
    from hetero_spec.runtime.pipelined import DraftLink, LinkCosts
    from hetero_spec.sampling import SamplingParams

    ch = _Chan(clk)
    w = SimpleNamespace(channel=ch)
    sup = SimpleNamespace(current=lambda: w, check=lambda w: True, heard=lambda w, m: None, fail=lambda w, r: None)
    link = DraftLink(sup, 1, params or SamplingParams(), gamma, 2 * gamma + 1, LinkCosts(), {}, None, vocab,
                     clock=clk)
    return link, ch


def _proposal(link, clk, epoch, start, toks, probs=None):
    from hetero_spec.transport.protocol import Proposal

    arrays = [np.asarray(toks, np.int32)] + ([probs] if probs is not None else [])
    return (Proposal(req_id=link.req_id, epoch=epoch, base=start, start=start, draft_s=0.001 * len(toks),
                     draft_t0=0.0, sent=clk.t, timed=len(toks)), arrays)


def test_after_a_correction_the_target_verifies_the_new_streams_first_token_without_waiting_for_a_block():
    """A correction drops the worker's stream; the worker drafts a new one and sends its first token alone. The
    target verifies as soon as that token is here (the tokens drafted meanwhile make the next block) instead of
    waiting out the budget for a whole block."""
    clk = Clock()
    link, ch = _link(clk)
    prompt = [5, 6, 7]
    link.begin(prompt)
    ch.inbox.append(_proposal(link, clk, 0, 3, [1, 2, 3, 4]))
    ids = list(prompt)
    assert link.gather(ids, 4, 0.010).ids == [1, 2, 3, 4]
    ids += [1, 9]  # the target accepted 1 and corrected 2 -> 9
    link.sync(ids)
    t = clk.t
    ch.inbox.append(_proposal(link, clk, 1, 5, [11]))  # the new stream's first token, sent alone
    assert link.gather(ids, 4, 0.010).ids == [11]
    assert clk.t == t  # not one empty wait: a whole block would have waited out the budget
    ch.inbox.append(_proposal(link, clk, 1, 6, [12, 13, 14, 15]))
    ids += [11, 12]  # the next round: back to whole blocks
    t = clk.t
    assert link.gather(ids, 4, 0.010).ids == [13, 14, 15]
    assert clk.t > t  # waited (in vain) for a 4th token
    assert link.costs.draft_tok_s.value == pytest.approx(0.001)  # what the proposals said drafting cost


@pytest.mark.parametrize("bad,why", [
    (np.full((2, 100), np.nan, np.float32), "NaN"),
    (np.full((2, 100), -0.01, np.float32), "negative"),
    (np.full((2, 100), 0.02, np.float32), "do not sum to 1"),
    (np.full((2, 50), 0.02, np.float32), "shape"),
    (np.full((1, 100), 0.01, np.float32), "1 distributions for 2 tokens"),
])
def test_draft_distributions_from_the_wire_are_checked(bad, why):
    """Rejection sampling divides by q: a NaN, a negative, an unnormalized or a misshaped q from the wire is
    refused and counted, and the target verifies nothing from it (it decodes alone)."""
    from hetero_spec.sampling import SamplingParams

    clk = Clock()
    link, ch = _link(clk, gamma=2, params=SamplingParams(temperature=1.0, seed=1, sampling="rejection"))
    link.begin([5, 6, 7])
    ch.inbox.append(_proposal(link, clk, 0, 3, [1, 2], bad))
    draft = link.gather([5, 6, 7], 2, 0.0)
    assert draft.ids == [] and link.rejected == 1 and ch.dropped == 1
    good = np.full((2, 100), 0.01, np.float32)
    ch.inbox.append(_proposal(link, clk, 0, 3, [1, 2], good))
    draft = link.gather([5, 6, 7], 2, 0.0)
    assert draft.ids == [1, 2] and draft.probs.shape == (2, 100)


def test_draft_selection_re_probes_on_the_controllers_one_schedule():
    """A strategy left unchosen is re-probed after Tuning.probe_every rounds, the period gamma probes use; a
    re-probe that gets nothing accepted doubles it for both, one that gets a token accepted resets it."""
    from hetero_spec.draft.base import DraftCosts

    t = _tuned(0.5)
    ctl = Controller(t, "in_process", batch_blocks=False)
    sel = ctl.selection(["onnx", "ngram"], {"onnx": "in_process", "ngram": "in_process"},
                        {"onnx": lambda: DraftCosts(0.0006), "ngram": lambda: DraftCosts(1e-6)})
    for _ in range(4):  # each strategy explored twice
        name = sel.choose(8)[0]
        assert sel.reason.startswith("exploring")
        sel.observe_round(name, 4, 4 if name == "onnx" else 0)
    reprobes = []
    for r in range(600):
        name, g = sel.choose(8)
        if sel.reason.startswith("re-probing"):
            reprobes.append((r, name))
        if name:
            sel.observe_round(name, g, g if name == "onnx" else 0)  # the n-gram never agrees
    assert reprobes and all(n == "ngram" for _, n in reprobes)
    gaps = [b - a for (a, _), (b, _) in zip(reprobes, reprobes[1:])]
    assert gaps[0] < gaps[1] < gaps[2] and t.probe_every > PROBE_EVERY  # doubled by the failed re-probes
    name = sel.choose(8)[0]
    sel._probing[0] = "ngram"  # a re-probe that hits
    sel.observe_round("ngram", 3, 2)
    assert t.probe_every == PROBE_EVERY


def test_draft_selection_keeps_each_streams_probe_and_moves_once_a_round():
    """Two streams choose in one round: the first re-probes the n-gram, the second (which cannot use it) chooses
    otherwise; the first's probe outcome still counts. And the round clock moves once a round, not once a row."""
    from hetero_spec.draft.base import DraftCosts

    t = _tuned(0.5)
    ctl = Controller(t, "in_process", batch_blocks=False)
    sel = ctl.selection(["onnx", "ngram"], {"onnx": "in_process", "ngram": "in_process"},
                        {"onnx": lambda: DraftCosts(0.0006), "ngram": lambda: DraftCosts(1e-6)})
    for _ in range(4):  # each explored twice
        name = sel.choose(8)[0]
        sel.observe_round(name, 4, 4 if name == "onnx" else 0)
    for _ in range(t.probe_every):  # rounds of two rows each, both choosing the model
        sel.next_round()
        for stream in (1, 2):
            assert sel.choose(8, ["onnx"], stream=stream, round_started=True)[0] == "onnx"
            sel.observe_round("onnx", 4, 4, stream=stream)
    assert sel._round == 4 + t.probe_every  # one tick a round
    before = t.probe_every
    sel.next_round()
    assert sel.choose(8, stream=1, round_started=True)[0] == "ngram" and sel.reason.startswith("re-probing")
    assert sel.choose(8, ["onnx"], stream=2, round_started=True)[0] == "onnx"
    sel.observe_round("ngram", 3, 0, stream=1)  # stream 1's re-probe missed: the period doubles
    sel.observe_round("onnx", 4, 4, stream=2)
    assert t.probe_every == 2 * before


def test_gamma_follows_the_measured_curve_where_it_is_not_a_line():
    """int4 kernels on AVX2 take a block's rows two at a time: a pass of 2 tokens costs little more than 1, one
    of 3 much more. Fitted as a line the curve says gamma 2; the passes seen per length say gamma 1, and a
    length's cost is the median of its recent passes (one stalled pass does not move it)."""
    step, pair, per = 0.060, 0.070, 0.024  # V(0), V(1), then V(g) = V(1) + per * (g - 1)
    curve = {0: step, 1: pair, **{g: pair + per * (g - 1) for g in range(2, 9)}}
    t = Tuning(prior_acceptance=0.9, prior_weight=1e9)
    for _ in range(3):
        for g in (0, 1, 2, 4, 8):
            t.observe_verify(g, curve[g])
    t.observe_verify(1, 10 * pair)  # a stalled pass
    t.draft_token_s = 0.015
    model = t.model()
    assert model.verify(1) == pytest.approx(pair) and model.verify(3) != pytest.approx(curve[3])  # 3: the line
    line = CostModel(model.verify_fixed_s, model.verify_per_token_s, model.draft_token_s)
    assert line.best_gamma(0.9, "in_process")[0] >= 2
    assert model.best_gamma(0.9, "in_process")[0] == 1
    t.reset_costs()
    assert t.measured == {} and t.model() is None


def test_one_stalled_pass_does_not_take_its_block_length_out_of_the_choice():
    """A block length seen once, in a stalled pass, is priced on the line until enough passes of it are seen: its
    own median would price it at the stall, the plan would stop choosing it, and nothing would ever correct it."""
    fixed, per = 0.0015, 0.0001  # a flat line: V(g) = fixed + per * (g + 1)
    t = Tuning(prior_acceptance=0.9, prior_weight=1e9)
    for _ in range(50):  # the passes the line is fitted from (it keeps the last 256)
        for g in (0, 8):
            t.observe_verify(g, fixed + per * (g + 1))
    t.draft_token_s = 0.0003
    best = t.model().best_gamma(0.9, "in_process")[0]
    t.observe_verify(best, 20 * (fixed + per * (best + 1)))  # once, stalled
    model = t.model()
    assert best not in t.measured and model.verify(best) < 2 * (fixed + per * (best + 1))
    rate = {g: expected_tokens(0.9, g) / model.round_time(g, 0.9, "in_process") for g in range(1, 17)}
    assert rate[best] > 0.9 * max(rate.values())  # still a contender, not priced at the stall
    for _ in range(2):
        t.observe_verify(best, fixed + per * (best + 1))  # with two normal passes the median is a normal one
    assert t.measured[best] == pytest.approx(fixed + per * (best + 1))


def test_draft_selection_learns_the_verify_line_without_an_engine_wide_draft_cost():
    """Selection's candidates time themselves (DraftCosts), so no engine-wide draft cost is ever set: the chooser
    still gets a cost model from the passes seen, and explores with short blocks of varying length until then."""
    from hetero_spec.draft.base import DraftCosts

    t = Tuning(prior_acceptance=0.8)
    ctl = Controller(t, "in_process", batch_blocks=False)
    sel = ctl.selection(["onnx", "ngram"], {"onnx": "in_process", "ngram": "in_process"},
                        {"onnx": lambda: DraftCosts(0.02), "ngram": lambda: DraftCosts(1e-6)})
    seen = []
    for _ in range(4):  # each candidate explored twice
        name, g = sel.choose(16)
        assert sel.reason.startswith("exploring") and g <= max(EXPLORE)
        seen.append(g)
        sel.observe_round(name, g, g)
        ctl.observe(ctl.stream("auto"), g, g, 0.06 + 0.02 * (g + 1))
    assert len(set(seen)) > 1 and t.draft_token_s is None
    name, g = sel.choose(16)
    assert not sel.reason.startswith(("exploring", "no cost model")) and name is not None and g > 0


def test_a_lookup_is_judged_per_matched_length():
    """The n-gram lookup competes as "ngram@n" (n: the suffix length it matched): a long match that is usually
    right wins over the model, a one-token match that is usually wrong does not, though both are "ngram"."""
    from hetero_spec.draft.base import DraftCosts

    t = _tuned(0.8)
    t.observe_verify(1, 0.005 + 0.0004 * 2)
    ctl = Controller(t, "in_process", batch_blocks=False)
    sel = ctl.selection(["onnx", "ngram"], {"onnx": "in_process", "ngram": "in_process"},
                        {"onnx": lambda: DraftCosts(0.002), "ngram": lambda: DraftCosts(1e-6)})
    for _ in range(40):
        sel.observe_round("onnx", 4, 3)
        sel.observe_round("ngram@3", 4, 4)
        sel.observe_round("ngram@1", 4, 0)
    assert sel.choose(8, ["onnx", "ngram@3"])[0] == "ngram@3"
    assert sel.choose(8, ["onnx", "ngram@1"])[0] == "onnx"
    assert {"ngram@1", "ngram@3"} <= set(sel.summary()["strategies"]) and "ngram" not in sel.summary()["strategies"]


def test_a_useless_draft_stays_judged_through_long_runs_at_gamma_0():
    """Rounds at gamma 0 fill the verify window with plain steps; the cost model must outlive that, or the
    controller explores again (blocks of 1, 2, 4 for each new stream, each feeding the draft its text) and a useless
    draft costs a few percent for good. Here every round after the first judgement is gamma 0 or a re-probe."""
    t = Tuning(prior_acceptance=0.7, prior_weight=4.0)
    ctl = Controller(t, "in_process", batch_blocks=False)
    step, per_token = 0.030, 0.006
    t.draft_token_s = 0.020

    def verify(k: int) -> float:
        return step + per_token * k

    ks, reasons = [], []
    for stream_no in range(6):  # requests one after another, 300 tokens each
        sc = ctl.stream("auto", stream_id=stream_no)
        left = 300
        while left > 0:
            plan = ctl.plan([sc], [left + 1])
            k = plan.ks[0]
            ks.append(k)
            reasons.append(sc.reason)
            if k:  # the draft's catch-up (0.15 s) and its tokens; nothing accepted
                ctl.observe(sc, k, 0, verify(k), draft_s=0.15 + t.draft_token_s * k)
                left -= 1
                continue
            n = min(plan.rows[0].steps, left)  # the scheduler's plain run: every step observed as a round
            for _ in range(n):
                ctl.observe(sc, 0, 0, verify(0), plan.rows[0], draft_s=0.0)
            ctl.ran_plain(sc, n)
            left -= n
        ctl.end(sc)
    first_judged = ks.index(0)
    assert first_judged <= len(EXPLORE) + 1
    assert not any(r.startswith("exploring") for r in reasons[first_judged:])
    assert set(ks[first_judged:]) <= {0, PROBE_GAMMA}
    # a failed probe (0.15 s of catch-up and 2 drafts above a 30 ms step) waits some 670 rounds for the next
    assert ks[first_judged:].count(PROBE_GAMMA) <= 3
