"""Can an ONNX target verify several requests' draft blocks in one pass, and would it pay?

The builder's CPU graph uses GroupQueryAttention, which refuses a batch of several-token blocks over different
pasts. Its other attention path, MultiHeadAttention (what it emits where GQA is not supported), takes any batch
once its mask subgraph (one token per row after a past, or a prompt without one) is replaced by an explicit
additive `attention_bias` input [B, 1, K, past + K]. This script builds that variant of a checkpoint, checks
that a batch of ragged blocks gives each row's own logits, and times both graphs side by side.

Usage: python scripts/onnx_batched_blocks.py [--model models/target] [--threads 2] [--rows 8] [--block 5]
       [--repeats 40] [--out DIR]
Prints a Markdown table of median milliseconds per pass (interleaved) and the tokens per pass each would
commit at a stated acceptance.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

NEG = np.finfo(np.float32).min


def _builder_without_gqa(model: Path, out: Path) -> None:
    """Run the onnxruntime-genai builder (fp32, cpu) with GroupQueryAttention and packed Attention disabled, so it
    emits MultiHeadAttention (its path for providers without GQA). Runs in this (sub)process."""
    import onnxruntime_genai.models as M

    here = os.path.dirname(M.__file__)
    sys.path.insert(0, here)  # the builder imports its package as the top-level `builders`
    import builders.base as base

    base.Model.is_gqa_supported = lambda self: False
    base.Model.is_packed_attn_supported = lambda self: False
    sys.argv = ["builder", "-i", str(model), "-o", str(out), "-p", "fp32", "-e", "cpu",
                "-c", str(out.parent / "hf-cache")]
    runpy.run_path(os.path.join(here, "builder.py"), run_name="__main__")


def _with_bias_input(src: Path, dst: Path) -> None:
    """Feed every MultiHeadAttention an explicit attention_bias input; drop the mask subgraph it replaces."""
    import onnx
    from onnx import TensorProto, helper

    m = onnx.load(str(src / "model.onnx"))
    g = m.graph
    for n in g.node:
        if n.op_type == "MultiHeadAttention":
            n.input[5] = "attention_bias"  # MHA inputs: q, k, v, bias, key_padding_mask, attention_bias, ...
    g.input.append(helper.make_tensor_value_info("attention_bias", TensorProto.FLOAT,
                                                 ["batch_size", 1, "sequence_length", "total_sequence_length"]))
    needed, keep = {o.name for o in g.output}, []
    for n in reversed(list(g.node)):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(i for i in n.input if i)
    del g.node[:]
    g.node.extend(reversed(keep))
    used = {i for n in g.node for i in n.input}
    for inp in [i for i in g.input if i.name not in used]:
        g.input.remove(inp)
    dst.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(dst / "model.onnx"), save_as_external_data=True, location="model.onnx.data")


def bias(lens: list[int], past: int, k: int) -> np.ndarray:
    """Row r sees its own lens[r] cached positions (of `past` slots) and its block causally."""
    b = np.full((len(lens), 1, k, past + k), NEG, np.float32)
    causal = np.where(np.tril(np.ones((k, k), bool)), 0.0, NEG)
    for r, n in enumerate(lens):
        b[r, 0, :, :n] = 0.0
        b[r, 0, :, past:] = causal
    return b


class Mha:
    def __init__(self, path: Path, threads: int):
        import onnxruntime as ort

        o = ort.SessionOptions()
        o.intra_op_num_threads, o.inter_op_num_threads, o.log_severity_level = threads, 1, 3
        o.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the onnx target runs
        self.s = ort.InferenceSession(str(path / "model.onnx"), o)
        self.past = [i.name for i in self.s.get_inputs() if i.name.startswith("past_key_values.")]
        self.present = [n.replace("past_key_values.", "present.") for n in self.past]
        first = next(o for o in self.s.get_outputs() if o.name == self.present[0])
        self.kv_heads, self.head_dim = int(first.shape[1]), int(first.shape[3])

    def run(self, ids: np.ndarray, pos: np.ndarray, b: np.ndarray, kv: list[np.ndarray]):
        feeds = {"input_ids": ids, "position_ids": pos, "attention_bias": b, **dict(zip(self.past, kv))}
        out = self.s.run(["logits", *self.present], feeds)
        return out[0], out[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/target", help="Hugging Face checkpoint directory (the target)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=8, help="requests in the batch")
    p.add_argument("--block", type=int, default=5, help="positions per row to verify (gamma + 1)")
    p.add_argument("--acceptance", type=float, default=0.8, help="per-token acceptance for the tokens column")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--out", default=None, help="where to keep the MHA export (default: a temporary directory)")
    args = p.parse_args()

    from hetero_spec.onnx_decoder import OnnxDecoder
    from hetero_spec.target.export_cache import cached_export

    model = Path(args.model)
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="mha-"))
    raw, mha_dir = work / "mha-builder", work / "mha-bias"
    if not (mha_dir / "model.onnx").is_file():
        print(f"exporting {model} with MultiHeadAttention into {raw} ...", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, __file__, "--_export", str(model), str(raw)],
                              capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"the builder failed:\n{done.stderr[-3000:]}")
        _with_bias_input(raw, mha_dir)
    gqa = OnnxDecoder(cached_export(model, "fp32"), threads=args.threads, role="target", spin=False)
    mha = Mha(mha_dir, args.threads)

    rng = np.random.default_rng(0)
    B, K = args.rows, args.block
    lens = [int(x) for x in rng.integers(120, 160, B)]
    prompts = [rng.integers(5, gqa.model_vocab - 1, n) for n in lens]
    blocks = np.stack([rng.integers(5, gqa.model_vocab - 1, K) for _ in range(B)]).astype(np.int64)
    pos = np.stack([np.arange(n, n + K) for n in lens]).astype(np.int64)

    # MHA: each prompt alone, then every row's cache in one padded buffer (row r holds lens[r] positions)
    empty = [np.zeros((1, mha.kv_heads, 0, mha.head_dim), np.float32)] * len(mha.past)
    pasts = [mha.run(pr[None].astype(np.int64), np.arange(len(pr))[None], bias([0], 0, len(pr)), empty)[1]
             for pr in prompts]
    P = max(lens)
    padded = []
    for li in range(len(mha.past)):
        buf = np.zeros((B, mha.kv_heads, P, mha.head_dim), np.float32)
        for r, kv in enumerate(pasts):
            buf[r, :, :lens[r]] = kv[li][0]
        padded.append(buf)
    together, _ = mha.run(blocks, pos, bias(lens, P, K), padded)
    diffs, same_argmax = [], 0
    for r in range(B):
        alone, _ = mha.run(blocks[r:r + 1], pos[r:r + 1], bias([lens[r]], lens[r], K), pasts[r])
        diffs.append(float(np.abs(alone[0] - together[r]).max()))
        same_argmax += int((alone[0].argmax(-1) == together[r].argmax(-1)).all())

    # GQA: the onnx target's own layout (a KV pool; one-token rows share a run, blocks run one row at a time)
    pool = gqa.new_pool(B)
    states = [pool.acquire() for _ in range(B)]
    for st, pr in zip(states, prompts):
        gqa.append(st, [int(t) for t in pr])

    def gqa_rows_1() -> None:
        gqa.append_batch(states, [int(t) for t in blocks[:, 0]])
        for st, n in zip(states, lens):
            gqa.rewind(st, n)

    def gqa_blocks_in_turn() -> None:
        for st, n, blk in zip(states, lens, blocks):
            gqa.append(st, [int(t) for t in blk])
            gqa.rewind(st, n)

    def gqa_one_1() -> None:
        gqa.append(states[0], [int(blocks[0, 0])])
        gqa.rewind(states[0], lens[0])

    a, g = args.acceptance, K - 1
    e = (1 - a ** (g + 1)) / (1 - a)  # committed tokens per row of a block of g drafts
    b1, bk = bias(lens, P, 1), bias(lens, P, K)
    arms = {  # name: (one pass, positions, committed tokens)
        "GQA (builder), 1 row x 1 token": (gqa_one_1, 1, 1),
        f"GQA (builder), {B} rows x 1 token, one run": (gqa_rows_1, B, B),
        f"GQA (builder), {B} rows x {K} tokens, a run per row": (gqa_blocks_in_turn, B * K, B * e),
        "MHA + attention_bias, 1 row x 1 token": (
            lambda: mha.run(blocks[:1, :1], pos[:1, :1], bias([lens[0]], lens[0], 1), pasts[0]), 1, 1),
        f"MHA + attention_bias, {B} rows x 1 token, one run": (
            lambda: mha.run(blocks[:, :1], pos[:, :1], b1, padded), B, B),
        f"MHA + attention_bias, {B} rows x {K} tokens, one run": (
            lambda: mha.run(blocks, pos, bk, padded), B * K, B * e),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for rep in range(args.repeats):
        rot = rep % len(names)
        for name in names[rot:] + names[:rot]:
            fn = arms[name][0]
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    print(f"batched {B} x {K} ragged blocks (past {min(lens)}-{max(lens)}) against each row alone, MHA graph: "
          f"max |logit diff| {max(diffs):.2e}, same argmax on {same_argmax}/{B} rows")
    print(f"\n{args.threads} threads, median of {args.repeats} interleaved repeats; committed tokens per pass at "
          f"acceptance {a} (a block of {g} drafts commits {e:.2f}), drafting not counted\n")
    print("| pass | ms | positions | committed tokens | committed tokens / ms |")
    print("|---|---:|---:|---:|---:|")
    for name, (_, positions, committed) in arms.items():
        ms = 1e3 * statistics.median(times[name])
        print(f"| {name} | {ms:.2f} | {positions} | {committed:.1f} | {committed / ms:.2f} |")
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--_export":
        _builder_without_gqa(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
