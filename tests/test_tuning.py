"""Tuning: the cost model's formulas on constructed numbers, the online estimates, gamma: auto (lossless, with
its choices in stats), and `hetero-spec profile` on tiny models."""

from __future__ import annotations

import json

import pytest

from hetero_spec import Engine
from hetero_spec.errors import ConfigError
from hetero_spec.profile_cmd import run_profile
from hetero_spec.tuning import placement, profile
from hetero_spec.tuning.controller import Tuning
from hetero_spec.tuning.cost_model import Acceptance, CostModel, expected_tokens, fit_line
from hetero_spec.tuning.profile import load_tuning

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [40, 41, 42, 43, 44, 40, 41, 42]]


def test_expected_tokens_and_line_fit():
    assert expected_tokens(0.0, 8) == 1.0 and expected_tokens(1.0, 8) == 9.0 and expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert fit_line([(1, 3.0), (2, 5.0), (4, 9.0)]) == pytest.approx((1.0, 2.0))
    assert fit_line([(3, 2.0), (3, 4.0)]) == (3.0, 0.0)


def test_expected_tokens_run_aware():
    # first token 0.5, then 1.0: half the rounds commit all g drafts plus one, the others only the target's
    assert expected_tokens(1.0, 4, a_first=0.5) == pytest.approx(1 + 0.5 * 4)
    assert expected_tokens(0.7, 6, a_first=0.7) == pytest.approx(expected_tokens(0.7, 6))  # i.i.d. when equal
    assert expected_tokens(0.9, 0, a_first=0.2) == 1.0


def test_round_time_by_layout():
    m = CostModel(verify_fixed_s=0.005, verify_per_token_s=0.0004, draft_token_s=0.0006, transfer_s=0.0001)
    v = 0.005 + 0.0004 * 9
    assert m.verify(8) == pytest.approx(v)
    assert m.round_time(8, 0.8, "in_process") == pytest.approx(8 * 0.0006 + v)
    assert m.round_time(8, 0.8, "two_process") == pytest.approx(v + 0.0001 + (1 - 0.8 ** 8) * 8 * 0.0006)
    assert m.round_time(0, 0.8, "in_process") == pytest.approx(0.005 + 0.0004)
    assert m.goodput(8, 0.8, "in_process") == pytest.approx(expected_tokens(0.8, 8) / (8 * 0.0006 + v))
    with pytest.raises(ValueError, match="layout"):
        m.round_time(2, 0.5, "three_process")


def test_best_gamma_depends_on_the_hardware():
    """Long blocks pay where a verify costs the same for any length (a wide GPU), short ones where each
    verified token costs (a CPU); nothing pays with a useless draft."""
    gpu = CostModel(verify_fixed_s=0.020, verify_per_token_s=0.00005, draft_token_s=0.0005)
    cpu = CostModel(verify_fixed_s=0.005, verify_per_token_s=0.0008, draft_token_s=0.0012)
    g_gpu, _ = gpu.best_gamma(0.85, "in_process")
    g_cpu, _ = cpu.best_gamma(0.85, "in_process")
    assert g_gpu > g_cpu >= 1
    assert cpu.best_gamma(0.02, "in_process")[0] == 0  # target alone is faster
    # overlapping the draft (two_process) makes longer blocks pay than drafting in turn
    assert cpu.best_gamma(0.85, "two_process")[0] >= g_cpu


def test_best_gamma_equals_the_argmax_of_goodput():
    """best_gamma inlines goodput's formulas (it runs every round): over random costs, acceptance (out of range
    too), run-aware acceptance, layouts and limits it returns exactly the argmax of `goodput` (the smallest gamma
    among equals) and that goodput, floats and all."""
    import random

    rng = random.Random(7)
    for _ in range(3000):
        m = CostModel(rng.uniform(1e-4, 1e-2), rng.choice([0.0, rng.uniform(0, 1e-3)]),
                      rng.choice([0.0, rng.uniform(0, 3e-3)]), rng.choice([0.0, rng.uniform(0, 1e-3)]),
                      rng.choice([0.0, rng.uniform(0, 2e-3)]))
        a = rng.choice([0.0, 1.0, rng.uniform(-0.2, 1.2), rng.random()])
        a_first = rng.choice([None, 0.0, 1.0, rng.random()])
        layout = rng.choice(["in_process", "two_process"])
        g_max = rng.choice([0, 1, 4, 16, 64])
        ref = max(range(g_max + 1), key=lambda g: (m.goodput(g, a, layout, a_first), -g))
        assert m.best_gamma(a, layout, g_max, a_first) == (ref, m.goodput(ref, a, layout, a_first))
    with pytest.raises(ValueError, match="layout"):
        m.best_gamma(0.5, "three_process")


def test_acceptance_counts_only_tested_tokens():
    acc = Acceptance()
    acc.observe(4, 4)  # all accepted: 4 tested
    acc.observe(4, 1)  # one accepted, then a rejection: 2 tested
    acc.observe(0, 0)  # no drafts: nothing
    assert (acc.accepted, acc.tested) == (5, 6)
    assert acc.rate(prior=0.5, weight=2) == pytest.approx((5 + 1) / 8)


def test_online_model_needs_two_block_lengths_and_a_draft_timing():
    t = Tuning()
    t.observe_verify(4, 0.007)
    assert t.model() is None
    t.observe_verify(8, 0.009)
    assert t.model() is None  # the draft not timed yet
    t.draft_token_s = 0.0005
    m = t.model()
    # verify = c0 + c1 * tokens through (5, 7 ms) and (9, 9 ms): c1 = 0.5 ms, c0 = 4.5 ms
    assert m.verify_per_token_s == pytest.approx(0.0005) and m.verify_fixed_s == pytest.approx(0.0045)
    assert m.draft_token_s == pytest.approx(0.0005)


def test_the_line_outlives_a_window_of_plain_steps():
    """After VERIFY_WINDOW passes of one length (rounds at gamma 0) the window cannot fit a line; the model keeps the
    last line fitted instead of being lost, and a later pass of another length fits it again."""
    from hetero_spec.tuning.controller import VERIFY_WINDOW

    t = Tuning()
    t.observe_verify(4, 0.007)
    t.observe_verify(8, 0.009)
    t.draft_token_s = 0.0005
    for _ in range(VERIFY_WINDOW - 1):
        t.observe_verify(0, 0.004)
    # the window: the pass of 8 drafts and 255 plain steps, a line through (1, 4 ms) and (9, 9 ms)
    before = t.model()
    assert before.verify_per_token_s == pytest.approx(0.005 / 8) and before.verify_fixed_s == pytest.approx(0.003375)
    t.observe_verify(0, 0.004)  # the pass of 8 leaves the window
    assert {x for x, _ in t.verify_points} == {1}
    m = t.model()
    assert m is not None
    assert (m.verify_fixed_s, m.verify_per_token_s) == (before.verify_fixed_s, before.verify_per_token_s)
    assert m.verify(0) == pytest.approx(0.004)  # measured
    t.observe_verify(8, 0.012)  # a longer pass: the window has two lengths again and refits
    assert t.model().verify_per_token_s == pytest.approx((0.012 - 0.004) / 8)


def test_a_block_is_priced_against_the_step_of_its_time():
    """Plain steps are timed every round and blocks rarely: when the machine's load doubles the step, a block timed
    before costs double too (else drafting looks free against the slow step)."""
    t = Tuning()
    t.draft_token_s = 0.01
    for _ in range(3):
        t.observe_verify(0, 0.030)
        t.observe_verify(1, 0.036)
    assert t.model().verify(1) == pytest.approx(0.036)
    for _ in range(5):
        t.observe_verify(0, 0.060)  # the load doubles
    m = t.model()
    assert m.verify(0) == pytest.approx(0.060) and m.verify(1) == pytest.approx(0.072)
    assert t.measured[1] == pytest.approx(0.036)  # what was seen stays as seen (profiles read it)
    for _ in range(3):
        t.observe_verify(1, 0.070)  # blocks timed again: their own time, against today's step
    assert t.model().verify(1) == pytest.approx(0.070)


def test_the_verify_curve_measured_at_start_is_what_the_model_predicts(monkeypatch):
    """seed_verify_curve: V(k) timed per k (a fake target on a fake clock, whose passes take rows in pairs) becomes
    the cost model's curve, where a line through the first lengths would not follow it; real passes take over."""
    from hetero_spec.tuning import profile

    clock = [0.0]
    monkeypatch.setattr(profile.time, "perf_counter", lambda: clock[0])

    class Paired:  # a pass costs 10 ms plus 4 ms per pair of rows: k = 1 costs what k = 0 does
        cached = 0

        def new_state(self):
            return self

        def prefill(self, state, ids):
            state.n_cached = len(ids)

        def verify(self, state, last, drafts, greedy):
            clock[0] += 0.010 + 0.004 * ((len(drafts) + 2) // 2)

        def rollback(self, state, n):
            state.n_cached = n

        def release_state(self, state):
            pass

    t = Tuning()
    curve = profile.seed_verify_curve(t, Paired(), prompt_len=12)
    want = {k: 0.010 + 0.004 * ((k + 2) // 2) for k in range(profile.CURVE_K + 1)}
    assert curve == pytest.approx(want)
    t.draft_token_s = 0.001
    m = t.model()
    assert [m.verify(k) for k in range(9)] == pytest.approx([want[k] for k in range(9)])
    for _ in range(3):  # three real passes of one length outvote its two seeded ones
        t.observe_verify(3, 0.05)
    assert t.model().verify(3) == pytest.approx(0.05) and t.model().verify(2) == pytest.approx(want[2])


def test_config_accepts_auto_and_names_a_bad_gamma(llama_target):
    from hetero_spec.config import build_config

    assert build_config({"target": {"model": str(llama_target)}, "speculation": {"gamma": "auto"}}) \
        .speculation.gamma == "auto"
    with pytest.raises(ConfigError, match="speculation.gamma"):
        build_config({"target": {"model": str(llama_target)}, "speculation": {"gamma": "fast"}})


@pytest.fixture(scope="module")
def reference(llama_target):
    with Engine.from_config({"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
                             "draft": {"kind": "none"}}) as eng:
        return [eng.generate(p, max_new_tokens=40).token_ids for p in PROMPTS]


def test_gamma_auto_is_lossless_and_reports_its_choices(monkeypatch, llama_target, llama_random_onnx, reference):
    from tests.fixtures.memworker import mem_engine

    base = {"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
            "draft": {"kind": "onnx", "model": str(llama_random_onnx)}, "speculation": {"gamma": "auto"}}
    with Engine.from_config(base) as eng:
        assert sorted(eng.tuning.measured) == list(range(9))  # the verify curve, measured at start
        for _ in range(2):
            for p, ref in zip(PROMPTS, reference):
                out = eng.generate(p, max_new_tokens=40)
                assert out.token_ids == ref
                ga = out.stats["extra"]["gamma_auto"]
                assert sum(ga["choices"].values()) == out.stats["rounds"] and ga["last_reason"]
        assert eng.tuning.acceptance.tested > 0  # learned across requests
    two = {**base, "runtime": {"mode": "two_process", "pin_cpus": False, "heartbeat_s": 1e6}}
    eng, _ = mem_engine(monkeypatch, two, llama_random_onnx, state=None)  # the real controller
    with eng:
        for p, ref in zip(PROMPTS, reference):
            out = eng.generate(p, max_new_tokens=40)
            assert out.token_ids == ref
            assert sum(out.stats["extra"]["gamma_auto"]["choices"].values()) == out.stats["rounds"]  # each round


def test_profile_quick_writes_a_model_that_gamma_auto_loads(monkeypatch, tmp_path, llama_target, llama_copy_onnx,
                                                            llama_random_onnx, reference):
    pf = tmp_path / "calib.jsonl"
    pf.write_text("\n".join(json.dumps({"token_ids": p}) for p in PROMPTS * 2) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"target: {{model: {llama_target}, dtype: float32, device: cpu}}\n"
                   f"draft: {{kind: onnx, model: {llama_copy_onnx}}}\n")
    lines: list[str] = []
    monkeypatch.setattr(placement, "allowed_cpus", lambda: 2)  # two layouts to measure, whatever the machine
    prof = run_profile(cfg, tmp_path / "p" / "prof.yaml", quick=True, prompts_file=pf, say=lines.append,
                       drafts=[llama_random_onnx])
    assert (tmp_path / "p" / "prof.yaml").is_file() and (tmp_path / "p" / "prof.png").read_bytes()[:4] == b"\x89PNG"
    assert len(lines) >= 7 and any(line.startswith("wrote") for line in lines)
    # each draft measured: the copy draft (the target itself) is accepted, the random one is not
    assert list(prof["drafts"]) == [str(llama_copy_onnx), str(llama_random_onnx)]
    assert prof["drafts"][str(llama_copy_onnx)]["acceptance"] > prof["drafts"][str(llama_random_onnx)]["acceptance"]
    assert prof["recommended_draft"] == str(llama_copy_onnx)
    # every layout: predicted and measured goodput
    rows = prof["placement"]["candidates"]
    assert {(r["mode"], r["target_threads"], r["draft_threads"]) for r in rows} == \
        {("in_process", 2, 1), ("in_process", 2, 2), ("two_process", 1, 1)}
    assert all(r["predicted_tok_s"] > 0 and r["measured_tok_s"] > 0 for r in rows)
    assert placement.profile_costs(tmp_path / "p" / "prof.yaml").verify.keys() == {1, 2}
    assert set(prof["measured"]["verify_s"]) == {"1", "2", "4", "8", "12", "16"}
    overhead = prof["measured"]["step_overhead"]  # the torch target has no ONNX session; the onnx draft has
    assert overhead["target"] is None and set(overhead["draft"]) == {"step_ms", "run_ms", "overhead_ms"}
    assert overhead["draft"]["run_ms"] > 0
    assert prof["acceptance"]["per_token"] >= 0.95  # the copy draft is the target itself
    assert set(prof["recommended_gamma"]) == {"in_process", "two_process"}
    t = load_tuning(tmp_path / "p" / "prof.yaml")
    assert t.profile.draft_token_s == pytest.approx(prof["cost_model"]["draft_token_s"])
    # a shared pass against batch size, up to serving.max_batch (8 by default), seeds the batch plan
    assert set(prof["batch"]["shared_pass_s"]) == {"1", "2", "4", "8"}
    assert prof["batch"]["recommended_max_batch"] in (1, 2, 4, 8)
    assert sorted(x for x, _ in t.shared.points) == [1, 2, 4, 8] and t.shared.line() is not None
    assert t.recommended_batch == prof["batch"]["recommended_max_batch"]
    # each precision the torch CPU target runs, and target.precision auto takes the recommendation only when lossy
    # output is allowed
    cands = prof["precision"]["candidates"]
    assert set(cands) == {"fp32", "int8"} and prof["precision"]["recommended"] in cands
    assert all(c["predicted_tok_s"] > 0 and 0 <= c["acceptance"] <= 1 for c in cands.values())
    assert t.recommended_precision == prof["precision"]["recommended"]
    with Engine.from_config(cfg, overrides={"target.precision": "auto",
                                            "speculation.profile": str(tmp_path / "p" / "prof.yaml")}) as eng:
        assert eng.config.target.precision == "fp32"  # allow_lossy is off
    with Engine.from_config(cfg, overrides={"speculation.gamma": "auto", "serving.max_batch": "auto",
                                            "target.precision": "auto", "target.allow_lossy": True,
                                            "speculation.profile": str(tmp_path / "p" / "prof.yaml")}) as eng:
        assert eng.config.target.precision == prof["precision"]["recommended"]
    with Engine.from_config(cfg, overrides={"speculation.gamma": "auto", "serving.max_batch": "auto",
                                            "speculation.profile": str(tmp_path / "p" / "prof.yaml")}) as eng:
        assert eng.config.serving.max_batch == prof["batch"]["recommended_max_batch"]
        out = eng.generate(PROMPTS[0], max_new_tokens=40)
        assert out.token_ids == reference[0]
        assert "exploring" not in out.stats["extra"]["gamma_auto"]["last_reason"]  # the profile is the model
    bad = tmp_path / "bad.yaml"
    bad.write_text("cost_model: {verify_fixed_s: 1}\n")
    with pytest.raises(ConfigError, match=r"speculation.profile.*not a profile"):
        Engine.from_config(cfg, overrides={"speculation.profile": str(bad)})


def test_step_overhead_is_a_step_less_its_sessions_run(monkeypatch):
    """profile.step_overhead_s on a fake clock: a decoder whose step takes 5 ticks, 3 of them the session's run,
    reports (5, 3); a decoder without the shared layout reports nothing."""
    from types import SimpleNamespace

    now = [0.0]
    monkeypatch.setattr(profile.time, "perf_counter", lambda: now[0])

    class Session:
        def run_with_iobinding(self, binding):
            assert binding == "bound"
            now[0] += 3.0

    class Decoder:
        shared, session = True, Session()

        def new_state(self):
            return SimpleNamespace(n_past=0, binding="bound")

        def append(self, state, tokens):
            now[0] += 2.0
            self.session.run_with_iobinding(state.binding)
            state.n_past += len(tokens)

        def rewind(self, state, n_keep):
            state.n_past = n_keep

    assert profile.step_overhead_s(Decoder(), [1, 2, 3], reps=4) == (5.0, 3.0)
    copy_layout = Decoder()
    copy_layout.shared = False
    assert profile.step_overhead_s(copy_layout, [1, 2, 3], reps=4) is None


def test_onnx_drafter_times_its_catch_up(llama_copy_onnx):
    from hetero_spec.draft.onnx_drafter import OnnxDrafter
    from hetero_spec.sampling import SamplingParams

    d = OnnxDrafter(llama_copy_onnx)
    d.begin(PROMPTS[0], SamplingParams())
    d.propose(3)
    assert d.last_catchup_s > 0  # the prompt was fed in the first step
    d.commit(3, 9)
    d.propose(3)
    assert d.last_catchup_s == 0.0  # only the last draft and the bonus token were pending: a normal step


def test_draft_selection_is_lossless_and_prefers_what_pays(llama_target, llama_random_onnx, reference):
    """Candidates [onnx, ngram]: every output equals the target alone; each strategy is explored, and with a
    cost model the choice follows predicted goodput (per-strategy stats in stats.extra.draft_selection)."""
    cfg = {"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
           "draft": {"kind": "onnx", "model": str(llama_random_onnx), "candidates": ["onnx", "ngram"]},
           "speculation": {"gamma": 4}}
    with Engine.from_config(cfg) as eng:
        assert eng.source.cands["onnx"].proposer.catchup_skip == 4  # draft.catchup_skip: next to a lookup
        for _ in range(2):
            for p, ref in zip(PROMPTS, reference):
                out = eng.generate(p, max_new_tokens=40)
                assert out.token_ids == ref
        sel = out.stats["extra"]["draft_selection"]
        assert {n.partition("@")[0] for n in sel["strategies"]} == {"onnx", "ngram"}  # the lookup per match length
        rounds = {b: sum(s["rounds"] for n, s in sel["strategies"].items() if n.partition("@")[0] == b)
                  for b in ("onnx", "ngram")}
        assert min(rounds.values()) >= 2 and sel["last_reason"]


def _chooser(model, costs, layouts=None):
    from hetero_spec.draft.base import DraftCosts
    from hetero_spec.tuning.controller import StrategyChooser

    fns = {n: (lambda n=n: costs[n] if isinstance(costs[n], DraftCosts) else DraftCosts(costs[n])) for n in costs}
    ch = StrategyChooser(list(costs), Tuning(profile=model), layouts or {n: "in_process" for n in costs}, fns,
                         prior_acceptance=0.5, explore_rounds=0)
    for st in ch.stats.values():
        st.last_round = 10 ** 6  # not stale
    ch._round = 10 ** 6
    return ch


def test_selector_choice_follows_the_model():
    model = CostModel(verify_fixed_s=0.005, verify_per_token_s=0.0004, draft_token_s=0.0006)
    sel = _chooser(model, {"onnx": 0.0006, "ngram": 0.000001})
    sel.stats["onnx"].acceptance = Acceptance(accepted=90, tested=100)  # accepted often, 0.6 ms per token
    sel.stats["ngram"].acceptance = Acceptance(accepted=5, tested=100, first_accepted=5, first_tested=98)  # rarely
    name, g = sel.choose(8)
    assert name == "onnx" and g >= 2 and sel.reason.startswith("onnx: predicts")
    sel.stats["onnx"].acceptance = Acceptance(accepted=0, tested=1000, first_tested=1000)  # now useless too
    sel.stats["ngram"].acceptance = Acceptance(accepted=0, tested=1000, first_tested=1000)
    assert sel.choose(8) == (None, 0) and sel.reason.startswith("none:")
    # a lookup that is right in runs (a copy: the first token 40 %, then 95 %), free, beats a model draft that
    # is right 70 % of the time per token, and at a long gamma: the run-aware estimate sees the runs
    sel.stats["onnx"].acceptance = Acceptance(accepted=700, tested=1000, first_accepted=190, first_tested=300)
    sel.stats["ngram"].acceptance = Acceptance(accepted=400 + 95 * 40, tested=1000 + 100 * 40,
                                               first_accepted=400, first_tested=1000)
    name, g = sel.choose(16)
    assert name == "ngram" and g >= 8, (name, g, sel.reason)


def test_draft_candidates_errors(llama_target, llama_random_onnx):
    base = {"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"}}
    with pytest.raises(ConfigError, match="onnx among the candidates needs draft.kind: onnx"):
        Engine.from_config({**base, "draft": {"kind": "ngram", "candidates": ["onnx", "ngram"]}})
    with pytest.raises(ConfigError, match="each strategy may appear once"):
        Engine.from_config({**base, "draft": {"kind": "onnx", "model": str(llama_random_onnx),
                                              "candidates": ["ngram", "ngram"]}, "runtime": {"mode": "two_process"}})


def test_selection_counts_a_models_catch_up_in_its_round(llama_copy_onnx):
    """In process, a model round first feeds what the lookup committed since the model last drafted. That cost
    is the model's, per round (its source's costs): enough of it and the target alone is predicted faster."""
    from hetero_spec.draft.base import DraftCosts
    from hetero_spec.draft.ngram import NgramProposer
    from hetero_spec.draft.onnx_drafter import OnnxDrafter
    model = CostModel(verify_fixed_s=0.005, verify_per_token_s=0.0004, draft_token_s=0.0006)
    costs = {"onnx": DraftCosts(0.0006), "ngram": DraftCosts(0.000001)}
    sel = _chooser(model, costs)
    sel.stats["onnx"].acceptance = Acceptance(accepted=60, tested=100)
    free, g = sel.predict(model, "onnx", 8)
    assert g >= 1 and free > 1 / model.verify(0)
    costs["onnx"] = DraftCosts(0.0006, None, 0.002)  # 2 ms a round
    dear, _ = sel.predict(model, "onnx", 8)
    assert dear < free and sel.summary()["strategies"]["onnx"]["catchup_ms_per_round"] == pytest.approx(2.0)
    costs["onnx"] = DraftCosts(0.0006, None, 0.012)  # 12 ms a round: the target alone wins
    assert sel.choose(8, ["onnx"]) == (None, 0)
    # in two processes the worker catches up on its own cores: not counted against the round
    sel.layouts["onnx"] = "two_process"
    assert sel.predict(model, "onnx", 8)[0] > dear
    # a model candidate next to a lookup feeds at most draft.catchup_skip tokens of the lookup's text (the Engine
    # builds it so: test_draft_selection_is_lossless_and_prefers_what_pays); every request's drafter does
    drafter = OnnxDrafter(llama_copy_onnx, catchup_skip=3)
    assert drafter.spawn().catchup_skip == 3 and OnnxDrafter(llama_copy_onnx).spawn().catchup_skip is None
