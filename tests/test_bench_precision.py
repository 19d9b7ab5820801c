"""`hetero-spec bench --precision-matrix`: arguments, the memory figures, and a real (tiny) matrix run whose
report structure and identity counts are checked. No timing outcome is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero_spec.bench import precision_bench as pb
from hetero_spec.bench.context import BenchError
from hetero_spec.cli import main

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "cpu-demo.yaml")
PROMPTS = [[5, 17, 33, 40, 41, 99, 100, 7], [200, 201, 202, 5, 6, 7, 8, 9, 10, 11]]
ROW_FIELDS = {"target_precision", "draft_precision", "layout", "arm", "kv_dtype", "shipped_recommendation", "status",
              "reason", "resolved_layout", "acceptance", "accepted", "drafted", "draft_ms_per_token",
              "draft_ms_source", "verify_ms_per_round", "drafting_prompts", "tokens_per_s", "target_mb", "draft_mb",
              "kv_bytes_per_token", "kv_mb_1k", "kv_mb_8k", "speedup", "speedup_min", "speedup_max", "won", "identical"}


# -- arguments -------------------------------------------------------------------------------------
def test_matrix_layouts_and_peers_are_parsed():
    assert pb.parse_matrix(None) == (pb.PRECISIONS, pb.PRECISIONS)
    assert pb.parse_matrix("all") == (pb.PRECISIONS, pb.PRECISIONS)
    assert pb.parse_matrix("int4,int8") == (("int8", "int4"), pb.PRECISIONS)  # kept in the canonical order
    assert pb.parse_matrix("fp32/int4") == (("fp32",), ("int4",))
    for bad, what in (("int2", "target precision 'int2'"), ("fp32/fp16", "draft precision 'fp16'"),
                      ("a/b/c", "TARGETS")):
        with pytest.raises(BenchError, match=what):
            pb.parse_matrix(bad)
    assert pb.parse_layouts(None) == ("auto", "two_process")
    assert pb.parse_layouts("in_process,auto,in_process") == ("in_process", "auto")
    with pytest.raises(BenchError, match="--layouts 'three_process'"):
        pb.parse_layouts("three_process")
    assert pb.parse_peers(None) == tuple(pb.PEERS) and pb.parse_peers("none") == ()
    assert pb.parse_peers("ort_genai_target_only_all_cores,ort_genai_spec") == \
        ("ort_genai_spec 1 core", "ort_genai_target_only all cores")
    with pytest.raises(BenchError, match="--systems 'hf_assisted'"):
        pb.parse_peers("hf_assisted")


def test_cli_errors_name_the_option(capsys):
    assert main(["bench", "--config", DEMO, "--precision-matrix", "int3"]) == 2
    assert "target precision 'int3'" in capsys.readouterr().err
    assert main(["bench", "--config", DEMO, "--precision-matrix", "--scenario", "repetitive"]) == 2
    assert "choose one" in capsys.readouterr().err
    assert main(["bench", "--config", DEMO, "--precision-matrix", "--temperature", "0.5"]) == 2
    assert "--temperature does not apply with --precision-matrix" in capsys.readouterr().err
    assert main(["bench", "--config", DEMO, "--precision-matrix", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err


def test_demo_drafts_are_exports_of_the_shipped_checkpoint(tmp_path):
    """No export is tracked: each precision is the Hugging Face draft exported on first use, and the config's
    own (models/draft at int8) is the shipped one. An export beside the checkpoint is still preferred."""
    from hetero_spec.config import load_config

    config = load_config(DEMO)
    drafts = pb.draft_sources(config, Path(DEMO), None, pb.PRECISIONS)
    hf = (Path(DEMO).resolve().parents[1] / "models" / "draft").resolve()
    assert {p: drafts[p] for p in pb.PRECISIONS} == {p: pb.DraftSource(hf, p) for p in pb.PRECISIONS}
    assert pb.shipped_draft_of(config, drafts) == "int8"
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{}")
    (tmp_path / "draft-onnx-int4").mkdir()
    (tmp_path / "draft-onnx-int4" / "model.onnx").write_bytes(b"")
    found = pb.draft_sources(config, Path(DEMO), tmp_path / "draft", ["int4", "int8"])
    assert found == {"int4": pb.DraftSource((tmp_path / "draft-onnx-int4").resolve()),
                     "int8": pb.DraftSource((tmp_path / "draft").resolve(), "int8")}
    assert pb.shipped_draft_of(config, found) is None


def test_memory_figures(tmp_path):
    d = tmp_path / "export"
    d.mkdir()
    (d / "model.onnx").write_bytes(b"x" * 500_000)
    (d / "model.onnx.data").write_bytes(b"x" * 1_500_000)
    (d / "genai_config.json").write_text(json.dumps({"model": {"decoder": {
        "num_hidden_layers": 8, "num_key_value_heads": 2, "num_attention_heads": 6, "head_size": 64,
        "hidden_size": 384}}}))
    assert pb.weights_mb(d) == 2.0 and pb.weights_mb(tmp_path) is None
    kv = pb.kv_cache(d)  # no readable graph: the CPU builder's fp32
    assert kv["bytes_per_token"] == 2 * 8 * 2 * 64 * 4 == 8192 and kv["dtype"] == "fp32"
    assert kv["mb_at"] == {"1024": 8.389, "8192": 67.109}


def test_peers_run_the_pass_draft(tmp_path):
    """A pass of int4 drafts only: ORT GenAI's speculative peers draft with that int4 draft, not the config's."""
    int4 = tmp_path / "draft-int4"
    only_int4 = {"int4": pb.DraftSource(int4)}
    engines, _ = pb.pass_engines("int8", only_int4, ("auto",), tuple(pb.PEERS), 2, shipped=None)
    for name, system in pb.PEERS.items():
        spec = engines[name]
        assert spec[pb.SYSTEM] == system
        if system == "ort_genai_target_only_all_cores":
            assert "draft.model" not in spec  # the target alone
        else:
            assert spec["draft.model"] == str(int4) and spec["draft.kind"] == "onnx", name
    # with the shipped draft in the pass, the peers use it; an unavailable draft is never chosen
    both = {"int8": pb.DraftSource(tmp_path / "hf", "int8"), "int4": pb.DraftSource(int4),
            "fp32": pb.DraftSource(None, reason="none here")}
    assert pb.peer_draft(both, "int8") == "int8" and pb.peer_draft(both, None) == "int8"
    assert pb.peer_draft(both, "fp32") == "int8" and pb.peer_draft({"fp32": both["fp32"]}, None) is None
    engines, _ = pb.pass_engines("int8", both, ("auto",), ("ort_genai_spec 1 core",), 2, shipped="int8")
    assert engines["ort_genai_spec 1 core"]["draft.precision"] == "int8"


# -- a real matrix on the tiny pair ---------------------------------------------------------------------
@pytest.fixture()
def copy_config(tmp_path, llama_target, llama_copy_onnx):
    path = tmp_path / "copy.yaml"
    path.write_text(f"target: {{model: {llama_target}, backend: onnx, threads: 1}}\n"
                    f"draft: {{kind: onnx, model: {llama_copy_onnx}}}\n"
                    "speculation: {gamma: 3}\n")
    return path


def test_matrix_on_the_tiny_pair(tmp_path, copy_config, llama_copy_onnx):
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "out"
    settings = pb.PrecisionSettings(
        config=copy_config, out=out, prompts=2, max_new_tokens=8, repeats=1, prompt_ids=PROMPTS,
        target_precisions=("fp32", "int8"), layouts=("in_process", "two_process"),
        peers=("ort_genai_spec 1 core",), gammas=None,
        drafts={"fp32": pb.DraftSource(llama_copy_onnx), "int4": pb.DraftSource(None, reason="no int4 draft")})
    lines: list[str] = []
    report = pb.run_precision(settings, say=lines.append)
    assert any("target int8: done" in s for s in lines) and lines[0].startswith("[")  # elapsed-time progress

    rows = report["rows"]
    assert [(r["target_precision"], r["draft_precision"], r["layout"]) for r in rows] == [
        (t, d, lay) for t in ("fp32", "int8") for d in ("fp32", "int4") for lay in ("in_process", "two_process")]
    for r in rows:
        assert set(r) >= ROW_FIELDS, set(ROW_FIELDS) - set(r)
        assert r["kv_dtype"] == "auto (fp32)" and r["kv_bytes_per_token"] > 0
        assert r["kv_mb_8k"] == pytest.approx(8 * r["kv_mb_1k"], rel=1e-3) and r["target_mb"] > 0
        assert r["shipped_recommendation"] is False  # no auto layout in this run
        if r["draft_precision"] == "int4":
            assert r["status"] == "unavailable" and r["reason"] == "no int4 draft" and r["identical"] is None
            continue
        assert r["status"] == "ok", r["reason"]
        n, total = r["identical"].split("/")
        assert total == "2" and 0 <= int(n) <= 2
        assert r["draft_mb"] > 0 and r["speedup"] > 0 and r["verify_ms_per_round"] > 0
        assert r["drafted"] >= r["accepted"] >= 0 and r["drafting_prompts"].endswith("/2")
        if r["target_precision"] == "fp32" and r["layout"] == "in_process" and r["drafted"]:
            assert r["acceptance"] == 1.0  # the copy draft agrees with the fp32 target everywhere
    fp32 = [r for r in rows if r["target_precision"] == "fp32" and r["status"] == "ok"]
    assert [r["identical"] for r in fp32] == ["2/2", "2/2"]  # the copy draft with the fp32 target: lossless
    # quantizing shrinks the target's weights; the KV cache stays fp32 (KV dtype auto)
    t = report["targets"]
    assert t["int8"]["weights_mb"] < t["fp32"]["weights_mb"]
    assert t["int8"]["kv"]["bytes_per_token"] == t["fp32"]["kv"]["bytes_per_token"]
    assert Path(t["int8"]["dir"]).name.startswith("llama-int8-")

    peers = report["peers"]
    assert [(x["target_precision"], x["name"]) for x in peers] == [("fp32", "ort_genai_spec 1 core"),
                                                                   ("int8", "ort_genai_spec 1 core")]
    assert all(x["status"] == "ok" for x in peers), [x["reason"] for x in peers]
    assert peers[0]["identical"] == "2/2" and peers[0]["threads"] == 1 and peers[0]["gamma"] == 3
    assert peers[0]["draft_precision"] == "fp32"  # the pass's draft (here also the config's)
    assert (out / "ort_models" / "target-int8" / "model.onnx").is_file()  # the peer ran the int8 export

    h = report["headline"]
    assert h["target_precision"] == "int8"
    assert h["a"]["available"] is True and h["a"]["arm"] in ("draft fp32 / in_process", "draft fp32 / two_process")
    assert h["a"]["vs_ort_spec_1core"]["prompts"] == 2 and isinstance(h["a"]["met"], bool)
    assert h["b"]["available"] is False and "shipped recommendation" in h["b"]["reason"]

    assert json.loads((out / "precision.json").read_text())["settings"]["kv_dtypes"] == ["auto"]
    md = (out / "precision.md").read_text()
    assert "## Matrix" in md and "(a) best heterogeneous" in md
    assert "| fp32 | fp32 | in_process: in_process (threads " in md
    assert "| int8 | int4 | two_process | auto (fp32) |" in md and "unavailable: no int4 draft" in md
    assert (out / "precision.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
