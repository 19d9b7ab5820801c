"""Corpus helpers: the Python standard library source of the running interpreter.

Files are split deterministically into train / held-out by a hash of their relative path
(sha1(relpath)[0] < 13, i.e. ~5% held out). Held-out files are only used for evaluation and
benchmark prompts.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

HELDOUT_BYTE_THRESHOLD = 13  # sha1(relpath)[0] < 13  ->  ~5.1% held out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _read_utf8(path: Path) -> Optional[str]:
    try:
        return path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def stdlib_files(root: Optional[os.PathLike] = None) -> List[Path]:
    """All *.py files (recursively, test dirs included) under ``root`` (default: the stdlib of the
    running interpreter), excluding site-packages and files that are not valid UTF-8.
    Returned sorted by relative path (deterministic)."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            p = Path(dirpath) / fn
            if not p.is_file():
                continue
            if _read_utf8(p) is None:
                continue
            out.append(p)
    out.sort(key=lambda p: relpath(p, root))
    return out


def relpath(path: os.PathLike, root: Optional[os.PathLike] = None) -> str:
    root = Path(root) if root is not None else stdlib_root()
    return Path(path).relative_to(root).as_posix()


def is_heldout(rel: str) -> bool:
    return hashlib.sha1(rel.encode("utf-8")).digest()[0] < HELDOUT_BYTE_THRESHOLD


def split(files: Sequence[os.PathLike], root: Optional[os.PathLike] = None) -> Tuple[List[Path], List[Path]]:
    """Deterministic (train, heldout) split by sha1 of the path relative to ``root``."""
    train, held = [], []
    for f in files:
        (held if is_heldout(relpath(f, root)) else train).append(Path(f))
    return train, held


def read_texts(files: Iterable[os.PathLike]) -> List[str]:
    texts = []
    for f in files:
        t = _read_utf8(Path(f))
        if t is not None:
            texts.append(t)
    return texts


def heldout_prompts(tokenizer, n: int = 30, prompt_tokens: int = 64, *, root: Optional[os.PathLike] = None,
                    min_following: int = 64, return_ids: bool = False):
    """Deterministic list of ``n`` prompts of ``prompt_tokens`` tokens from held-out files.

    Walks held-out files in sorted order; from each file takes one prompt at a deterministic
    offset (derived from sha1 of the relative path) such that at least ``min_following`` tokens of
    the file follow the prompt.  If there are fewer usable files than ``n``, makes further passes
    taking additional offsets.  Returns decoded strings (or token-id lists with return_ids=True).
    ``tokenizer`` may be a transformers tokenizer or a ``tokenizers.Tokenizer``.
    """
    root = Path(root) if root is not None else stdlib_root()
    _, held = split(stdlib_files(root), root)

    def encode(text):
        if hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode") and hasattr(tokenizer, "get_vocab") \
                and not hasattr(tokenizer, "encode_batch"):
            return tokenizer.encode(text, add_special_tokens=False)
        return tokenizer.encode(text).ids  # tokenizers.Tokenizer

    def decode(ids):
        return tokenizer.decode(ids)

    encoded = []
    for f in held:
        ids = encode(_read_utf8(f) or "")
        if len(ids) >= prompt_tokens + min_following:
            encoded.append((relpath(f, root), ids))
    prompts = []
    pass_idx = 0
    while len(prompts) < n and encoded and pass_idx < 64:
        for rel, ids in encoded:
            if len(prompts) >= n:
                break
            span = len(ids) - prompt_tokens - min_following
            h = int.from_bytes(hashlib.sha1(f"{rel}#{pass_idx}".encode()).digest()[:8], "big")
            off = h % (span + 1)
            p = ids[off:off + prompt_tokens]
            prompts.append(list(p) if return_ids else decode(p))
        pass_idx += 1
    return prompts
