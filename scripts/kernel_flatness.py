"""How the cost of a block of M tokens grows with M, per weight format and kernel ONNX Runtime has on this CPU.

Each kernel runs one transformer layer's projections of the model's shapes (q, k, v, o, gate, up, down: K x N from
the model's config.json), over `--layers` layers of their own random weights (enough that the weights come from
DRAM, as in a real pass, not from cache), on an input of M rows. V(M) is the median time of that graph; the table
gives V(1) and V(M) / V(1) for M in --ms. A flat verify needs V(8) / V(1) near 1.

    python scripts/kernel_flatness.py --config HF_DIR/config.json [--threads 2] [--layers 4] [--ms 1,2,4,8,16]
        [--kernels int4-b32-acc4,int8-dq,...] [--reps 15]

Kernels (MatMulNBits is onnxruntime's blockwise-quantized MatMul; accuracy_level is its compute type, with 0 the
default (fp32 compute)):
  int4-b{32,64,128}-acc{0,1,2,3,4}   MatMulNBits, 4 bits, that block size and accuracy_level (1 fp32, 2 fp16, 3 bf16,
                                   4 int8: activations quantized per block, the VNNI u8s8 path)
  q4rows-b{32,64,128}              hetero_spec's Q4Rows (hetero_spec/kernels/q4rows.c): MatMulNBits' 4-bit weights,
                                   int8 compute, each chunk of weights unpacked once for up to 8 rows
  int8-b32-acc{0,4}                MatMulNBits, 8 bits
  int8-dq                          DynamicQuantizeMatMul: int8 weights per column, activations quantized per tensor
                                   at run time (u8s8, MLAS's QGEMM)
  fp32                             MatMul on fp32 weights (MLAS SGEMM)
  bf16                             MatMul on bfloat16 (the CPU provider has no kernel: reported as such)
All kernels are timed interleaved (round-robin over kernels and M), so machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

DEFAULT_KERNELS = ("fp32", "int8-dq", "int8-b32-acc0", "int8-b32-acc4", "int4-b32-acc0", "int4-b32-acc4",
                   "int4-b32-acc2", "int4-b32-acc3", "int4-b64-acc4", "int4-b128-acc4", "int4-b128-acc0", "bf16",
                   "q4rows-b128")


def layer_shapes(config: dict) -> list[tuple[str, int, int]]:
    """One layer's projections as (name, K, N)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads) * (config.get("head_dim") or hidden // heads)
    return [("q", hidden, hidden), ("k", hidden, kv), ("v", hidden, kv), ("o", hidden, hidden),
            ("gate", hidden, inter), ("up", hidden, inter), ("down", inter, hidden)]


def _nbits(name: str, k: int, n: int, bits: int, block: int, accuracy: int, rng) -> tuple[list, list]:
    """A MatMulNBits node (and its initializers) with random packed weights and small scales."""
    blocks = (k + block - 1) // block
    packed = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
    scales = (rng.random(n * blocks, dtype=np.float32) * 1e-3).astype(np.float32)
    inits = [numpy_helper.from_array(packed, f"{name}.w"), numpy_helper.from_array(scales, f"{name}.s")]
    node = helper.make_node("MatMulNBits", [f"x_{k}", f"{name}.w", f"{name}.s"], [name], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=block, accuracy_level=accuracy)
    return [node], inits


def _q4rows(name: str, k: int, n: int, block: int, rng) -> tuple[list, list]:
    """hetero_spec's Q4Rows node on random 4-bit weights (MatMulNBits' layout, repacked)."""
    from hetero_spec import kernels
    blocks = (k + block - 1) // block
    weights, scales = kernels.repack(rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8),
                                     (rng.random(n * blocks, dtype=np.float32) * 1e-3).astype(np.float32), block)
    inits = [numpy_helper.from_array(weights, f"{name}.w"), numpy_helper.from_array(scales, f"{name}.s")]
    node = helper.make_node(kernels.OP, [f"x_{k}", f"{name}.w", f"{name}.s"], [name], domain=kernels.DOMAIN,
                            K=k, N=n, block_size=block)
    return [node], inits


def _dq(name: str, k: int, n: int, rng) -> tuple[list, list]:
    weights = rng.integers(-127, 128, (k, n), dtype=np.int8)
    scales = (rng.random(n, dtype=np.float32) * 1e-3).astype(np.float32)
    inits = [numpy_helper.from_array(weights, f"{name}.w"), numpy_helper.from_array(scales, f"{name}.s"),
             numpy_helper.from_array(np.zeros(n, dtype=np.int8), f"{name}.z")]
    node = helper.make_node("DynamicQuantizeMatMul", [f"x_{k}", f"{name}.w", f"{name}.s", f"{name}.z"], [name],
                            domain="com.microsoft")
    return [node], inits


def _dense(name: str, k: int, n: int, dtype: str, rng) -> tuple[list, list]:
    weights = rng.standard_normal((k, n), dtype=np.float32) * 0.02
    init = numpy_helper.from_array(weights, f"{name}.w") if dtype == "fp32" else helper.make_tensor(
        f"{name}.w", TensorProto.BFLOAT16, [k, n], (weights.view(np.uint32) >> 16).astype(np.uint16).tobytes(),
        raw=True)
    x = f"x_{k}" if dtype == "fp32" else f"x_{k}_bf16"
    return [helper.make_node("MatMul", [x, f"{name}.w"], [name])], [init]


def build(kernel: str, shapes: list[tuple[str, int, int]], layers: int, rng) -> bytes:
    """The kernel's graph: inputs x_K [M, K] for each K in the shapes, one output per projection."""
    nodes, inits, outputs = [], [], []
    ks = sorted({k for _, k, _ in shapes})
    if kernel == "bf16":
        nodes += [helper.make_node("Cast", [f"x_{k}"], [f"x_{k}_bf16"], to=TensorProto.BFLOAT16) for k in ks]
    for layer in range(layers):
        for proj, k, n in shapes:
            name = f"l{layer}.{proj}"
            if kernel.startswith(("int4-", "int8-b")):
                bits, block, accuracy = kernel.split("-")
                made = _nbits(name, k, n, int(bits[3:]), int(block[1:]), int(accuracy[3:]), rng)
            elif kernel.startswith("q4rows-"):
                made = _q4rows(name, k, n, int(kernel.split("-")[1][1:]), rng)
            elif kernel == "int8-dq":
                made = _dq(name, k, n, rng)
            else:
                made = _dense(name, k, n, kernel, rng)
            nodes += made[0]
            inits += made[1]
            out_type = TensorProto.BFLOAT16 if kernel == "bf16" else TensorProto.FLOAT
            outputs.append(helper.make_tensor_value_info(name, out_type, ["M", n]))
    inputs = [helper.make_tensor_value_info(f"x_{k}", TensorProto.FLOAT, ["M", k]) for k in ks]
    graph = helper.make_graph(nodes, kernel, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
                                                                 helper.make_opsetid("hetero_spec", 1)])
    model.ir_version = 9
    return model.SerializeToString()


def weight_mb(kernel: str, shapes, layers: int) -> float:
    params = layers * sum(k * n for _, k, n in shapes)
    if kernel.startswith("q4rows-"):
        return params * (0.5 + 4 / int(kernel.split("-")[1][1:])) / 1e6
    if kernel.startswith(("int4-", "int8-b")):
        bits, block = int(kernel.split("-")[0][3:]), int(kernel.split("-")[1][1:])
        return params * (bits / 8 + 4 / block) / 1e6
    return params * {"int8-dq": 1, "fp32": 4, "bf16": 2}[kernel] / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, required=True, help="the model's Hugging Face config.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4, help="layers of distinct weights per graph")
    ap.add_argument("--ms", default="1,2,4,8,16", help="block sizes M (rows of the input)")
    ap.add_argument("--kernels", default=",".join(DEFAULT_KERNELS))
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    config = json.loads(args.config.read_text())
    shapes, ms, rng = layer_shapes(config), [int(m) for m in args.ms.split(",")], np.random.default_rng(0)
    sessions, missing = {}, {}
    for kernel in args.kernels.split(","):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = args.threads, 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            if kernel.startswith("q4rows-"):
                from hetero_spec import kernels
                opts.register_custom_ops_library(str(kernels.library()))
            sessions[kernel] = ort.InferenceSession(build(kernel, shapes, args.layers, rng), opts,
                                                    providers=["CPUExecutionProvider"])
        except Exception as exc:  # a format the CPU provider has no kernel for
            missing[kernel] = str(exc).splitlines()[0][:120]
    feeds = {m: {f"x_{k}": rng.standard_normal((m, k), dtype=np.float32) for k in {k for _, k, _ in shapes}}
             for m in ms}
    times: dict[tuple[str, int], list[float]] = {(kernel, m): [] for kernel in sessions for m in ms}
    for session in sessions.values():  # warm-up: the first run prepacks
        for m in ms:
            session.run(None, feeds[m])
    for rep in range(args.reps):
        order = list(times) if rep % 2 == 0 else list(times)[::-1]
        for kernel, m in order:
            started = time.perf_counter()
            sessions[kernel].run(None, feeds[m])
            times[(kernel, m)].append(time.perf_counter() - started)
    print(f"{args.layers} layers of {config.get('_name_or_path') or args.config.parent.name}'s projections "
          f"({', '.join(f'{p} {k}x{n}' for p, k, n in shapes)}), {args.threads} threads, median of {args.reps}\n")
    print("| kernel | weights MB | V(1) ms | " + " | ".join(f"V({m})/V(1)" for m in ms if m != 1) + " |")
    print("|---|---:|---:|" + "---:|" * (len(ms) - 1))
    for kernel in sessions:
        base = statistics.median(times[(kernel, ms[0])])
        ratios = " | ".join(f"{statistics.median(times[(kernel, m)]) / base:.2f}" for m in ms[1:])
        print(f"| {kernel} | {weight_mb(kernel, shapes, args.layers):.0f} | {base * 1e3:.2f} | {ratios} |")
    for kernel, why in missing.items():
        print(f"| {kernel} | {weight_mb(kernel, shapes, args.layers):.0f} | no CPU kernel: {why} |")


if __name__ == "__main__":
    main()
