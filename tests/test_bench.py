"""`hetero-spec bench` on the tiny fixture pair: the report's schema, identity flags and files."""

from __future__ import annotations

import json

import pytest

from hetero_spec.bench import (SYSTEMS, BenchError, BenchSettings, analytic, pipelined_vs_in_process,
                               run_bench)
from hetero_spec.cli import main

PROMPTS = [[5, 17, 33, 40, 41, 99, 100, 7], [200, 201, 202, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture()
def copy_config(tmp_path, llama_target, llama_copy_onnx):
    path = tmp_path / "copy.yaml"
    path.write_text(f"target: {{model: {llama_target}, threads: 1}}\n"
                    f"draft: {{kind: onnx, model: {llama_copy_onnx}}}\n"
                    "speculation: {gamma: 3}\n")
    return path


def _entry(report: dict, name: str) -> dict:
    return next(e for e in report["systems"] if e["name"] == name)


def test_bench_report_schema_and_files(tmp_path, copy_config, llama_target):
    out = tmp_path / "bench"
    settings = BenchSettings(config=copy_config, out=out, prompts=2, max_new_tokens=8,
                             systems=["hetero_spec", "hf_assisted"], draft_hf=llama_target)
    report = run_bench(settings, prompt_ids=PROMPTS)

    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    assert set(on_disk) == {"machine", "versions", "config", "settings", "systems", "analytic",
                            "pipelined_vs_in_process", "comparisons"}
    assert on_disk["comparisons"] == []  # no ORT GenAI peer ran
    assert on_disk["pipelined_vs_in_process"] == {"available": False}  # no two-process run here
    assert on_disk["machine"]["cpu_count"] >= 1 and isinstance(on_disk["machine"]["platform"], str)
    for pkg in ("python", "torch", "transformers", "onnxruntime", "onnxruntime-genai", "hetero-spec"):
        assert pkg in on_disk["versions"]
    assert on_disk["config"]["target"]["dtype"] == "float32" and on_disk["config"]["target"]["device"] == "cpu"
    s = on_disk["settings"]
    assert (s["prompts"], s["max_new_tokens"], s["gamma"]) == (2, 8, 3)
    assert s["command"].startswith("hetero-spec bench --config")

    # target_only is always run (the reference); the order is the registry's
    assert [e["name"] for e in on_disk["systems"]] == ["target_only", "hf_assisted", "hetero_spec"]
    for e in on_disk["systems"]:
        assert e["status"] == "ok" and e["reason"] is None, e
        assert isinstance(e["tokens_per_s"], float) and e["tokens_per_s"] > 0
        assert isinstance(e["speedup_vs_target_only"], float) and e["speedup_vs_target_only"] > 0
        assert e["identical_to_target_only"] is True
        assert len(e["per_prompt"]) == 2
        for p in e["per_prompt"]:
            assert p["wall_s"] > 0 and 1 <= p["new_tokens"] <= 8 and p["identical_to_target_only"] is True
    assert _entry(on_disk, "target_only")["speedup_vs_target_only"] == 1.0
    assert _entry(on_disk, "target_only")["acceptance_rate"] is None
    assert _entry(on_disk, "hf_assisted")["acceptance_rate"] is None
    hs = _entry(on_disk, "hetero_spec")
    assert hs["acceptance_rate"] == pytest.approx(1.0)  # the draft is the target itself
    assert hs["per_prompt"][0]["stats"]["proposer"] == "onnx"

    a = on_disk["analytic"]
    assert a["available"] is True and a["gamma"] == 3
    assert a["expected_tokens_per_round"] == pytest.approx(4.0)  # a = 1: every round yields g + 1
    for key in ("predicted_speedup", "measured_speedup", "efficiency", "t_target_step_s",
                "t_draft_token_s", "t_verify_block_s"):
        assert isinstance(a[key], float) and a[key] > 0

    md = (out / "bench.md").read_text()
    assert "| system | backend | layout | threads | gamma | tok/s |" in md and "| hetero_spec |" in md and "hetero-spec bench --config" in md
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_draft_checkpoint_skips_hf_assisted(tmp_path, copy_config):
    report = run_bench(BenchSettings(config=copy_config, out=tmp_path / "b", prompts=1, max_new_tokens=4,
                                     systems=["hf_assisted"], draft_hf=tmp_path / "nowhere"),
                       prompt_ids=PROMPTS)
    e = _entry(report, "hf_assisted")
    assert e["status"] == "skipped" and "--draft-hf" in e["reason"]
    assert e["tokens_per_s"] is None and e["identical_to_target_only"] is None
    assert (tmp_path / "b" / "bench.md").read_text().count("skipped") == 1


def test_analytic_formula():
    runs = [{"wall_s": 1.0, "token_ids": [1] * 10, "stats": {"drafted": 8, "accepted": 4, "rounds": 2,
                                                             "time_draft_s": 0.08, "time_verify_s": 0.4,
                                                             "accept_hist": [1, 0, 0, 0, 1]}}]

    class R:  # the two fields analytic() reads
        def __init__(self, runs):
            self.runs = runs

    a = analytic({"hetero_spec": {"status": "ok", "speedup_vs_target_only": 1.2}},
                 {"hetero_spec": R(runs), "target_only": R([{"wall_s": 1.0, "token_ids": [1] * 10}])}, gamma=4)
    # one round accepted all 4, one rejected its first token: per-token acceptance 4 / (4 + 1)
    assert a["per_token_acceptance"] == pytest.approx(0.8) and a["acceptance_rate"] == pytest.approx(0.5)
    e = (1 - 0.8 ** 5) / 0.2
    assert a["expected_tokens_per_round"] == pytest.approx(e)
    assert a["predicted_speedup"] == pytest.approx(e * 0.1 / (4 * 0.01 + 0.2))
    assert a["efficiency"] == pytest.approx(1.2 / a["predicted_speedup"])


def test_registry_has_every_system_and_pipelined_is_gated():
    assert list(SYSTEMS)[:4] == ["target_only", "hf_assisted", "hf_assisted_best_const", "hetero_spec"]
    assert {"hetero_spec_pipelined", "ort_genai_target_only", "ort_genai_spec"} <= set(SYSTEMS)


def test_cli_errors_are_clear(tmp_path, copy_config, capsys):
    assert main(["bench", "--config", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert main(["bench", "--config", str(copy_config), "--out", str(tmp_path / "o"),
                 "--systems", "target_only,warp_drive"]) == 2
    err = capsys.readouterr().err
    assert "warp_drive" in err and "hetero_spec" in err
    assert main(["bench", "--config", str(copy_config), "--out", str(tmp_path / "o"),
                 "--set", "speculation.gama=2"]) == 2
    assert "speculation.gama" in capsys.readouterr().err
    with pytest.raises(BenchError):
        run_bench(BenchSettings(config=copy_config, out=tmp_path / "o"), prompt_ids=[[]])


def test_ort_genai_systems_match_target_only(tmp_path, copy_config, llama_copy_onnx):
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "bench"
    report = run_bench(BenchSettings(config=copy_config, out=out, prompts=2, max_new_tokens=8,
                                     systems=["ort_genai_target_only", "ort_genai_spec"],
                                     ort_target=llama_copy_onnx),  # the copy draft is the target's export
                       prompt_ids=PROMPTS)
    base, spec = _entry(report, "ort_genai_target_only"), _entry(report, "ort_genai_spec")
    assert base["status"] == "ok" and spec["status"] == "ok", (base["reason"], spec["reason"])
    assert base["identical_to_target_only"] is True and spec["identical_to_target_only"] is True
    assert spec["identical_to_ort_genai_target_only"] is True
    assert spec["acceptance_rate"] == pytest.approx(1.0)
    overlay = json.loads((out / "ort_models" / "target" / "genai_config.spec.json").read_text())
    assert overlay["speculative"] == {"max_draft_tokens": 3}
    assert overlay["model"]["draft"]["filename"] == "draft/model.onnx"
    assert (out / "ort_models" / "target" / "draft" / "model.onnx").is_file()


def test_prompt_plus_new_tokens_must_fit_the_context(tmp_path, copy_config):
    with pytest.raises(BenchError, match="context of 96"):  # llama_gqa.json: max_position_embeddings 96
        run_bench(BenchSettings(config=copy_config, out=tmp_path / "o", prompts=1, max_new_tokens=8),
                  prompt_ids=[[5] * 90])


def test_pipelined_vs_in_process_is_per_prompt():
    def e(*walls):
        return {"per_prompt": [{"wall_s": w} for w in walls]}
    pv = pipelined_vs_in_process({"hetero_spec": e(1.0, 2.0, 3.0), "hetero_spec_pipelined": e(0.5, 2.5, 2.0)})
    assert pv == {"available": True, "median_speedup": 1.5, "prompts_faster": 2, "prompts": 3}
    assert pipelined_vs_in_process({"hetero_spec": e(1.0)}) == {"available": False}


def test_backends_layouts_peers_calibration_and_prompts_file(tmp_path, copy_config, llama_target):
    """The onnx-backend systems in both layouts, ORT GenAI's peers, gamma calibrated per system, a JSONL
    prompts file, each entry naming its backend, layout and threads, and the paired comparisons."""
    pytest.importorskip("onnxruntime_genai")
    pf = tmp_path / "prompts.jsonl"
    pf.write_text('{"token_ids": [5, 17, 33, 2, 99, 100, 7]}\n\n{"prompt": "def f(x):"}\n')
    systems = ["hetero_spec_onnx_target_only", "hetero_spec_onnx", "hetero_spec_onnx_pipelined",
               "ort_genai_target_only", "ort_genai_spec"]
    report = run_bench(BenchSettings(config=copy_config, out=tmp_path / "b", max_new_tokens=8, systems=systems,
                                     gammas=(2, 3), prompts_file=pf))
    assert report["settings"]["prompts"] == 2 and report["settings"]["prompt_tokens"][0] == 7
    assert report["settings"]["gammas"] == [2, 3] and "--prompts-file" in report["settings"]["command"]
    for name in systems:
        e = _entry(report, name)
        assert e["status"] == "ok", (name, e["reason"])
        assert e["identical_to_target_only"] is True, name
    x = {n: _entry(report, n)["extra"] for n in systems}
    assert (x["hetero_spec_onnx"]["backend"], x["hetero_spec_onnx"]["layout"]) == ("onnx", "in_process")
    assert x["hetero_spec_onnx"]["target_threads"] == 1 and x["hetero_spec_onnx"]["draft_threads"] == 1
    assert x["hetero_spec_onnx_pipelined"]["layout"].startswith("two_process")
    assert x["ort_genai_spec"]["backend"] == "onnxruntime-genai"
    for n in ("hetero_spec_onnx", "hetero_spec_onnx_pipelined", "ort_genai_spec"):
        assert set(x[n]["calibration_s"]) == {"2", "3"} and x[n]["gamma"] in (2, 3), n
    assert "calibration_s" not in x["hetero_spec_onnx_target_only"]  # no draft, nothing to calibrate
    pairs = {(c["system"], c["peer"]): c for c in report["comparisons"]}
    c = pairs[("hetero_spec_onnx_pipelined", "ort_genai_spec")]
    assert c["prompts"] == 2 and c["identical_outputs"] == 2 and c["median_speedup"] > 0
    assert ("hetero_spec_onnx_target_only", "ort_genai_target_only") in pairs


def test_prompts_file_errors_name_the_line(tmp_path, copy_config):
    from hetero_spec.bench.prompts import prompts_from_file
    from hetero_spec.config import load_config

    cfg = load_config(copy_config)
    for text, match in (('{"token_ids": [1, -2]}', "line 1.*non-negative"),
                        ('\n{"prompt": 3}', "line 2.*non-empty text"),
                        ("not json", "line 1: not JSON"),
                        ('{"text": "x"}', 'line 1: expected an object with "prompt"'),
                        ("", "no prompts")):
        f = tmp_path / "p.jsonl"
        f.write_text(text)
        with pytest.raises(BenchError, match=match):
            prompts_from_file(f, cfg)


def test_order_rotates_per_prompt_and_repeats_take_the_median(monkeypatch):
    """No system always runs right after the same neighbour; with repeats a prompt's time is the median."""
    from types import SimpleNamespace

    from hetero_spec.bench import run as run_mod
    from hetero_spec.bench.context import RunOutput
    from hetero_spec.bench.run import ProcState, SystemResult, _interleave

    calls: list[str] = []
    ticks = iter(range(1000))
    monkeypatch.setattr(run_mod.time, "perf_counter", lambda: float(next(ticks)) ** 2)  # growing durations

    class Fake:
        def __init__(self, name):
            self.name = name

        def run(self, prompt, max_new):
            calls.append(self.name)
            return RunOutput([len(prompt)])

    names = ["a", "b", "c"]
    state = ProcState(None, 1)
    monkeypatch.setattr(ProcState, "apply", lambda self: None)
    live = {n: (Fake(n), state) for n in names}
    results = {n: SystemResult(n) for n in names}
    ctx = SimpleNamespace(prompts=[[1], [1, 2], [1, 2, 3]], max_new=4)
    _interleave(ctx, live, results, repeats=2)
    assert calls[:6] == ["a", "b", "c", "b", "c", "a"] and calls[6:9] == ["c", "a", "b"]
    assert len(calls) == 3 * 3 * 2
    for n in names:
        assert [r["token_ids"] for r in results[n].runs] == [[1], [2], [3]]
        for r in results[n].runs:
            assert len(r["repeats_s"]) == 2 and r["wall_s"] == sum(r["repeats_s"]) / 2


def test_variant_availability_follows_backend_and_layout(copy_config, gpt2_target):
    from types import SimpleNamespace

    from hetero_spec.config import build_config, load_config

    ctx = SimpleNamespace(config=load_config(copy_config))  # onnx draft, exportable Llama target
    assert all(SYSTEMS[n].unavailable(ctx) is None for n in (
        "hetero_spec_onnx", "hetero_spec_onnx_pipelined", "hetero_spec_torch", "hetero_spec_torch_pipelined"))
    ngram = SimpleNamespace(config=build_config({"target": {"model": str(gpt2_target)}, "draft": {"kind": "ngram"}}))
    assert SYSTEMS["hetero_spec_torch_pipelined"].unavailable(ngram) == "two_process needs draft.kind: onnx"
    assert SYSTEMS["hetero_spec_torch"].unavailable(ngram) is None
    assert "does not export GPT2" in SYSTEMS["hetero_spec_onnx"].unavailable(ngram)
