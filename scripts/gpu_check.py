"""GPU check: the CUDA target path and pinned-memory transfers, with a short timing table.

Run on a machine with a CUDA GPU (scripts/gpu_check.sh). It needs no trained weights: it builds a small
random Llama target (vocab 4096) and its ONNX export as the draft, unless --target/--draft are given.
Prints a markdown table and exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _median_ms(fn, n: int = 30) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _build_pair(root: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hetero_spec.draft.export import export_draft
    from tests.fixtures.tiny_models import build_model

    target = build_model("llama_gqa", root / "target", seed=1, vocab_size=4096, hidden_size=512,
                         intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=1024)
    draft = export_draft(target, root / "draft-onnx", "fp32", quiet=True)
    return target, draft


def _onnx_backend_rows(target: Path, draft: Path, prompt: list[int], tokens: int) -> list[tuple[str, str, str]]:
    """target.backend onnx on the CUDA execution provider (onnxruntime-gpu), against the same export decoded
    alone; skipped with a reason when this onnxruntime build has no CUDA EP."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return [("onnx backend, CUDA EP", "skipped",
                 f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (pip install onnxruntime-gpu)")]
    from hetero_spec import Engine

    rows = []
    cfg = {"target": {"model": str(target), "backend": "onnx", "providers": ["CUDAExecutionProvider"]},
           "draft": {"kind": "none"}}
    with Engine.from_config(cfg) as eng:
        ref = eng.generate(prompt, max_new_tokens=tokens)
        rows.append(("onnx backend, CUDA EP: loads", str(eng.target.decoder.session.get_providers()[0]),
                     f"layout {eng.target.decoder.layout}, {ref.stats['tokens_per_s']:.0f} tok/s target-only"))
    for mode in ("in_process", "two_process"):
        c = {**cfg, "draft": {"kind": "onnx", "model": str(draft)}, "runtime": {"mode": mode}}
        with Engine.from_config(c) as eng:
            out = eng.generate(prompt, max_new_tokens=tokens, gamma=4)
            rows.append((f"onnx backend, CUDA EP, {mode}: identical to its target-only",
                         str(out.token_ids == ref.token_ids), f"acceptance {out.stats['acceptance_rate']:.2f}"))
    return rows


def _batch_and_precision_rows(cfg: dict, prompt: list[int], tokens: int) -> list[tuple[str, str, str]]:
    """CUDA: padded batched verification (4 requests at once, each equal to its solo run), then each stored KV
    cache (fp8 e4m3 and int8 with per-token scales, fp16) and a bf16 target against themselves alone."""
    import threading

    from hetero_spec import Engine

    rows = []
    prompts = [prompt, prompt[::-1], prompt[5:], prompt[:9] * 2]
    with Engine.from_config({**cfg, "runtime": {"mode": "in_process"}, "speculation": {"gamma": 4}}) as eng:
        solo = [eng.generate(p, max_new_tokens=tokens).token_ids for p in prompts]
        got: dict[int, list[int]] = {}
        with eng._lock:  # all four start in the same round
            threads = [threading.Thread(target=lambda i=i: got.__setitem__(
                i, eng.generate(prompts[i], max_new_tokens=tokens).token_ids)) for i in range(4)]
            for th in threads:
                th.start()
            time.sleep(0.5)
        for th in threads:
            th.join()
        same = all(got[i] == solo[i] for i in range(4))
        rows.append(("CUDA batched verification (4 requests, padded pass): each equals its solo run", str(same),
                     f"batch sizes seen {sorted(set(eng.batch_sizes()))}"))
    for kv in ("fp8", "int8", "fp16"):
        t = {**cfg["target"], "kv_cache_dtype": kv}
        with Engine.from_config({**cfg, "target": t, "draft": {"kind": "none"}}) as eng:
            ref = eng.generate(prompt, max_new_tokens=tokens).token_ids
        with Engine.from_config({**cfg, "target": t, "runtime": {"mode": "in_process"}}) as eng:
            out = eng.generate(prompt, max_new_tokens=tokens, gamma=4)
        rows.append((f"CUDA KV cache {kv}: identical to its target-only", str(out.token_ids == ref),
                     f"acceptance {out.stats['acceptance_rate']:.2f}"))
    t = {**cfg["target"], "dtype": "auto", "precision": "bf16"}
    with Engine.from_config({**cfg, "target": t, "draft": {"kind": "none"}}) as eng:
        ref = eng.generate(prompt, max_new_tokens=tokens).token_ids
    with Engine.from_config({**cfg, "target": t, "runtime": {"mode": "in_process"}}) as eng:
        out = eng.generate(prompt, max_new_tokens=tokens, gamma=4)
    rows.append(("CUDA bf16 target: identical to its target-only (may differ at near-ties)",
                 "same" if out.token_ids == ref else "differs", f"acceptance {out.stats['acceptance_rate']:.2f}"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", help="HF target directory (default: a random model built here)")
    ap.add_argument("--draft", help="ONNX draft directory (default: the target's ONNX export)")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (this script is for GPU machines)")
        return 2
    from hetero_spec import Engine
    from hetero_spec.target.staging import Staging

    rows, ok = [], True
    dev = torch.device("cuda")
    st = Staging(dev, max_tokens=16)
    pinned = st.pinned
    rows.append(("staging buffers pinned", str(pinned), ""))
    ok &= pinned

    # ordering: a kernel queued behind long work still reads the ids it was given, not the next block's
    # (the side-stream copy of the next ids must wait for the compute stream; the buffer is reused)
    big = torch.randn(8192, 8192, device=dev)
    torch.cuda.synchronize()
    first = st.tokens([1, 2, 3])
    _ = big @ big @ big  # keep the compute stream busy
    seen = first.clone()  # queued after the matmuls: reads the device buffer late
    st.tokens([7, 8, 9])
    ordered = seen.tolist() == [[1, 2, 3]]
    rows.append(("staging copy waits for earlier readers", str(ordered), f"read {seen.tolist()}"))
    ok &= ordered

    # async: a non_blocking copy from pinned memory returns before a long GPU kernel ahead of it ends
    torch.cuda.synchronize()
    t = time.perf_counter()
    _ = big @ big  # queue ~1 ms+ of work on the compute stream
    host_pinned = torch.empty(1 << 20, pin_memory=True)
    dst = torch.empty(1 << 20, device=dev)
    with torch.cuda.stream(st.stream):
        t_copy = time.perf_counter()
        dst.copy_(host_pinned, non_blocking=True)
        t_copy = (time.perf_counter() - t_copy) * 1e3
    torch.cuda.synchronize()
    total = (time.perf_counter() - t) * 1e3
    is_async = t_copy < total / 2
    rows.append(("non_blocking pinned copy returns early", str(is_async),
                 f"call {t_copy:.3f} ms vs {total:.3f} ms until the GPU finished"))
    ok &= is_async
    pageable = torch.empty(4096, dtype=torch.long)
    pinned_buf = torch.empty(4096, dtype=torch.long, pin_memory=True)
    d = torch.empty(4096, dtype=torch.long, device=dev)
    rows.append(("H2D 8 tokens, pinned+async (ms)", f"{_median_ms(lambda: st.tokens(list(range(8)))):.4f}", ""))
    rows.append(("H2D 32 KB pageable (ms)", f"{_median_ms(lambda: d.copy_(pageable)):.4f}", ""))
    rows.append(("H2D 32 KB pinned (ms)", f"{_median_ms(lambda: d.copy_(pinned_buf, non_blocking=True)):.4f}", ""))

    with tempfile.TemporaryDirectory() as tmp:
        target, draft = (Path(args.target), Path(args.draft)) if args.target else _build_pair(Path(tmp))
        prompt = list(range(10, 42))
        cfg = {"target": {"model": str(target), "device": "cuda", "dtype": "float32"},
               "draft": {"kind": "onnx", "model": str(draft)}}
        with Engine.from_config({**cfg, "draft": {"kind": "none"}}) as eng:
            eng.generate(prompt, max_new_tokens=8)
            ref = eng.generate(prompt, max_new_tokens=args.tokens)
            ref_sampled = eng.generate(prompt, max_new_tokens=args.tokens, temperature=0.8, seed=3)
        for mode in ("in_process", "two_process"):
            with Engine.from_config({**cfg, "runtime": {"mode": mode}}) as eng:
                eng.generate(prompt, max_new_tokens=8)
                out = eng.generate(prompt, max_new_tokens=args.tokens, gamma=4)
                s = out.stats
                same = out.token_ids == ref.token_ids
                ok &= same
                draft_ms = 1e3 * (s["time_draft_s"] / max(1, s["rounds"]))
                wait_ms = 1e3 * (s["time_wait_s"] / max(1, s["rounds"]))
                verify_ms = 1e3 * (s["time_verify_s"] / max(1, s["rounds"]))
                gate = s["extra"].get("gate", {})
                rows.append((f"{mode}: identical to CUDA target-only", str(same),
                             f"acceptance {s['acceptance_rate']:.2f}, {s['tokens_per_s']:.0f} tok/s "
                             f"(target-only {ref.stats['tokens_per_s']:.0f})"))
                sampled = eng.generate(prompt, max_new_tokens=args.tokens, gamma=4, temperature=0.8, seed=3)
                same_sampled = sampled.token_ids == ref_sampled.token_ids
                ok &= same_sampled
                rows.append((f"{mode}: coupled sampling (T 0.8, seed 3) identical to target-only", str(same_sampled),
                             f"acceptance {sampled.stats['acceptance_rate']:.2f}"))
                rows.append((f"{mode}: per round draft / wait / verify (ms)",
                             f"{draft_ms:.3f} / {wait_ms:.3f} / {verify_ms:.3f}",
                             f"transfer {gate.get('transfer_ms')} ms, staging copies {eng.target.staging.copies}"))
        rows += _onnx_backend_rows(target, draft, prompt, args.tokens)
        ok &= all(r[1] != "False" for r in rows[-3:])
        extra = _batch_and_precision_rows(cfg, prompt, args.tokens)
        rows += extra
        ok &= all(r[1] != "False" for r in extra)
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print("| check | result | detail |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
