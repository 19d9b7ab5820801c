"""`hetero-spec soak`: a short soak of a real `hetero-spec serve` subprocess on a tiny model (nothing lost,
outputs equal the references, the report written, the server gone afterwards), the RSS summary and the
report, and the argument errors. No timing or throughput is asserted."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from hetero_spec.bench.soak import render, rss_summary, run_soak
from hetero_spec.cli import main


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_short_soak_loses_nothing_and_stops_the_server(tmp_path, llama_target):
    cfg = tmp_path / "soak.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu",
                                              "backend": "torch"},
                                   "draft": {"kind": "none"}, "runtime": {"mode": "in_process"}}))
    out = tmp_path / "out"
    lines: list[str] = []
    report = run_soak(cfg, streams=4, duration_s=2, max_tokens=8, warmup_s=1, out=out, say=lines.append,
                      cut_share=0.3, malformed_share=0.3)
    assert report["requests_lost"] == 0, report["errors"]
    # every malformed request got its status, and the server counted exactly those; nothing stayed in flight
    assert report["errors_sent"] and report["errors_sent"] == report["errors_counted"] and report["errors_match"]
    assert report["in_flight_after"] == 0 and report["requests_cut"] > 0
    assert report["token_mismatches"] == 0
    assert report["requests_ok"] >= 4 and report["tokens"] > 0
    assert (out / "soak.json").is_file() and (out / "soak.md").is_file() and (out / "server.log").is_file()
    saved = json.loads((out / "soak.json").read_text())
    assert saved["requests_ok"] == report["requests_ok"] and saved["streams"] == 4
    assert saved["rss_samples"] and all(len(s) == 2 for s in saved["rss_samples"])
    assert report["goal_met"] == report["flat"]  # nothing lost, mismatched or miscounted: only RSS can decide
    assert "| requests lost | 0 |" in (out / "soak.md").read_text()
    assert _gone(report["server_pid"])
    assert lines  # progress went to `say`


def test_rss_summary_and_render():
    s = rss_summary([[0.0, 100.0], [1.0, 200.0], [2.0, 210.0], [3.0, 205.0]], warmup_s=1.0)
    assert s["rss_after_warmup_mb"] == 200.0 and s["rss_max_after_warmup_mb"] == 210.0
    assert s["rss_end_mb"] == 205.0 and s["rss_growth"] == pytest.approx(0.05) and s["flat"]
    assert not rss_summary([[0.0, 100.0], [1.0, 100.0], [2.0, 120.0]], warmup_s=1.0)["flat"]
    assert rss_summary([[0.0, 100.0]], warmup_s=5.0)["flat"] is False
    report = {"streams": 2, "duration_s": 3, "max_tokens": 8, "warmup_s": 1, "requests_ok": 5, "requests_lost": 0,
              "token_mismatches": 0, "tokens": 40, "tokens_per_s": 13.3, "wall_s": 3.0, "rss_growth_limit": 0.1,
              "goal_met": True, "errors": [], **s}
    md = render(report)
    assert "| requests ok | 5 |" in md and "| goal met | yes |" in md and "5.0 %" in md


def test_soak_argument_errors(capsys):
    assert main(["soak", "--config", "x.yaml", "--streams", "0"]) == 2
    assert "--streams" in capsys.readouterr().err
    assert main(["soak", "--config", "x.yaml", "--max-tokens", "0"]) == 2
    assert main(["soak", "--config", "x.yaml", "--duration", "5", "--warmup", "5"]) == 2
    assert main(["soak", "--config", "x.yaml", "--port", "70000"]) == 2
    assert main(["soak", "--config", "x.yaml", "--set", "novalue"]) == 2
    assert main(["soak", "--config", "does-not-exist.yaml"]) == 2
