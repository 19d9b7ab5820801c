"""`hetero-spec bench --scenario`: the mechanisms (prompt builder, interleaving, pairing, verdicts, report,
arguments, the useless-draft builder), driven by a fake runner and a fake clock. No timing outcome is
asserted: the fake clock makes every time a chosen number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero_spec.bench import tuning_bench as tb
from hetero_spec.bench.context import BenchError, RunOutput
from hetero_spec.cli import main

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "cpu-demo.yaml")


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeRunner:
    """Each run advances the clock by cost(arm, prompt, call number) seconds and returns the prompt's
    "output" (a function of the prompt only, unless the arm is in `wrong`)."""

    def __init__(self, clock, cost, log=None, unavailable=None, fail=(), wrong=(), stats=None):
        self.clock, self.cost, self.log = clock, cost, log if log is not None else []
        self.unavailable = dict(unavailable or {})
        self.fail, self.wrong, self.stats = set(fail), set(wrong), stats or {}
        self.calls = 0

    def prepare(self, arm):
        pass

    def run(self, arm, prompt):
        self.calls += 1
        self.log.append(arm.name)
        if arm.name in self.fail:
            raise RuntimeError("worker died")
        self.clock.t += self.cost(arm, prompt, self.calls)
        ids = [len(prompt), 7, 7] if arm.name not in self.wrong else [0, 0, 0]
        return RunOutput(ids, self.stats.get(arm.name))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def _sample(ids, wall):
    return tb.Sample(token_ids=ids, wall_s=wall, repeats_s=[wall])


# -- arguments -------------------------------------------------------------------------------------
def test_scenario_names_are_parsed_and_unknown_ones_are_refused():
    assert tb.parse_scenarios(["gamma-sweep", "useless-draft,repetitive", "gamma-sweep"]) == \
        ["gamma-sweep", "useless-draft", "repetitive"]
    with pytest.raises(BenchError, match=r"--scenario 'warp': unknown scenario; choose from gamma-sweep"):
        tb.parse_scenarios(["gamma-sweep,warp"])
    with pytest.raises(BenchError, match="no scenario given"):
        tb.parse_scenarios([" , "])
    assert tb.parse_layouts(None) is None
    assert tb.parse_layouts("two_process,in_process,two_process") == ("two_process", "in_process")
    with pytest.raises(BenchError, match="--layouts 'three_process'"):
        tb.parse_layouts("three_process")
    assert tb.parse_gammas(None, quick=False) == tuple(range(1, 17))
    assert tb.parse_gammas(None, quick=True) == tb.QUICK_SWEEP_GAMMAS
    assert tb.parse_gammas("8,2,2", quick=True) == (2, 8)
    for bad in ("2,x", "0,4", ""):
        with pytest.raises(BenchError, match="--gammas"):
            tb.parse_gammas(bad, quick=False)


def test_cli_errors_name_the_option(capsys):
    assert main(["bench", "--config", DEMO, "--scenario", "gamma-sweep,warp"]) == 2
    err = capsys.readouterr().err
    assert "--scenario 'warp'" in err and "useless-draft" in err
    assert main(["bench", "--config", DEMO, "--scenario", "repetitive", "--systems", "hetero_spec"]) == 2
    assert "--systems does not apply with --scenario" in capsys.readouterr().err
    assert main(["bench", "--config", DEMO, "--scenario", "repetitive", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
    assert main(["bench", "--config", DEMO, "--scenario", "repetitive", "--layouts", "both"]) == 2
    assert "--layouts 'both'" in capsys.readouterr().err
    assert main(["bench", "--config", DEMO, "--layouts", "in_process"]) == 2  # without --scenario
    assert "--layouts applies only with --scenario" in capsys.readouterr().err


# -- the repetitive prompt builder -------------------------------------------------------------------
def test_repetitive_text_repeats_the_first_complete_lines():
    text = "cut mid-line\nline a\nline b\n\nline c\nline d\nlast cut"
    out = tb.repetitive_text(text)
    # the cut first and last lines are dropped; the block's first half follows it again
    assert out == "line a\nline b\n\nline c\nline d\nline a\nline b\n"  # round(5 / 2) = 2 lines again
    assert out.startswith("line a\n") and out.count("line a") == 2 and "cut" not in out
    with pytest.raises(BenchError, match="needs 4 complete non-blank lines; the text has 2"):
        tb.repetitive_text("x\none\n\ntwo\ny")


def test_repetitive_prompts_skip_texts_without_enough_lines():
    texts = ["a\nb\nc", "x\n1\n2\n3\n4\ny", "no newlines at all", "x\n5\n6\n7\n8\n9\ny"]
    built = tb.repetitive_prompts(texts, lambda t: [len(t)], count=5)
    assert built == [[len(tb.repetitive_text(texts[1]))], [len(tb.repetitive_text(texts[3]))]]
    assert tb.repetitive_prompts(texts, lambda t: [1], count=1) == [[1]]


# -- interleaving, medians, pairing ------------------------------------------------------------------
def test_interleave_rotates_takes_medians_and_reports_failures():
    clock, log = FakeClock(), []
    arms = [tb.Arm("a", "e"), tb.Arm("b", "e"), tb.Arm("c", "e")]
    # durations 1, 2, 3, ... by call: a prompt's time is the median of its repeats
    runner = FakeRunner(clock, lambda arm, prompt, n: float(n), log)
    res = tb.interleave(arms, [[1], [1, 2]], repeats=3, runner=runner, clock=clock)
    assert log[:9] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert log[9:12] == ["a", "b", "c"]  # prompt 1, repeat 0: shift (1 * 3 + 0) % 3
    assert res.samples["a"][0].repeats_s == [1.0, 6.0, 8.0] and res.samples["a"][0].wall_s == 6.0
    assert [s.token_ids for s in res.samples["b"]] == [[1, 7, 7], [2, 7, 7]]
    assert res.failed == {} and res.wall_s == sum(range(1, 19))

    runner = FakeRunner(FakeClock(), lambda *a: 1.0, fail={"b"})
    res = tb.interleave(arms, [[1], [1, 2]], repeats=2, runner=runner, clock=runner.clock)
    assert set(res.samples) == {"a", "c"} and len(res.samples["a"]) == 2
    assert res.failed == {"b": "prompt 0: RuntimeError: worker died"}


def test_pairing_is_per_prompt_throughput_with_identity():
    ref = [_sample([1, 2, 3, 4], 2.0), _sample([5, 6], 1.0), _sample([7, 8], 4.0)]
    ours = [_sample([1, 2, 3, 4], 1.0), _sample([5, 6], 2.0), _sample([9, 9], 2.0)]
    p = tb.pair(ours, ref)
    assert p["ratios"] == [2.0, 0.5, 2.0] and p["median"] == 2.0 and (p["min"], p["max"]) == (0.5, 2.0)
    assert (p["won"], p["prompts"], p["identical"]) == (2, 3, 2)
    # different lengths: tokens/s over tokens/s, not a time ratio
    assert tb.throughput_ratio(_sample([1, 2], 1.0), _sample([1, 2, 3, 4], 1.0)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same prompts"):
        tb.pair(ours[:2], ref)


def test_summary_counts_acceptance_identity_and_auto_choices():
    arms = [tb.Arm(tb.TARGET_ONLY, "t"), tb.Arm("auto", "a"), tb.Arm("bad", "b")]
    stats = {"auto": {"accepted": 3, "drafted": 4, "time_draft_s": 0.002, "time_verify_s": 0.05,
                      "extra": {"gamma_auto": {"choices": {"2": 1, "10": 2}}}}}
    clock = FakeClock()
    runner = FakeRunner(clock, lambda arm, p, n: 2.0 if arm.name == tb.TARGET_ONLY else 1.0, wrong={"bad"},
                        stats=stats)
    res = tb.interleave(arms, [[1], [2, 3]], 1, runner, clock=clock)
    s = tb.summarize_pass(res, arms)
    assert s["auto"]["vs_target_only"]["median"] == 2.0 and s["auto"]["vs_target_only"]["identical"] == 2
    assert s["auto"]["acceptance"] == 0.75 and s["auto"]["gamma_auto_choices"] == {"2": 2, "10": 4}
    assert s["bad"]["vs_target_only"]["identical"] == 0
    assert s["auto"]["stage_ms"] == {"prefill": 0.0, "draft": 2.0, "verify": 50.0, "wait": 0.0, "idle": 0.0}
    assert s[tb.TARGET_ONLY]["acceptance"] is None and s[tb.TARGET_ONLY]["stage_ms"] is None


# -- scenario flow with a fake runner -----------------------------------------------------------------
SPEEDUP = {1: 1.3, 2: 1.6, 3: 1.8, 4: 2.0, 6: 1.9, 8: 1.7}


def _sweep_cost(arm, prompt, n):
    if arm.name == tb.TARGET_ONLY:
        return 1.0
    if arm.name == "auto":
        return 1.0 / 1.95
    return 1.0 / SPEEDUP[arm.gamma]


def _scenario(tmp_path, scenarios, cost, passes, unavailable=lambda engines: {}):
    clock = FakeClock()

    def make_runner(engines, warmup):
        runner = FakeRunner(clock, cost, unavailable=unavailable(engines))
        passes.append({"engines": engines, "warmup": warmup, "runner": runner})
        return passes[-1]["runner"]

    settings = tb.ScenarioSettings(config=Path(DEMO), out=tmp_path, scenarios=scenarios, gammas=tuple(SPEEDUP),
                                   layouts=("in_process", "two_process"))
    prompts = tb.PromptSet([[1, 2], [3], [4, 5, 6]], [[9]], "three prompts")
    return tb.Scenario(settings=settings, make_runner=make_runner, heldout=prompts, repetitive=prompts,
                       useless_draft=lambda: tmp_path / "useless", clock=clock, say=lambda text: None)


def test_gamma_sweep_confirms_auto_against_the_best_and_its_neighbours(tmp_path):
    passes: list = []
    sc = _scenario(tmp_path, ["gamma-sweep"], _sweep_cost, passes)
    out = tb.run_gamma_sweep(sc)
    assert list(out["layouts"]) == ["in_process", "two_process"] and len(passes) == 4
    lr = out["layouts"]["two_process"]
    assert lr["sweep_best_gamma"] == 4
    assert passes[2]["engines"]["auto"] == {"runtime.mode": "two_process", "draft.candidates": [],
                                           "speculation.gamma": "auto"}
    assert passes[3]["warmup"] == [[9]]
    confirm = lr["confirm"]
    assert list(confirm["arms"]) == [tb.TARGET_ONLY, "gamma=3", "gamma=4", "gamma=6", "auto"]
    assert confirm["repeats"] == 3 and lr["sweep"]["repeats"] == 1
    assert confirm["identical"]["auto"] == "3/3"
    v = lr["verdict"]
    assert v["best_fixed_gamma"] == 4 and v["auto_vs_best"]["median"] == pytest.approx(0.975)
    assert v["within_tolerance"] is True
    assert v["auto_vs_each"]["gamma=3"]["median"] == pytest.approx(1.95 / 1.8, abs=1e-4)


def test_best_gamma_at_the_edge_has_one_neighbour():
    summary = {f"gamma={g}": {"status": "ok", "vs_target_only": {"median": m}}
               for g, m in {1: 1.1, 2: 1.3, 3: 1.2}.items()}
    assert tb.best_and_neighbours(summary, [1, 2, 3]) == (2, [1, 3])
    summary["gamma=1"]["vs_target_only"]["median"] = 1.5
    assert tb.best_and_neighbours(summary, [1, 2, 3]) == (1, [2])
    summary["gamma=2"] = {"status": "failed", "reason": "x"}
    assert tb.best_and_neighbours(summary, [1, 2, 3]) == (1, [3])


def test_repetitive_and_useless_scenarios_report_and_render(tmp_path):
    cost = {tb.TARGET_ONLY: 1.0, "onnx": 0.8, "ngram": 0.7, "select": 0.5,
            "auto in_process": 1.0 / 0.98, "auto two_process": 1.0 / 0.9}
    passes: list = []
    sc = _scenario(tmp_path, ["repetitive", "useless-draft"], lambda arm, p, n: cost[arm.name], passes,
                   unavailable=lambda engines: {"select": "ConfigError: not in two_process"}
                   if engines.get("select", {}).get("runtime.mode") == "two_process" else {})
    scenarios = tb.run_scenarios(sc)
    rep = scenarios["repetitive"]["layouts"]
    assert rep["in_process"]["select_vs"]["onnx"]["median"] == pytest.approx(1.6)
    assert rep["in_process"]["verdict"]["select_beats_both"] is True
    assert rep["two_process"]["arms"]["select"] == {"status": "failed", "reason": "engine unavailable: "
                                                                                  "ConfigError: not in two_process"}
    assert rep["two_process"]["verdict"] == {"available": False, "select_beats_both": None}
    assert passes[1]["engines"]["ngram"]["runtime.mode"] == "in_process"  # n-gram lookup has no worker
    useless = scenarios["useless-draft"]
    assert useless["verdict"]["in_process"] == {"ratio": 0.98, "within_tolerance": True}
    assert useless["verdict"]["two_process"] == {"ratio": 0.9, "within_tolerance": False}
    assert passes[2]["engines"]["auto two_process"]["draft.model"] == str(tmp_path / "useless")

    report = {"machine": {"cpu_count": 2, "cpu_model": "test"}, "wall_s": 1.0, "scenarios": scenarios,
              "settings": {"command": "hetero-spec bench ...", "prompts": 3, "max_new_tokens": 3,
                           "method": tb.METHOD}}
    written = tb.write_outputs(tmp_path / "out", report)
    assert [p.name for p in written] == ["tuning.json", "tuning.md", "repetitive.png", "useless_draft.png"]
    assert json.loads((tmp_path / "out" / "tuning.json").read_text())["scenarios"]["repetitive"]
    md = (tmp_path / "out" / "tuning.md").read_text()
    assert "Selection beats both single strategies: yes." in md
    assert "| select | - | - | - | - | - | - | failed: engine unavailable" in md
    assert "- two_process: throughput / target-only 0.900 (goal >= 0.97): **no**" in md
    for png in written[2:]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gamma_sweep_report_renders(tmp_path):
    sc = _scenario(tmp_path, ["gamma-sweep"], _sweep_cost, [])
    report = {"machine": {"cpu_count": 2, "cpu_model": "test"}, "wall_s": 1.0,
              "scenarios": tb.run_scenarios(sc),
              "settings": {"command": "c", "prompts": 3, "max_new_tokens": 3, "method": tb.METHOD}}
    tb.write_outputs(tmp_path, report)
    md = (tmp_path / "tuning.md").read_text()
    assert "auto / best fixed gamma of the confirmation pass (gamma=4): median 0.975x" in md
    assert "Within 5 %: yes." in md and "| gamma=16 |" not in md
    assert (tmp_path / "gamma_sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_target_only_must_start(tmp_path):
    sc = _scenario(tmp_path, ["useless-draft"], lambda *a: 1.0, [],
                   unavailable=lambda engines: {tb.TARGET_ONLY: "OSError: no model"})
    with pytest.raises(BenchError, match="target-only reference did not start: engine unavailable: OSError"):
        tb.run_useless_draft(sc)


# -- the useless draft --------------------------------------------------------------------------------
def test_useless_draft_is_built_once_and_reused(tmp_path, llama_target, monkeypatch):
    import torch
    from safetensors.torch import load_file

    lines: list[str] = []
    onnx = tb.build_useless_draft(llama_target, precision="int4", block_size=32, root=tmp_path, say=lines.append)
    assert onnx.parent.name.startswith("useless-draft-") and onnx.parent.parent == tmp_path
    assert (onnx / "model.onnx").is_file() and (onnx / "tokenizer.json").read_bytes() == \
        (llama_target / "tokenizer.json").read_bytes()
    assert any("building a random" in s for s in lines) and any("export:" in s for s in lines)
    assert not list(tmp_path.glob("*.tmp-*"))  # the scratch folder was renamed into place

    from hetero_spec.draft import export as export_mod

    monkeypatch.setattr(export_mod, "export_draft", lambda *a, **k: pytest.fail("exported twice"))
    lines.clear()
    assert tb.build_useless_draft(llama_target, precision="int4", block_size=32, root=tmp_path,
                                  say=lines.append) == onnx
    assert lines == [f"useless-draft: reusing {onnx}"]
    # another seed is another draft
    assert tb.useless_key(llama_target, "int4", 32, 1) != tb.useless_key(llama_target, "int4", 32, 0)

    # the random weights are not the source's
    tb._random_checkpoint(llama_target, tmp_path / "hf", seed=0)
    ours, src = load_file(tmp_path / "hf" / "model.safetensors"), load_file(llama_target / "model.safetensors")
    name = next(k for k in src if k.endswith("q_proj.weight"))
    assert ours[name].shape == src[name].shape and not torch.equal(ours[name], src[name])


def test_useless_draft_needs_a_hugging_face_source(tmp_path):
    with pytest.raises(BenchError, match="--draft-hf .*config.json and tokenizer.json"):
        tb.build_useless_draft(tmp_path, root=tmp_path)
