"""hetero_spec's own ONNX Runtime kernels, built from C source with the system compiler on first use.

`Q4Rows` (q4rows.c): a 4-bit matmul that unpacks each chunk of weights once for up to 8 rows, so that a verify
block of k tokens costs little more than one token's weight read (runtime.kernels, docs/features-precision.md).
`library()` builds the custom-op library once into $HETERO_SPEC_CACHE/kernels and returns its path (for
SessionOptions.register_custom_ops_library); `repack()` turns MatMulNBits' weights into its layout;
`graph_for()` gives the graph a runner loads: the export's, or its rewrite onto Q4Rows (rewrite_graph), cached."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import sysconfig
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import ModelLoadError

SOURCE = Path(__file__).with_name("q4rows.c")
#: the CPU features the kernel is compiled for (flags of /proc/cpuinfo)
CPU_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni", "-fPIC", "-shared")
#: Q4Rows' operator domain and name in a graph
DOMAIN, OP = "hetero_spec", "Q4Rows"


class KernelUnavailable(ModelLoadError):
    """This machine cannot run or build the kernel (its CPU, or no C compiler); says which."""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def unsupported() -> str | None:
    """Why Q4Rows cannot run here (None: it can)."""
    missing = [f for f in CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return f"needs a CPU with AVX-512 VNNI (missing {', '.join(missing)} in /proc/cpuinfo)"
    if _compiler() is None:
        return "needs a C compiler to build it (cc, gcc or clang on PATH, or $CC)"
    return None


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name.split()[0]):
            return name.split()[0]
    return None


def library(root: Path | None = None) -> Path:
    """The built custom-op library (built once per source and flags, under a file lock); KernelUnavailable if this
    machine cannot run or build it."""
    from ..target.export_cache import cache_root
    why = unsupported()
    if why:
        raise KernelUnavailable(f"hetero_spec's 4-bit block kernel {why}")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    folder = (root or cache_root()) / "kernels"
    path = folder / f"libq4rows-{key}.so"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"libq4rows-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            scratch = path.with_suffix(f".{os.getpid()}.tmp")
            done = subprocess.run([_compiler(), *CFLAGS, str(SOURCE), "-o", str(scratch)], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                scratch.unlink(missing_ok=True)
                raise KernelUnavailable(f"building {SOURCE} failed ({' '.join([_compiler(), *CFLAGS])}):\n"
                                        f"{done.stderr.strip()[-2000:]}")
            scratch.replace(path)
    return path


def repack(packed: np.ndarray, scales: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' 4-bit weights [N, K/block, block/2] (byte: low nibble even k, high nibble odd k) and scales
    [N * K/block] into Q4Rows' layout: weights [N/16, K/block, block/8, 64], scales [N/16, K/block, 16]."""
    n, blocks, half = packed.shape
    if half * 2 != block or n % 16 or block % 16:
        raise ValueError(f"Q4Rows takes N a multiple of 16 and block_size a multiple of 16 (N {n}, block {block}, "
                         f"{half} bytes a block)")
    values = np.empty((n, blocks, block), dtype=np.uint8)
    values[..., 0::2], values[..., 1::2] = packed & 15, packed >> 4
    # [group, column, block, chunk, half (k 0-3 / 4-7 of the chunk's 8), t] -> [group, block, chunk, column, t, half]
    values = values.reshape(n // 16, 16, blocks, block // 8, 2, 4).transpose(0, 2, 3, 1, 5, 4)
    weights = np.ascontiguousarray((values[..., 0] | (values[..., 1] << 4)).reshape(n // 16, blocks, block // 8, 64))
    scales = np.ascontiguousarray(np.asarray(scales, dtype=np.float32).reshape(n // 16, 16, blocks).transpose(0, 2, 1))
    return weights, scales


def matmul(x: np.ndarray, weights: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """Q4Rows on one thread, without ONNX Runtime (tests): x [M, K] float32 times the repacked weights."""
    lib = ctypes.CDLL(str(library()))
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    n = weights.shape[0] * 16
    y = np.empty((m, n), dtype=np.float32)
    ptr = ctypes.c_void_p
    lib.q4rows_matmul.argtypes = [ptr, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr]
    if lib.q4rows_matmul(x.ctypes.data, m, k, n, block, weights.ctypes.data, scales.ctypes.data, y.ctypes.data):
        raise ValueError(f"Q4Rows cannot take x {x.shape} with block {block} and N {n}")
    return y


def _q4rows_node(node, weights: dict) -> tuple[int, int, int] | None:
    """(K, N, block_size) where this MatMulNBits node can run as Q4Rows: 4 bits with int8 compute (accuracy_level
    4, the numerics Q4Rows has), weights and scales initializers,
    no zero points, g_idx or bias, N a multiple of 16, block_size a multiple of 16; else None."""
    from onnx import helper
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or len(node.input) != 3:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, bits, block = attrs.get("K"), attrs.get("N"), attrs.get("bits", 4), attrs.get("block_size")
    if bits != 4 or attrs.get("accuracy_level", 0) != 4 or not k or not n or not block or n % 16 or block % 16 \
            or k % block:
        return None
    if node.input[1] not in weights or node.input[2] not in weights:
        return None
    return k, n, block


def rewrite_graph(src: Path, dest: Path, progress=None) -> int:
    """src (an ONNX export) with every MatMulNBits node Q4Rows can take replaced by Q4Rows on the same weights,
    repacked; saved as dest with its weights in dest's external data file. Returns how many nodes it replaced."""
    import onnx
    from onnx import helper, numpy_helper

    from ..target.export_cache import _initializer, external_data_name, inline_external
    model = onnx.load(str(src), load_external_data=False)  # the weights are mapped one at a time (_initializer)
    graph, folder = model.graph, Path(src).parent
    weights = {t.name: t for t in graph.initializer}
    users = Counter(name for node in graph.node for name in node.input)
    shapes = [_q4rows_node(node, weights) for node in graph.node]
    total = sum(shape is not None for shape in shapes)
    nodes, added, dropped, replaced = [], [], set(), 0
    for node, shape in zip(graph.node, shapes):
        if shape is None:
            nodes.append(node)
            continue
        k, n, block = shape
        packed = np.asarray(_initializer(weights[node.input[1]], folder)).reshape(n, k // block, block // 2)
        scales = np.asarray(_initializer(weights[node.input[2]], folder))
        w, s = repack(packed, scales, block)
        base = f"{node.input[1]}/q4rows"
        added += [numpy_helper.from_array(w, base), numpy_helper.from_array(s, f"{base}/scales")]
        nodes.append(helper.make_node(OP, [node.input[0], base, f"{base}/scales"], list(node.output),
                                      name=f"{node.name}/q4rows", domain=DOMAIN, K=k, N=n, block_size=block))
        for name in node.input[1:]:
            users[name] -= 1
            if users[name] == 0:
                dropped.add(name)
        replaced += 1
        if progress and replaced % 32 == 0:
            progress(f"repacked {replaced} of {total} 4-bit matmuls")
    kept = [t for t in graph.initializer if t.name not in dropped]
    for tensor in kept:  # the others' data, read now (dest gets a data file of its own)
        inline_external(tensor, folder)
    del graph.initializer[:]
    graph.initializer.extend(kept + added)
    del graph.node[:]
    graph.node.extend(nodes)
    if replaced and not any(op.domain == DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    onnx.save_model(model, str(dest), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=external_data_name(Path(dest)), size_threshold=1024)
    return replaced


#: runtime.kernels values
CHOICES = ("auto", "onnxruntime", "hetero_spec")
#: the layout of a rewritten graph (part of its cache key)
LAYOUT = "q4rows-1"


def _q4rows_count(path: Path) -> int:
    return _count(path, path.stat().st_size, path.stat().st_mtime_ns)


@lru_cache(maxsize=64)
def _count(path: Path, size: int, mtime: int) -> int:
    """How many of the graph's nodes Q4Rows can take (read once per file version)."""
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    weights = {t.name for t in model.graph.initializer}
    return sum(1 for node in model.graph.node if _q4rows_node(node, weights))


def graph_for(path: Path, kernels: str = "auto", provider: str = "CPUExecutionProvider", role: str = "target",
              root: Path | None = None, progress=None) -> Path:
    """The graph to load for the export graph at path under runtime.kernels: path itself (`onnxruntime`, another
    provider than the CPU's, or a graph with no 4-bit matmul Q4Rows takes), or its rewrite with Q4Rows
    (rewrite_graph), made once into $HETERO_SPEC_CACHE/onnx. `auto` falls back to path where this machine cannot
    run the kernel (unsupported()); `hetero_spec` raises KernelUnavailable there."""
    import logging

    if kernels not in CHOICES:
        raise ValueError(f"runtime.kernels must be one of {', '.join(CHOICES)}, not {kernels!r}")
    log = logging.getLogger(__name__)
    if kernels == "onnxruntime" or provider != "CPUExecutionProvider" or not _q4rows_count(path):
        if kernels == "hetero_spec":
            log.info("%s: runtime.kernels hetero_spec: %s has no 4-bit matmul it runs on the CPU provider (%s)",
                     role, path, provider)
        return path
    why = unsupported()
    if why:
        if kernels == "hetero_spec":
            raise KernelUnavailable(f"runtime.kernels: hetero_spec: the {role}'s 4-bit block kernel {why}")
        log.info("%s: runtime.kernels auto: ONNX Runtime's MatMulNBits (hetero_spec's kernel %s)", role, why)
        return path
    try:  # the kernel first: a compiler that fails, or a cache we cannot write, leaves `auto` on ONNX Runtime's
        library(root)
        return _rewritten(path, role, root, progress)
    except (KernelUnavailable, OSError) as exc:
        if kernels == "hetero_spec":
            raise KernelUnavailable(f"runtime.kernels: hetero_spec: {exc}") from exc
        log.warning("%s: runtime.kernels auto: ONNX Runtime's MatMulNBits (%s)", role, exc)
        return path


def _rewritten(path: Path, role: str, root: Path | None, progress) -> Path:
    """rewrite_graph(path), made once into the cache."""
    import json

    from ..target.export_cache import build_once, cache_root
    sources = [path, path.with_name(f"{path.name}.data")]
    stamp = {"layout": LAYOUT, "source": str(path.resolve()),
             "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sources if p.exists()]}
    key = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]
    entry = (root or cache_root()) / "onnx" / f"{path.parent.name}-{path.stem.replace('.', '-')}-{LAYOUT}-{key}"

    def build(scratch: Path, say) -> None:
        say(f"{role}: repacking {path}'s 4-bit weights for hetero_spec's block kernel once, into the cache {entry}")
        scratch.mkdir(parents=True)
        rewrite_graph(path, scratch / "model.onnx", say)
        (scratch / "hetero_spec_source.json").write_text(json.dumps(stamp, indent=2))

    entry = build_once(entry, lambda e: (e / "model.onnx").is_file() and (e / "hetero_spec_source.json").is_file(),
                       build, f"{role}: using the cached Q4Rows graph {entry}", progress)
    return entry / "model.onnx"
