"""Precision switches (precision.py): target.precision (dtype its alias) and draft.precision, their errors, the
on-demand exports, and lossless relative to the configured target.

A quantized target rounds a verified block differently from a one-token step: the builder's CPU MatMulNBits
quantizes activations to int8 per row block (accuracy level 4), and PyTorch's dynamic int8 quantizes a call's
activations with one scale for the whole block. Greedy identity with that target decoding alone therefore holds
only up to near-ties, so those tests check, teacher-forced along the speculative output, that every emitted
token is the one-token decode's argmax within GAP nats of log-probability. fp32 keeps exact identity tests
(test_onnx_target.py, test_engine_greedy.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from hetero_spec import Engine
from hetero_spec.config import build_config
from hetero_spec.errors import ConfigError

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [40, 41, 42, 43, 44, 40, 41, 42], [9, 8, 7, 6, 5], [1, 2, 3, 1, 2]]
# nats: the most an emitted token's log-probability may sit below the one-token decode's best. Measured worst
# here: onnx int8 0.016 (9 of 12 outputs identical), int4 0.000 (12 of 12) (the builder's per-row-block int8
# activations); torch int8 0.097 (2 of 12 identical: one activation scale per call, so the block's other tokens
# move each token's rounding)
GAP = {"onnx": 0.05, "torch": 0.15}


def _cfg(target, backend="onnx", precision=None, draft=None, **target_extra):
    t = {"model": str(target), "backend": backend, "device": "cpu", **target_extra}
    if precision is not None:
        t["precision"] = precision
    return {"target": t, "draft": draft or {"kind": "none"}, "runtime": {"mode": "in_process"}}


def _logprobs(logits) -> np.ndarray:
    x = np.asarray(logits.float().numpy() if hasattr(logits, "float") else logits, dtype=np.float64)[-1]
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def max_gap(target, prompt: list[int], output: list[int]) -> float:
    """Teacher-forced along prompt + output, one token per step (as the target decodes alone): the largest
    (best log-probability - the emitted token's) over the output."""
    state = target.new_state()
    lp = _logprobs(target.forward(state, prompt, last_only=True))
    worst = 0.0
    for tok in output:
        worst = max(worst, float(lp.max() - lp[tok]))
        lp = _logprobs(target.forward(state, [tok]))
    return worst


@pytest.mark.parametrize("backend,precision", [("onnx", "int8"), ("onnx", "int4"), ("torch", "int8")])
def test_a_quantized_target_decodes_as_it_does_alone_up_to_rounding(llama_target, llama_copy_onnx, backend,
                                                                     precision):
    with Engine.from_config(_cfg(llama_target, backend, precision)) as alone:
        assert alone.config.target.precision == precision
        refs = [alone.generate(p, max_new_tokens=40).token_ids for p in PROMPTS]
        same, worst = 0, 0.0
        for gamma in (1, 4, 8):
            cfg = _cfg(llama_target, backend, precision, {"kind": "onnx", "model": str(llama_copy_onnx)})
            cfg["speculation"] = {"gamma": gamma}
            with Engine.from_config(cfg) as eng:
                for p, ref in zip(PROMPTS, refs):
                    out = eng.generate(p, max_new_tokens=40)
                    assert out.stats["drafted"] > 0
                    same += out.token_ids == ref
                    worst = max(worst, max_gap(alone.target, p, out.token_ids))
        print(f"{backend} {precision}: {same} identical, worst gap {worst:.4f}")
        assert worst <= GAP[backend], f"an emitted token was {worst:.4f} nats below the one-token decode's best"
        if backend == "onnx":  # most outputs are identical outright (the rest part at a near-tie)
            assert same >= len(PROMPTS) * 3 // 2


def test_the_onnx_target_exports_each_precision_once(llama_target, export_cache):
    with Engine.from_config(_cfg(llama_target, "onnx", "int4")) as eng:
        model_dir = eng.target.model_dir
    assert model_dir.parent == export_cache / "onnx" and "-int4-" in model_dir.name
    with Engine.from_config(_cfg(llama_target, "onnx", "int4")) as eng:
        assert eng.target.model_dir == model_dir  # cached


def test_draft_precision_exports_a_hugging_face_draft(llama_target, export_cache, capsys):
    draft = {"model": str(llama_target), "precision": "int4"}  # kind inferred: onnx (a checkpoint to export)
    with Engine.from_config({**_cfg(llama_target, "onnx", "fp32", draft), "speculation": {"gamma": 4}}) as eng:
        assert eng.config.draft.kind == "onnx" and "-int4-" in eng.config.draft.model.name
        assert eng.config.draft.model.parent == export_cache / "onnx"
        out = eng.generate(PROMPTS[0], max_new_tokens=24)
        assert out.stats["accepted"] > 0
    with Engine.from_config(_cfg(llama_target, "onnx", "fp32")) as alone:
        assert alone.generate(PROMPTS[0], max_new_tokens=24).token_ids == out.token_ids  # fp32 target: exact


def test_a_hugging_face_draft_without_a_precision_is_exported_at_int8(llama_target, export_cache):
    from hetero_spec.precision import resolve_draft

    config = build_config(_cfg(llama_target, "onnx", "fp32", {"kind": "onnx", "model": str(llama_target)}))
    resolved = resolve_draft(config)
    assert "-int8-" in resolved.draft.model.name and resolved.draft.model.parent == export_cache / "onnx"
    assert (resolved.draft.model / "model.onnx").is_file() and resolved.draft.precision is None


def test_precision_errors_name_the_key_and_say_why(llama_target, llama_copy_onnx):
    with pytest.raises(ConfigError, match=r"target\.precision.*contradicts target\.dtype: float16"):
        Engine.from_config(_cfg(llama_target, "onnx", "int8", dtype="float16"))
    with pytest.raises(ConfigError, match=r"target\.precision.*fp16.*CPU export computes in fp32"):
        Engine.from_config(_cfg(llama_target, "onnx", "fp16"))
    # the real reason first: with dtype float32 beside it, fp16 on the CPU export is still the CPU export's fault
    with pytest.raises(ConfigError, match=r"target\.precision.*fp16.*CPU export computes in fp32"):
        Engine.from_config(_cfg(llama_target, "onnx", "fp16", dtype="float32"))
    with pytest.raises(ConfigError, match=r"target\.precision.*contradicts target\.dtype: float32"):
        Engine.from_config(_cfg(llama_target, "onnx", "fp16", dtype="float32",
                                providers=["CUDAExecutionProvider"]))  # a provider that could: the dtype's fault
    with pytest.raises(ConfigError, match=r"target\.precision.*int4.*torchao"):
        Engine.from_config(_cfg(llama_target, "torch", "int4"))
    with pytest.raises(ConfigError, match=r"draft\.precision.*already an ONNX export"):
        Engine.from_config(_cfg(llama_target, "onnx", None, {"model": str(llama_copy_onnx), "precision": "int8"}))


def test_dtype_stays_an_alias_of_precision(llama_target):
    with Engine.from_config(_cfg(llama_target, "torch", None, dtype="float32")) as eng:
        assert eng.config.target.precision == "fp32" and eng.target.dtype.is_floating_point


@pytest.mark.parametrize("kv", ["int8", "fp8", "fp16"])
def test_a_stored_kv_cache_keeps_speculation_identical_to_the_target_alone(llama_target, llama_copy_onnx, kv):
    """A token's stored values depend on that token alone (its own scale), so blocks and one-token steps store
    the same cache: exact greedy identity with the target alone using the same kv_cache_dtype."""
    with Engine.from_config(_cfg(llama_target, "torch", "fp32", kv_cache_dtype=kv)) as alone:
        refs = [alone.generate(p, max_new_tokens=32).token_ids for p in PROMPTS]
        state = alone.target.new_state()
        alone.target.prefill(state, list(range(1, 61)))
        stored = sum(layer.nbytes() for layer in state.cache.layers)
        config = alone.target.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # the same 59 cached positions in fp32: keys and values, per layer and KV head
        full = 2 * 4 * 59 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    assert stored < full / (1.8 if kv == "fp16" else 3.0)  # head_dim 16 here: 1 + 4/16 bytes against 4
    for gamma in (1, 4):
        cfg = _cfg(llama_target, "torch", "fp32", {"kind": "onnx", "model": str(llama_copy_onnx)}, kv_cache_dtype=kv)
        cfg["speculation"] = {"gamma": gamma}
        with Engine.from_config(cfg) as eng:
            assert [eng.generate(p, max_new_tokens=32).token_ids for p in PROMPTS] == refs


def test_kv_cache_dtype_is_a_torch_switch(llama_target):
    with pytest.raises(ConfigError, match=r"target\.kv_cache_dtype.*onnx backend keeps the export's KV cache"):
        Engine.from_config(_cfg(llama_target, "onnx", None, kv_cache_dtype="int8"))


def test_an_onnx_target_on_a_gpu_provider_is_exported_for_that_provider(llama_target, tmp_path):
    """target.precision fp16 with target.providers [CUDAExecutionProvider]: the builder's export for CUDA
    (`-e cuda`; its CPU graph would compute in fp32), cached apart from the CPU export. Here (no CUDA provider)
    the Engine says so before it exports anything; the export itself is checked directly."""
    import onnx

    from hetero_spec.target.backends import builder_ep
    from hetero_spec.target.export_cache import cached_export, entry_dir

    cfg = _cfg(llama_target, "onnx", "fp16")
    cfg["target"]["providers"] = ["CUDAExecutionProvider"]
    before = sorted((Path(os.environ["HETERO_SPEC_CACHE"]) / "onnx").glob("*"))
    with pytest.raises(ConfigError, match=r"target\.providers\[0\].*CUDAExecutionProvider.*not available"):
        Engine.from_config(cfg)
    assert sorted((Path(os.environ["HETERO_SPEC_CACHE"]) / "onnx").glob("*")) == before  # nothing exported
    cfg["target"]["precision"] = "bf16"
    with pytest.raises(ConfigError, match=r"target\.precision.*bf16.*fp32, fp16, int8 or int4 for CUDA"):
        Engine.from_config(cfg)
    assert (builder_ep(["CUDAExecutionProvider"]), builder_ep(["DmlExecutionProvider"]), builder_ep(None)) == \
        ("cuda", "dml", "cpu")
    gpu = cached_export(llama_target, "fp16", root=tmp_path, execution_provider="cuda")
    cpu = entry_dir(llama_target, "fp16", root=tmp_path)  # where the CPU export would go (not made: it is slow)
    assert "-fp16-cuda-" in gpu.name and "-cuda" not in cpu.name and gpu != cpu
    types = {i.name: i.type.tensor_type.elem_type for i in onnx.load(gpu / "model.onnx", load_external_data=False)
             .graph.input}
    assert types["past_key_values.0.key"] == onnx.TensorProto.FLOAT16
    assert cached_export(llama_target, "fp16", root=tmp_path, execution_provider="cuda") == gpu  # cached
