"""`hetero-spec load`: the per-level measurement on a tiny Engine (outputs, counts, the report), and its
argument errors. Throughput numbers are not asserted (they belong to the bench)."""

from __future__ import annotations

from hetero_spec import Engine
from hetero_spec.bench.load import render, run_level
from hetero_spec.cli import main


def test_run_level_outputs_match_sequential(llama_target, llama_copy_onnx):
    cfg = {"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
           "draft": {"kind": "onnx", "model": str(llama_copy_onnx)}, "speculation": {"gamma": 4}}
    prompts = [[5, 17, 33, i] for i in range(6)]
    with Engine.from_config(cfg) as eng:
        seq = run_level(eng, prompts, 1, 12)
        par = run_level(eng, prompts, 4, 12)
    assert par["outputs"] == seq["outputs"] and all(0 < len(o) <= 12 for o in seq["outputs"])
    assert par["requests"] == 6 and par["tokens"] == sum(map(len, seq["outputs"]))
    assert par["latency_p95_s"] >= par["latency_p50_s"] > 0
    report = {"requests": 6, "max_new_tokens": 12, "systems": {"hetero_spec": [
        {**{k: v for k, v in r.items() if k != "outputs"}, "identical_to_first_level": "6/6",
         "throughput_vs_first_level": 1.0} for r in (seq, par)]}}
    md = render(report)
    assert "| hetero_spec | 4 |" in md and "6/6" in md


def test_load_argument_errors(capsys):
    assert main(["load", "--config", "x.yaml", "--concurrency", "1,two"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main(["load", "--config", "x.yaml", "--concurrency", "0"]) == 2
