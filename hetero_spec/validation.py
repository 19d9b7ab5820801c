"""Checks of user input shared by the faces (CLI) and the engine: prompt text and per-request arguments, the
latter by the config's own pydantic fields, so `--temperature`, `Engine.generate(temperature=...)` and
`generation.temperature` accept exactly the same values (a bound is written once, in config.py)."""

import operator
from typing import Any

from pydantic import BaseModel, ValidationError

from .config import Config
from .errors import RequestError

# pydantic error type -> a short phrase; the others keep pydantic's message.
_PROBLEMS = {"greater_than_equal": "must be >= {ge}", "greater_than": "must be > {gt}",
             "less_than_equal": "must be <= {le}", "less_than": "must be < {lt}",
             "finite_number": "must be a finite number"}


def _problem(err: dict[str, Any]) -> str:
    if (template := _PROBLEMS.get(err["type"])) is None:
        return err["msg"].removeprefix("Value error, ")
    return template.format(**{k: _bound(v) for k, v in err.get("ctx", {}).items()})


def _bound(value: Any) -> Any:
    """2**64 rather than 18446744073709551616."""
    if isinstance(value, int) and value > 1 << 32 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return value


def check_field(section: BaseModel, name: str, value: Any, label: str) -> Any:
    """value validated as the config field `name` of `section` (same type and bounds); RequestError naming
    the argument (label) and the value otherwise."""
    probe = section.model_copy()  # sections validate on assignment; the config itself is untouched
    try:
        setattr(probe, name, value)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = label + "".join(f"[{p}]" for p in err["loc"][1:])  # stop_token_ids[2]
        shown = value if where == label else err.get("input")
        raise RequestError(f"{where} = {shown!r}: {_problem(err)}") from None
    return getattr(probe, name)


REQUEST_ARGS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos", "gamma")


def request_args(config: Config, *, flags: bool = False, **args: Any) -> dict[str, Any]:
    """Every per-request argument (REQUEST_ARGS), each validated like the config field it stands for. Unset, or
    None (and only None), takes the config's value. flags: name them as command-line options (--max-new-tokens)
    in errors. An unknown name is a TypeError, as for any call."""
    if unknown := sorted(set(args) - set(REQUEST_ARGS)):
        raise TypeError(f"unexpected keyword arguments: {', '.join(unknown)}")
    out = {}
    for name in REQUEST_ARGS:
        section, value = config.speculation if name == "gamma" else config.generation, args.get(name)
        label = "--" + name.replace("_", "-") if flags else name
        out[name] = getattr(section, name) if value is None else check_field(section, name, value, label)
    return out


def check_stop_ids(ids: list[int], vocab_size: int, name: str = "stop_token_ids") -> None:
    """Stop ids must be ids the target can emit: [0, vocab_size)."""
    if bad := [t for t in ids if not 0 <= t < vocab_size]:
        raise RequestError(f"{name} = {ids!r}: {bad[:5]} outside the target's vocabulary [0, {vocab_size})")


def check_prompt_text(text: str, source: str = "prompt") -> str:
    """text unchanged when it is valid Unicode (encodable as UTF-8); otherwise a RequestError naming the
    byte offset. Undecodable bytes of argv arrive as lone surrogates U+DC80..U+DCFF (Python's
    surrogateescape): those are reported as the original byte."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as exc:
        bad_at = exc.start
    offset = len(text[:bad_at].encode("utf-8"))  # everything before the first bad character encodes
    code = ord(text[bad_at])
    if 0xDC80 <= code <= 0xDCFF:
        raise RequestError(f"{source}: not valid UTF-8: byte 0x{code - 0xDC00:02x} at byte offset {offset}; "
                           "the prompt must be UTF-8 text")
    raise RequestError(f"{source}: lone surrogate U+{code:04X} at character {bad_at} (byte offset {offset}) "
                       "is not valid Unicode text")


def prompt_token_ids(prompt: str | list[int], tokenizer: Any, vocab_size: int, model_dir: Any) -> list[int]:
    """A prompt as token ids: text (valid Unicode) through the target's tokenizer, or ids checked against
    the target's vocabulary [0, vocab_size). Never empty."""
    if isinstance(prompt, str):
        check_prompt_text(prompt)
        if tokenizer is None:
            raise RequestError(f"the target directory {model_dir} has no tokenizer; "
                               "pass the prompt as a list of token ids")
        ids = list(tokenizer.encode(prompt))
    else:
        try:
            ids = [operator.index(t) for t in prompt]
        except TypeError:
            raise RequestError(f"prompt = {prompt!r:.200}: must be text or a list of int token ids") from None
        if bad := [t for t in ids if not 0 <= t < vocab_size]:
            raise RequestError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if not ids:
        raise RequestError(f"prompt = {prompt!r}: the prompt is empty (no tokens); give at least one")
    return ids
