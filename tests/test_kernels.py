"""hetero_spec's Q4Rows kernel (hetero_spec/kernels): the arithmetic against an exact reference, a row's result
independent of the rows beside it, the export graph rewritten onto it, and runtime.kernels' choices and errors."""

from __future__ import annotations

import numpy as np
import pytest

from hetero_spec import Engine, kernels
from hetero_spec.errors import ConfigError
from hetero_spec.onnx_decoder import OnnxDecoder
from hetero_spec.target.export_cache import cached_export
from tests.test_precision import GAP, PROMPTS, _cfg, max_gap

needs_kernel = pytest.mark.skipif(kernels.unsupported() is not None,
                                  reason=f"Q4Rows cannot run here: {kernels.unsupported()}")


def _weights(rng, n: int, k: int, block: int):
    packed = rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8)
    scales = (rng.random((n, k // block), dtype=np.float32) * 0.02 + 1e-3).astype(np.float32)
    return packed, scales


def _reference(x: np.ndarray, packed: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """What Q4Rows computes, in float64 after the same int8 quantization of the activations per (row, block):
    q = round-half-even(x * (127 / max|x|)) in float32, y = sum over blocks of w_scale * x_scale * sum((w - 8) q)."""
    n, blocks, _ = packed.shape
    w = np.empty((n, blocks, block), dtype=np.int64)
    w[..., 0::2], w[..., 1::2] = packed & 15, packed >> 4
    w -= 8
    xb = x.reshape(x.shape[0], blocks, block).astype(np.float32)
    amax = np.abs(xb).max(axis=2)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int64)
    dots = np.einsum("mbk,nbk->mnb", q, w).astype(np.float64)
    x_scale = (amax / np.float32(127)).astype(np.float32).astype(np.float64)
    return np.einsum("mnb,nb,mb->mn", dots, scales.astype(np.float64), x_scale)


@needs_kernel
@pytest.mark.parametrize("block,k", [(128, 384), (32, 96), (64, 64)])
def test_q4rows_computes_the_int8_quantized_product_exactly(block, k):
    rng = np.random.default_rng(block)
    packed, scales = _weights(rng, 48, k, block)
    weights, packed_scales = kernels.repack(packed, scales, block)
    for m in (1, 2, 5, 8, 9, 17):
        x = rng.standard_normal((m, k), dtype=np.float32)
        x[0, :block] = 0  # a block of zeros: scale 0, no division by it
        got, want = kernels.matmul(x, weights, packed_scales, block), _reference(x, packed, scales, block)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@needs_kernel
def test_a_row_s_result_does_not_depend_on_the_rows_beside_it():
    """Bit for bit: a verified block's rows equal one-token steps, as far as the matmuls go (the rows are taken 8 at
    a time, the ninth in a pass of its own)."""
    rng = np.random.default_rng(3)
    packed, scales = _weights(rng, 32, 256, 128)
    weights, packed_scales = kernels.repack(packed, scales, 128)
    x = rng.standard_normal((11, 256), dtype=np.float32)
    block = kernels.matmul(x, weights, packed_scales, 128)
    for i in range(len(x)):
        assert np.array_equal(block[i], kernels.matmul(x[i:i + 1], weights, packed_scales, 128)[0])


def test_repack_refuses_shapes_it_cannot_take():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.repack(*_weights(rng, 24, 128, 128), 128)


@pytest.fixture(scope="module")
def int4_export(llama_target, export_cache):
    return cached_export(llama_target, "int4")


@needs_kernel
def test_the_export_s_matmuls_run_on_q4rows_and_agree_with_onnxruntime_s(int4_export, tmp_path, monkeypatch):
    import onnx
    monkeypatch.chdir(tmp_path)  # onnx.save_model checks its data file's name against the working directory:
    (tmp_path / "model.onnx.data").write_bytes(b"")  # a user's file of that name must not stop the rewrite
    ort_dec = OnnxDecoder(int4_export, role="target", kernels="onnxruntime")
    q4_dec = OnnxDecoder(int4_export, role="target", kernels="hetero_spec")
    assert (ort_dec.kernels, q4_dec.kernels) == ("onnxruntime", "hetero_spec")
    graph = onnx.load(str(q4_dec.graph_path), load_external_data=False).graph
    ops = [node.op_type for node in graph.node]
    assert ops.count("Q4Rows") > 0 and "MatMulNBits" not in ops
    # made once: a second decoder finds the cached graph
    assert OnnxDecoder(int4_export, role="target", kernels="auto").graph_path == q4_dec.graph_path
    for prompt in PROMPTS:
        a, b = ort_dec.new_state(), q4_dec.new_state()
        want, got = ort_dec.append(a, prompt), q4_dec.append(b, prompt)
        # the same int8 arithmetic on the same weights: float rounding apart
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
        assert ort_dec.greedy_steps(a, prompt[-1], 12) == q4_dec.greedy_steps(b, prompt[-1], 12)


@needs_kernel
def test_speculation_on_q4rows_stays_within_the_int4_gap_of_the_target_alone(llama_target, llama_copy_onnx):
    """Target alone and speculative decoding, both on Q4Rows. A block's rows are bit for bit one-token rows as far
    as Q4Rows goes, but not through the attention (GroupQueryAttention rounds a block apart from steps), so the
    check is test_precision's: within the int4 gap teacher-forced, and most outputs identical outright."""
    cfg = _cfg(llama_target, "onnx", "int4")
    cfg["runtime"]["kernels"] = "hetero_spec"
    with Engine.from_config(cfg) as alone:
        assert alone.target.decoder.kernels == "hetero_spec"
        refs = [alone.generate(p, max_new_tokens=40).token_ids for p in PROMPTS]
        spec = _cfg(llama_target, "onnx", "int4", {"kind": "onnx", "model": str(llama_copy_onnx)})
        spec["speculation"], spec["runtime"]["kernels"] = {"gamma": 4}, "hetero_spec"
        same = 0
        with Engine.from_config(spec) as eng:
            for p, ref in zip(PROMPTS, refs):
                out = eng.generate(p, max_new_tokens=40)
                assert out.stats["drafted"] > 0
                same += out.token_ids == ref
                assert max_gap(alone.target, p, out.token_ids) <= GAP["onnx"]
        assert same >= len(PROMPTS) // 2


def test_auto_falls_back_and_hetero_spec_says_why_where_the_cpu_cannot_run_it(int4_export, monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2"})
    assert OnnxDecoder(int4_export, role="target", kernels="auto").kernels == "onnxruntime"
    with pytest.raises(kernels.KernelUnavailable, match=r"runtime.kernels: hetero_spec.*AVX-512 VNNI.*avx512_vnni"):
        OnnxDecoder(int4_export, role="target", kernels="hetero_spec")


def test_onnxruntime_keeps_the_export_s_graph(int4_export):
    dec = OnnxDecoder(int4_export, role="target", kernels="onnxruntime")
    assert dec.kernels == "onnxruntime" and dec.graph_path.parent == int4_export


def test_runtime_kernels_is_checked(llama_target):
    cfg = _cfg(llama_target, "onnx", "int4")
    cfg["runtime"]["kernels"] = "mlas"
    with pytest.raises(ConfigError, match="runtime.kernels"):
        Engine.from_config(cfg)


def test_the_config_check_names_runtime_kernels_where_the_cpu_cannot_run_it(llama_target, monkeypatch):
    from hetero_spec.config import build_config
    from hetero_spec.preflight import check_config
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2"})
    cfg = _cfg(llama_target, "onnx", "int4")
    cfg["runtime"]["kernels"] = "hetero_spec"
    with pytest.raises(ConfigError, match=r"runtime\.kernels.*hetero_spec.*AVX-512 VNNI.*auto or onnxruntime"):
        check_config(build_config(cfg))


@needs_kernel
def test_auto_falls_back_where_the_kernel_does_not_build(int4_export, tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_SPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    assert OnnxDecoder(int4_export, role="target", kernels="auto").kernels == "onnxruntime"
    with pytest.raises(kernels.KernelUnavailable, match=r"runtime.kernels: hetero_spec: .*building .*q4rows.c failed"):
        OnnxDecoder(int4_export, role="target", kernels="hetero_spec")
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))
