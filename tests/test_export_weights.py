"""The export recipe's bytes: int4 quantizes the embedding table too (GatherBlockQuantized), the LM head is
quantized at int8 and int4, and `weight_report` says what a generated token reads (every weight, one row of a
gathered table). The quantized table changes the target: its greedy output is compared with the same export
with an fp32 table, teacher-forced, within the stated gap."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from hetero_spec.draft import export as export_mod
from hetero_spec.draft.export import export_draft
from hetero_spec.draft.weights import weight_report
from hetero_spec.onnx_decoder import OnnxDecoder

ROOT = Path(__file__).resolve().parent.parent
DEMO_TARGET = ROOT / "models" / "target"
TEXTS = ["def read_config(path):\n", "import os\nimport sys\n", "class Engine:\n    def __init__(self",
         "for i in range(10):\n"]
#: nats: how far the int4 table may move a token of the fp32-table export's greedy output below the new export's
#: best, teacher-forced, on the trained demo target (measured 0.000: 4 x 48 tokens, all identical). A random tiny
#: model is no measure here: its logits are nearly flat, and any rounding flips near-ties (0.17 nats seen)
TABLE_GAP = 0.05


def _logprobs(x) -> np.ndarray:
    x = np.asarray(x[-1], dtype=np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def _greedy(dec: OnnxDecoder, prompt: list[int], n: int) -> list[int]:
    state, out = dec.new_state(), []
    logits = dec.append(state, prompt)
    for _ in range(n):
        out.append(int(np.argmax(logits[-1])))
        logits = dec.append(state, [out[-1]])
    return out


def _gap(dec: OnnxDecoder, prompt: list[int], output: list[int]) -> float:
    state = dec.new_state()
    lp, worst = _logprobs(dec.append(state, prompt)), 0.0
    for tok in output:
        worst = max(worst, float(lp.max() - lp[tok]))
        lp = _logprobs(dec.append(state, [tok]))
    return worst


def test_int4_quantizes_the_embedding_table_by_the_expected_bytes(tmp_path, monkeypatch):
    new = export_draft(DEMO_TARGET, tmp_path / "int4", "int4", quiet=True)
    monkeypatch.setattr(export_mod, "QUANT_OPTIONS", {})  # the builder's defaults: an fp32 table
    old = export_draft(DEMO_TARGET, tmp_path / "int4-fp32-table", "int4", quiet=True)
    a, b = weight_report(old), weight_report(new)
    table = "model.embed_tokens.weight"
    v, h = a.gathered[table][1], a.gathered[table][0] // (4 * a.gathered[table][1])
    # fp32 [V, H] -> int4 [V, H] packed two per byte, plus an fp32 scale per block (128: the demo's 384 allows it)
    assert h % export_mod.INT4_BLOCK == 0
    assert a.total_bytes - b.total_bytes == v * h * 4 - (v * h // 2 + v * (h // export_mod.INT4_BLOCK) * 4)
    assert set(b.gathered) == {f"{table}_Q4", f"{table}_scales"} and table not in b.gathered
    assert a.per_token_bytes == a.total_bytes - v * h * 4 + h * 4  # one fp32 row of the table per token
    assert b.per_token_bytes < a.per_token_bytes
    assert not any("lm_head" in n for n, *_ in b.float_tensors)  # the head is MatMulNBits, not fp32
    olds, news = OnnxDecoder(old), OnnxDecoder(new)
    tok = Tokenizer.from_file(str(DEMO_TARGET / "tokenizer.json"))
    for text in TEXTS:
        p = tok.encode(text).ids
        ref = _greedy(olds, p, 48)
        assert _gap(news, p, ref) <= TABLE_GAP


def test_int8_quantizes_the_lm_head_and_reports_the_float_table(llama_target, tmp_path):
    rep = weight_report(export_draft(llama_target, tmp_path / "int8", "int8", quiet=True))
    assert not any("lm_head" in name for name in rep.gathered)
    assert "model.embed_tokens.weight" in rep.gathered  # GatherBlockQuantized is int4 only: fp32 at int8
    line = rep.line()
    assert line.startswith("weights ") and "a generated token reads about" in line


def test_int4_blocks_are_128_where_the_hidden_size_allows():
    assert export_mod.quant_options("int4", {"hidden_size": 1536}) == ["op_types_to_quantize=MatMul/Gather",
                                                                        "block_size=128"]
    assert export_mod.quant_options("int4", {"hidden_size": 64}) == ["op_types_to_quantize=MatMul/Gather"]
    assert export_mod.quant_options("int4", {"hidden_size": 1536}, 32)[-1] == "block_size=32"  # --block-size
    assert export_mod.quant_options("int8", {"hidden_size": 1536}) == []


def test_the_recipe_is_part_of_the_cache_key(llama_target, monkeypatch):
    from hetero_spec.target.export_cache import entry_dir

    before = entry_dir(llama_target, "int4")
    monkeypatch.setattr(export_mod, "QUANT_OPTIONS", {})
    assert entry_dir(llama_target, "int4") != before  # an export made by another recipe is not reused
    assert entry_dir(llama_target, "int8") == entry_dir(llama_target, "int8")
