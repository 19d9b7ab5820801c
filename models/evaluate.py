"""Evaluate the saved demo model pair on held-out stdlib files.

    python -m models.evaluate --models models [--out models/metrics.json]

Measures, on the saved-and-reloaded models (fp16 weights loaded as fp32):
  (a) held-out loss (mean token CE over non-overlapping seq_len windows of the held-out stream)
      of target and draft;
  (b) greedy agreement: n prompts of prompt_tokens tokens from held-out files (corpus.heldout_prompts);
      the target greedily continues each for gen_tokens tokens; agreement = fraction of positions
      along that continuation where argmax(draft) == argmax(target) (teacher-forced on the target's
      own continuation). Reported for the PyTorch draft and, if present, the ONNX fp32/int4 drafts.
  Also a rough ONNX draft decode latency (ms/token, batch 1, KV cache, this machine).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from models import corpus


def load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return m, AutoTokenizer.from_pretrained(path)


def n_params(model):
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def heldout_stream(tok, root=None):
    root = Path(root) if root else corpus.stdlib_root()
    _, held = corpus.split(corpus.stdlib_files(root), root)
    eos = tok.eos_token_id
    ids = []
    for t in corpus.read_texts(held):
        ids.extend(tok.encode(t, add_special_tokens=False))
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


@torch.no_grad()
def heldout_loss(model, stream, seq_len=256, max_windows=400, batch=8):
    n = (len(stream) - 1) // seq_len
    idx = np.linspace(0, n - 1, num=min(n, max_windows)).round().astype(int)
    idx = np.unique(idx)
    tot, cnt = 0.0, 0
    for i in range(0, len(idx), batch):
        b = torch.from_numpy(np.stack([stream[j * seq_len: j * seq_len + seq_len + 1] for j in idx[i:i + batch]]))
        logits = model(b[:, :-1]).logits
        tot += F.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten(), reduction="sum").item()
        cnt += b[:, 1:].numel()
    return tot / cnt, cnt


@torch.no_grad()
def greedy_continue(model, prompt_ids, n_tokens):
    """Plain greedy continuation (full recompute each step; no EOS stopping)."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    for _ in range(n_tokens):
        nxt = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0].tolist()


class OnnxDraft:
    def __init__(self, path):
        import onnxruntime as ort
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        self.sess = ort.InferenceSession(str(Path(path) / "model.onnx"), so, providers=["CPUExecutionProvider"])
        self.inputs = self.sess.get_inputs()
        self.outputs = [o.name for o in self.sess.get_outputs()]

    def _empty_past(self):
        feed = {}
        for i in self.inputs:
            if i.name.startswith("past_key_values"):
                _, h, _, d = i.shape
                feed[i.name] = np.zeros((1, h, 0, d if isinstance(d, int) else self._head_dim()), dtype=np.float32)
        return feed

    def _head_dim(self):
        cfg = json.load(open(Path(self.sess._model_path).parent / "genai_config.json"))
        return cfg["model"]["decoder"]["head_size"]

    def run(self, ids, past=None):
        """ids: list of new tokens; past: dict of past tensors (or None). Returns logits, present dict."""
        past = past if past is not None else self._empty_past()
        past_len = next(iter(past.values())).shape[2]
        feed = dict(past)
        feed["input_ids"] = np.asarray([ids], dtype=np.int64)
        names = {i.name for i in self.inputs}
        if "attention_mask" in names:
            feed["attention_mask"] = np.ones((1, past_len + len(ids)), dtype=np.int64)
        if "position_ids" in names:
            feed["position_ids"] = np.arange(past_len, past_len + len(ids), dtype=np.int64)[None]
        outs = self.sess.run(self.outputs, feed)
        res = dict(zip(self.outputs, outs))
        present = {k.replace("present", "past_key_values"): v for k, v in res.items() if k.startswith("present")}
        return res["logits"], present


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models")
    ap.add_argument("--out", default=None, help="default <models>/metrics.json")
    ap.add_argument("--corpus-dir", default=None)
    ap.add_argument("--n-prompts", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--max-windows", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    md = Path(args.models)
    target, tok = load(md / "target")
    draft, dtok = load(md / "draft")
    assert tok.get_vocab() == dtok.get_vocab(), "target/draft tokenizers differ"
    res = dict(params_target=n_params(target), params_draft=n_params(draft))

    t0 = time.time()
    stream = heldout_stream(tok, args.corpus_dir)
    lt, ntok = heldout_loss(target, stream, max_windows=args.max_windows)
    ld, _ = heldout_loss(draft, stream, max_windows=args.max_windows)
    res.update(heldout_tokens_total=int(len(stream)), heldout_loss_tokens=ntok,
               heldout_loss_target=round(lt, 4), heldout_loss_draft=round(ld, 4),
               heldout_ppl_target=round(float(np.exp(lt)), 3), heldout_ppl_draft=round(float(np.exp(ld)), 3))
    print(f"held-out loss: target {lt:.4f}  draft {ld:.4f}  ({ntok} tokens, {time.time() - t0:.0f}s)", flush=True)

    prompts = corpus.heldout_prompts(tok, args.n_prompts, args.prompt_tokens, root=args.corpus_dir,
                                     min_following=args.gen_tokens, return_ids=True)
    P, G = args.prompt_tokens, args.gen_tokens
    onnx = {}
    for name in ("fp32", "int4"):
        p = md / f"draft-onnx-{name}"  # an export beside the checkpoint, else its cached export
        if not (p / "model.onnx").exists():
            from hetero_spec.target.export_cache import cached_export

            p = cached_export(md / "draft", name, role="draft")
        onnx[name] = OnnxDraft(p)
    hits = dict(torch=0, **{f"onnx_{k}": 0 for k in onnx})
    hits_tok = 0
    total = 0
    per_prompt = []
    sample = None
    t0 = time.time()
    for k, pr in enumerate(prompts):
        seq = greedy_continue(target, pr, G)
        x = torch.tensor([seq])
        with torch.no_grad():
            t_arg = target(x).logits[0, P - 1:P - 1 + G].argmax(-1)
            d_arg = draft(x).logits[0, P - 1:P - 1 + G].argmax(-1)
        cont = torch.tensor(seq[P:P + G])
        hits_tok += (t_arg == cont).sum().item()
        h = (d_arg == t_arg).sum().item()
        hits["torch"] += h
        per_prompt.append(round(h / G, 3))
        for name, sess in onnx.items():
            logits, _ = sess.run(seq)
            o_arg = torch.from_numpy(logits[0, P - 1:P - 1 + G].argmax(-1))
            hits[f"onnx_{name}"] += (o_arg == t_arg).sum().item()
        total += G
        if sample is None:
            sample = dict(prompt=tok.decode(pr), target_continuation=tok.decode(seq[P:]))
    res.update(agreement_n_prompts=len(prompts), agreement_prompt_tokens=P, agreement_gen_tokens=G,
               agreement_positions=total,
               agreement_draft_torch=round(hits["torch"] / total, 4),
               **{f"agreement_draft_{k}": round(v / total, 4) for k, v in hits.items() if k != "torch"},
               target_teacher_forced_vs_greedy=round(hits_tok / total, 4),
               agreement_per_prompt_torch=per_prompt)
    print(f"agreement ({len(prompts)} prompts x {G}): " +
          ", ".join(f"{k} {v / total:.4f}" for k, v in hits.items()) + f"  ({time.time() - t0:.0f}s)", flush=True)

    # ONNX decode latency (batch 1, KV cache, 1 intra-op thread)
    for name, sess in onnx.items():
        times = []
        for pr in prompts[:5]:
            logits, past = sess.run(pr)
            nxt = int(logits[0, -1].argmax())
            for _ in range(32):
                t1 = time.perf_counter()
                logits, past = sess.run([nxt], past)
                times.append(time.perf_counter() - t1)
                nxt = int(logits[0, -1].argmax())
        res[f"onnx_{name}_decode_ms_per_token_median"] = round(float(np.median(times)) * 1e3, 4)
        print(f"onnx {name}: {np.median(times) * 1e3:.3f} ms/token (median, 1 thread)", flush=True)

    res["sample"] = sample
    out = Path(args.out) if args.out else md / "metrics.json"
    prev = json.load(open(out)) if out.exists() else {}
    prev.update(res)
    with open(out, "w") as f:
        json.dump(prev, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("agreement_per_prompt_torch", "sample")}, indent=1))
    return res


if __name__ == "__main__":
    main()
