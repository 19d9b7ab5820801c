"""Train the demo model pair: a Llama target and an online-distilled Llama draft.

    python -m models.train --out models --minutes 65            # real run (resumable: --resume)
    python -m models.train --out /tmp/x --corpus-dir DIR --max-steps 3 --tiny   # seconds

Phases (time-budgeted by --minutes, measured on training-loop wall time):
  1. joint (1 - distill_frac of the budget): target trained on CE; draft trained on the same batch
     with alpha*CE + (1-alpha)*T^2*KL(softmax(target/T) || softmax(draft/T)), alpha 0.5 -> 0.1.
  2. draft-only (distill_frac): target frozen, draft distilled (alpha = 0.1) from the final target.
Outputs <out>/target and <out>/draft (HF dirs, fp16 safetensors + tokenizer.json); work files
(tokenizer cache, token stream, checkpoint, log) go to <out>/work.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from models import corpus

EOS = "<|endoftext|>"

REAL = dict(
    vocab=4096, seq_len=256, batch=8,
    target=dict(hidden_size=384, num_hidden_layers=8, intermediate_size=1024, num_attention_heads=6,
                num_key_value_heads=2, tie_word_embeddings=False),
    draft=dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
               num_key_value_heads=2, tie_word_embeddings=True),
)
TINY = dict(  # head_dim 16: the smallest the ONNX Runtime GroupQueryAttention CPU kernel accepts
    vocab=300, seq_len=64, batch=4,
    target=dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False),
    draft=dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
               num_key_value_heads=1, tie_word_embeddings=True),
)

log = logging.getLogger("models.train")


# ----------------------------------------------------------------------------- tokenizer / data
def train_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOS) == 0
    return tok


def hf_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=None,
                                   model_max_length=1024)


def build_stream(tok, texts):
    eos = tok.token_to_id(EOS)
    enc = tok.encode_batch(texts)
    parts = []
    for e in enc:
        parts.append(np.asarray(e.ids, dtype=np.uint16))
        parts.append(np.asarray([eos], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def get_batch(stream, step, batch, seq_len, seed):
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    arr = np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(arr)


# ----------------------------------------------------------------------------- models
def make_model(spec, vocab, seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
                      bos_token_id=0, eos_token_id=0, hidden_act="silu", attention_bias=False, mlp_bias=False,
                      **spec)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def n_params(model):
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def make_opt(model, lr):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def cosine_lr(base, frac, warm_frac, min_ratio=0.1):
    """frac in [0,1] of this schedule; linear warmup for warm_frac, then cosine down to min_ratio*base."""
    frac = min(max(frac, 0.0), 1.0)
    if frac < warm_frac:
        return base * max(frac / warm_frac, 0.01)
    p = (frac - warm_frac) / max(1e-9, 1 - warm_frac)
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def kd_loss(draft_logits, target_logits, T):
    t = F.log_softmax(target_logits.float() / T, dim=-1)
    d = F.log_softmax(draft_logits.float() / T, dim=-1)
    return F.kl_div(d.flatten(0, -2), t.flatten(0, -2), log_target=True, reduction="batchmean") * (T * T)


def save_hf(model, tok_hf, path):
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    m = model.to(torch.float16)
    m.config.dtype = "float16"
    m.save_pretrained(path, safe_serialization=True)
    model.to(torch.float32)
    tok_hf.save_pretrained(path)
    gc = m.generation_config
    gc.bos_token_id = 0
    gc.eos_token_id = 0
    gc.save_pretrained(path)


@torch.no_grad()
def eval_loss(model, stream, seq_len, n_batches=8, batch=8):
    model.eval()
    losses = []
    for i in range(n_batches):
        b = get_batch(stream, 10_000_000 + i, batch, seq_len, seed=1234)
        out = model(b[:, :-1]).logits
        losses.append(F.cross_entropy(out.flatten(0, 1), b[:, 1:].flatten()).item())
    model.train()
    return float(np.mean(losses))


# ----------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models")
    ap.add_argument("--work", default=None, help="work dir (default <out>/work)")
    ap.add_argument("--corpus-dir", default=None, help="default: stdlib of this interpreter")
    ap.add_argument("--minutes", type=float, default=65.0, help="training-loop wall-clock budget")
    ap.add_argument("--max-steps", type=int, default=None, help="optional cap on total steps (both phases)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-lr", type=float, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--warmup-frac", type=float, default=0.03)
    ap.add_argument("--distill-frac", type=float, default=0.12, help="fraction of budget for draft-only phase")
    ap.add_argument("--alpha-start", type=float, default=0.5)
    ap.add_argument("--alpha-end", type=float, default=0.1)
    ap.add_argument("--kd-temp", type=float, default=1.0)
    ap.add_argument("--ckpt-every-min", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    C = TINY if args.tiny else REAL
    batch = args.batch or C["batch"]
    seq_len = args.seq_len or C["seq_len"]
    draft_lr = args.draft_lr or args.lr
    out = Path(args.out)
    work = Path(args.work) if args.work else out / "work"
    work.mkdir(parents=True, exist_ok=True)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.FileHandler(work / "train_log.txt"), logging.StreamHandler(sys.stderr)])
    torch.set_num_threads(args.threads)
    random.seed(args.seed); np.random.seed(args.seed); torch.manual_seed(args.seed)
    log.info("args: %s", vars(args))
    t_setup = time.time()

    # --- corpus + tokenizer + token stream (cached in work dir)
    root = Path(args.corpus_dir) if args.corpus_dir else corpus.stdlib_root()
    files = corpus.stdlib_files(root)
    train_files, held_files = corpus.split(files, root)
    if not train_files:
        train_files = files
    log.info("corpus %s: %d files, %d train, %d held-out", root, len(files), len(train_files), len(held_files))
    import hashlib
    ckey = hashlib.sha1(("|".join(corpus.relpath(f, root) for f in train_files) + str(root)).encode()).hexdigest()[:10]
    key = f"v{C['vocab']}_{ckey}"
    tok_path = work / f"tokenizer_{key}.json"
    stream_path = work / f"train_{key}.npy"
    held_path = work / f"heldout_{key}.npy"
    from tokenizers import Tokenizer
    if tok_path.exists() and stream_path.exists() and held_path.exists():  # cache keyed by corpus + vocab
        tok = Tokenizer.from_file(str(tok_path))
        stream, held_stream = np.load(stream_path), np.load(held_path)
    else:
        train_texts = corpus.read_texts(train_files)
        tok = train_tokenizer(train_texts, C["vocab"])
        tok.save(str(tok_path))
        stream = build_stream(tok, train_texts)
        held_stream = build_stream(tok, corpus.read_texts(held_files)) if held_files else stream[:0]
        np.save(stream_path, stream); np.save(held_path, held_stream)
    vocab = tok.get_vocab_size()
    if len(held_stream) < seq_len + 2:
        held_stream = stream
    log.info("tokenizer vocab %d; train tokens %d, held-out tokens %d; setup %.1fs",
             vocab, len(stream), len(held_stream), time.time() - t_setup)
    tok_hf = hf_tokenizer(tok)

    # --- models / optimizers
    target = make_model(C["target"], vocab, args.seed)
    draft = make_model(C["draft"], vocab, args.seed + 1)
    log.info("params: target %.3fM, draft %.3fM", n_params(target) / 1e6, n_params(draft) / 1e6)
    opt_t, opt_d = make_opt(target, args.lr), make_opt(draft, draft_lr)
    state = dict(step=0, elapsed=0.0, tokens=0, phase2_start=None, hist=[])
    ckpt_path = work / "ckpt.pt"
    if args.resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        target.load_state_dict(ck["target"]); draft.load_state_dict(ck["draft"])
        opt_t.load_state_dict(ck["opt_t"]); opt_d.load_state_dict(ck["opt_d"])
        state = ck["state"]
        log.info("resumed from %s at step %d (%.1f min elapsed)", ckpt_path, state["step"], state["elapsed"] / 60)

    def save_ckpt():
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(dict(target=target.state_dict(), draft=draft.state_dict(), opt_t=opt_t.state_dict(),
                        opt_d=opt_d.state_dict(), state=state, args=vars(args)), tmp)
        os.replace(tmp, ckpt_path)

    budget = args.minutes * 60.0
    p1_frac = 1.0 - args.distill_frac
    max_steps = args.max_steps

    def progress():
        f = state["elapsed"] / budget if budget > 0 else 1.0
        if max_steps:
            f = max(f, state["step"] / max_steps)
        return f

    from tqdm import tqdm
    target.train(); draft.train()
    pbar = tqdm(total=max_steps, initial=state["step"], dynamic_ncols=True, mininterval=5.0, file=sys.stderr)
    last_ckpt = time.time()
    ema = {}
    while True:
        prog = progress()
        if prog >= 1.0:
            break
        phase = 1 if prog < p1_frac else 2
        if phase == 2 and state["phase2_start"] is None:
            state["phase2_start"] = state["step"]
            log.info("phase 2 (draft-only distillation from frozen target) at step %d", state["step"])
            target.eval()
        t0 = time.time()
        b = get_batch(stream, state["step"], batch, seq_len, args.seed)
        x, y = b[:, :-1], b[:, 1:]
        lr_d = cosine_lr(draft_lr, prog, args.warmup_frac)
        for g in opt_d.param_groups:
            g["lr"] = lr_d
        if phase == 1:
            lr_t = cosine_lr(args.lr, prog / p1_frac, args.warmup_frac / p1_frac)
            for g in opt_t.param_groups:
                g["lr"] = lr_t
            t_logits = target(x).logits
            loss_t = F.cross_entropy(t_logits.flatten(0, 1), y.flatten())
            opt_t.zero_grad(set_to_none=True)
            loss_t.backward()
            torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
            opt_t.step()
            t_logits = t_logits.detach()
            alpha = args.alpha_start + (args.alpha_end - args.alpha_start) * min(1.0, prog / p1_frac)
        else:
            with torch.no_grad():
                t_logits = target(x).logits
            loss_t = F.cross_entropy(t_logits.flatten(0, 1), y.flatten())
            alpha = args.alpha_end
        d_logits = draft(x).logits
        ce_d = F.cross_entropy(d_logits.flatten(0, 1), y.flatten())
        kl = kd_loss(d_logits, t_logits, args.kd_temp)
        loss_d = alpha * ce_d + (1 - alpha) * kl
        opt_d.zero_grad(set_to_none=True)
        loss_d.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt_d.step()
        with torch.no_grad():
            agree = (d_logits.argmax(-1) == t_logits.argmax(-1)).float().mean().item()

        dt = time.time() - t0
        state["elapsed"] += dt
        state["step"] += 1
        state["tokens"] += x.numel()
        for k, v in dict(lt=loss_t.item(), ld=ce_d.item(), kl=kl.item(), agr=agree).items():
            ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
        pbar.update(1)
        pbar.set_postfix(ph=phase, lt=f"{ema['lt']:.3f}", ld=f"{ema['ld']:.3f}", kl=f"{ema['kl']:.3f}",
                         agr=f"{ema['agr']:.3f}", tps=f"{x.numel() / dt:.0f}",
                         min=f"{state['elapsed'] / 60:.1f}", refresh=False)
        if state["step"] % 25 == 0 or state["step"] <= 3:
            rec = dict(step=state["step"], phase=phase, min=round(state["elapsed"] / 60, 2), tokens=state["tokens"],
                       lr_d=lr_d, alpha=round(alpha, 3), **{k: round(v, 4) for k, v in ema.items()})
            state["hist"].append(rec)
            log.info("%s", json.dumps(rec))
        if time.time() - last_ckpt > args.ckpt_every_min * 60:
            save_ckpt(); last_ckpt = time.time()
            log.info("checkpoint saved at step %d", state["step"])
    pbar.close()
    save_ckpt()

    # --- final: held-out loss (training-time, fp32) + save
    ev = dict(heldout_loss_target_fp32=eval_loss(target, held_stream, seq_len, n_batches=2 if args.tiny else 8),
              heldout_loss_draft_fp32=eval_loss(draft, held_stream, seq_len, n_batches=2 if args.tiny else 8))
    summary = dict(steps=state["step"], tokens_seen=state["tokens"], train_minutes=round(state["elapsed"] / 60, 2),
                   phase2_start_step=state["phase2_start"], batch=batch, seq_len=seq_len,
                   params_target=n_params(target), params_draft=n_params(draft),
                   train_stream_tokens=int(len(stream)), heldout_stream_tokens=int(len(held_stream)),
                   n_train_files=len(train_files), n_heldout_files=len(held_files), args=vars(args), **ev)
    log.info("summary: %s", json.dumps(summary))
    save_hf(target, tok_hf, out / "target")
    save_hf(draft, tok_hf, out / "draft")
    with open(work / "train_summary.json", "w") as f:
        json.dump(dict(summary, hist=state["hist"]), f, indent=1)
    log.info("saved %s and %s", out / "target", out / "draft")
    return summary


if __name__ == "__main__":
    main()
