"""Held-out prompts: the project's corpus split when present, else a fallback from the tokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..config import Config
from .context import BenchError


def _corpus_module(config_path: Path):
    """models/corpus.py of this checkout (next to the package, or two levels above the config)."""
    for root in (Path(__file__).resolve().parents[2], config_path.resolve().parent.parent):
        path = root / "models" / "corpus.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location("hetero_spec_bench_corpus", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    return None


def _fallback_prompts(tokenizer, n: int, prompt_tokens: int) -> list[list[int]]:
    """Held-out standard-library files (same rule as models/corpus.py), one prompt cut from each."""
    import hashlib
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    prompts = []
    for p in files:
        rel = p.relative_to(root).as_posix()
        if hashlib.sha1(rel.encode()).digest()[0] >= 13:
            continue
        try:
            ids = tokenizer.encode(p.read_bytes().decode("utf-8"), add_special_tokens=False)
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) >= 2 * prompt_tokens:
            span = len(ids) - 2 * prompt_tokens + 1
            off = int.from_bytes(hashlib.sha1(rel.encode()).digest()[:4], "big") % span
            prompts.append(ids[off:off + prompt_tokens])
        if len(prompts) >= n:
            break
    return prompts


def heldout_prompt_ids(config: Config, config_path: Path, n: int, prompt_tokens: int) -> list[list[int]]:
    """n held-out prompts of prompt_tokens tokens each, tokenized with the target's tokenizer."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(config.target.model)
    except (OSError, ValueError) as exc:
        raise BenchError(f"the target {config.target.model} has no usable tokenizer for the held-out "
                         f"prompts: {exc}") from None
    corpus = _corpus_module(config_path)
    if corpus is not None and hasattr(corpus, "heldout_prompts"):
        prompts = corpus.heldout_prompts(tok, n=n, prompt_tokens=prompt_tokens, return_ids=True)
    else:
        prompts = _fallback_prompts(tok, n, prompt_tokens)
    if len(prompts) < n:
        raise BenchError(f"found only {len(prompts)} held-out prompts of {prompt_tokens} tokens; asked for {n}")
    return [[int(t) for t in p] for p in prompts]
