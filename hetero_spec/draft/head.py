"""A draft whose LM head proposes only the most frequent tokens (FR-Spec, Zhao et al. 2025): `draft.head: N`
(measured: docs/real-pair.md#a-cheaper-draft-fr-spec). The pruned copy keeps the head's rows for the special tokens
(EOS must stay proposable), then CODE_SHARE of the rest by frequency in the Python standard library (tokenized with
the draft's tokenizer: code), the others by the tokenizer's BPE merge rank (its merges were learnt most frequent
first on its own training text: prose and chat as well as code). `head_tokens.npy` maps its N logits back to token
ids; OnnxDecoder spreads them into the full vocabulary with -inf elsewhere, so q is zero outside the subset and
verification stays exact.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np

from ..target.export_cache import build_once, cache_root, stamp_key
from .export import RUNNER_MODEL

HEAD_TOKENS = "head_tokens.npy"  # the token id of each logit the pruned head outputs, in order
HEAD_SOURCE = "head_source.txt"  # the export the copy was pruned from
#: the head's rows chosen by the standard library's counts; the rest by merge rank. Measured on the real pair, the
#: draft's greedy agreement with the target at 49,152 rows: chat 0.759 -> 0.768, code 0.890 -> 0.891 against all by
#: the standard library (docs/real-pair.md#a-cheaper-draft-fr-spec)
CODE_SHARE = 0.75


def corpus_files() -> list[Path]:
    """The corpus: the standard library's .py files (site-packages excluded), in a fixed order."""
    return sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py") if "site-packages" not in p.parts)


def corpus_token_ids(tokenizer_json: Path, files: list[Path] | None = None) -> list[np.ndarray]:
    """The corpus tokenized with this tokenizer, one array per file (files that are not UTF-8 are skipped)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_json))
    texts = []
    for path in files if files is not None else corpus_files():
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return [np.asarray(enc.ids, dtype=np.int64) for i in range(0, len(texts), 256)
            for enc in tok.encode_batch(texts[i:i + 256], add_special_tokens=False)]


def token_counts(tokenizer_json: Path, files: list[Path] | None = None) -> np.ndarray:
    """How often each token id occurs in the corpus."""
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    ids = corpus_token_ids(tokenizer_json, files)
    return np.bincount(np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64), minlength=vocab)[:vocab]


def merge_order(tokenizer_json: Path, vocab: int) -> list[int]:
    """Token ids below `vocab` by the rank of the BPE merge that made each (the alphabet first, then merge by merge;
    tokens no merge makes after them, by id); ids in order where the tokenizer is not a BPE with merges."""
    model = json.loads(Path(tokenizer_json).read_text(encoding="utf-8")).get("model", {})
    ids, merges = model.get("vocab"), model.get("merges")
    if model.get("type") != "BPE" or not isinstance(ids, dict) or not merges:
        return list(range(vocab))
    made = {}
    for rank, merge in enumerate(merges):  # "a b" (older files) or ["a", "b"]
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        made.setdefault(ids.get(left + right), rank)
    alphabet = {i for token, i in ids.items() if len(token) == 1}  # what the merges start from
    last = len(merges)
    return sorted(range(vocab), key=lambda t: (made.get(t, -1 if t in alphabet else last), t))


def head_tokens(export_dir: Path, n_tokens: int, vocab: int, code_share: float | None = None) -> np.ndarray:
    """The head's n_tokens rows below `vocab`, sorted: the special tokens, then code_share (default CODE_SHARE) of
    the rest the most frequent in the standard library's source (those seen there), then the first by merge rank
    not yet kept."""
    counts = token_counts(export_dir / "tokenizer.json")[:vocab]
    special = _special_ids(export_dir, vocab)
    room = max(0, n_tokens - len(special))
    by_count = [int(t) for t in np.argsort(-counts, kind="stable") if counts[t] > 0 and int(t) not in special]
    keep = special | set(by_count[:int(room * (CODE_SHARE if code_share is None else code_share))])
    for t in merge_order(export_dir / "tokenizer.json", vocab):
        if len(keep) >= min(n_tokens, vocab):
            break
        keep.add(t)
    return np.asarray(sorted(keep), dtype=np.int64)


def _special_ids(export_dir: Path, vocab: int) -> set[int]:
    """Added (special) tokens of tokenizer.json and the EOS ids of genai_config.json."""
    ids = {int(t["id"]) for t in json.loads((export_dir / "tokenizer.json").read_text()).get("added_tokens", [])}
    gcfg = export_dir / "genai_config.json"
    eos = json.loads(gcfg.read_text()).get("model", {}).get("eos_token_id", []) if gcfg.is_file() else []
    ids |= set(eos if isinstance(eos, list) else [eos])
    return {t for t in ids if 0 <= t < vocab}


def prune_head(export_dir: Path, out_dir: Path, n_tokens: int) -> Path:
    """Write to out_dir a copy of the export whose LM head (a MatMulNBits, or a MatMul with a weight) keeps the
    rows of `head_tokens`; the weights file is linked, not copied, and the head's rows go inline in model.onnx."""
    import onnx
    from onnx import numpy_helper
    graph_file = RUNNER_MODEL if (export_dir / RUNNER_MODEL).is_file() else "model.onnx"
    model = onnx.load(str(export_dir / graph_file), load_external_data=False)  # the copy's only graph
    graph = model.graph
    head = next((node for node in graph.node if "logits" in node.output), None)
    inits = {i.name: i for i in graph.initializer}
    if head is None or head.op_type not in ("MatMulNBits", "MatMul") or head.input[1] not in inits:
        raise ValueError(f"{export_dir}: no LM head to prune (the node making `logits` is "
                         f"{head.op_type if head else 'missing'})")
    nbits = head.op_type == "MatMulNBits"
    attrs = {a.name: a for a in head.attribute}
    vocab = int(attrs["N"].i) if nbits else int(inits[head.input[1]].dims[1])
    keep = head_tokens(export_dir, n_tokens, vocab)
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(head.input[1:], 1):
        if name not in inits:  # optional inputs left empty
            continue
        arr = _array(inits[name], export_dir)
        if nbits:  # B [N, blocks, blob], scales and zero points [N, ...] or flat
            rows = arr.reshape(vocab, -1)[keep].reshape(-1 if arr.ndim == 1 else (len(keep), *arr.shape[1:]))
        else:  # MatMul: B [K, N]
            rows = arr[:, keep]
        # the initializer replaced in place, under a new name
        inits[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(rows), f"{name}.head{len(keep)}"))
        head.input[i] = inits[name].name
    if nbits:
        attrs["N"].i = len(keep)
    next(o for o in graph.output if o.name == "logits").type.tensor_type.shape.dim[-1].dim_value = len(keep)
    onnx.save(model, str(out_dir / "model.onnx"))
    for path in export_dir.iterdir():  # the weights and the tokenizer files: linked where the filesystem allows
        if path.is_file() and path.name not in ("model.onnx", RUNNER_MODEL) and not (out_dir / path.name).exists():
            try:
                os.link(path, out_dir / path.name)
            except OSError:
                shutil.copy2(path, out_dir / path.name)
    np.save(out_dir / HEAD_TOKENS, keep)
    (out_dir / HEAD_SOURCE).write_text(str(export_dir.resolve()))
    return out_dir


def unpruned(model_dir: Path) -> Path:
    """The export a pruned copy was made from (peers that need the whole vocabulary: ORT GenAI), else model_dir."""
    source = Path(model_dir) / HEAD_SOURCE
    return Path(source.read_text().strip()) if source.is_file() else Path(model_dir)


def _array(init, base: Path) -> np.ndarray:
    """An initializer's values, its external data read directly (onnx's reader refuses a linked weights file)."""
    from onnx import helper, numpy_helper
    if not init.external_data:
        return numpy_helper.to_array(init)
    info = {e.key: e.value for e in init.external_data}
    dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
    return np.fromfile(base / info["location"], dtype=dtype, count=int(info["length"]) // dtype.itemsize,
                       offset=int(info.get("offset", 0))).reshape(tuple(init.dims))


def cached_pruned(export_dir: Path, size: int) -> Path:
    """The pruned copy of export_dir for `draft.head: size`, made once next to it in the cache."""
    export_dir = Path(export_dir).resolve()
    key = stamp_key({"export": str(export_dir), "mtime": (export_dir / "model.onnx").stat().st_mtime_ns, "n": size,
                     "code_share": CODE_SHARE})
    entry = cache_root() / "onnx" / f"{export_dir.name}-head{size}-{key}"

    def build(scratch: Path, say) -> None:
        say(f"pruning the draft's LM head to {size} frequent tokens (draft.head), once, into {entry}")
        prune_head(export_dir, scratch, size)
    return build_once(entry, lambda e: (e / HEAD_TOKENS).is_file(), build, f"draft: using the pruned head {entry}")
