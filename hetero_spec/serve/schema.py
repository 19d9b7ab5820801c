"""The OpenAI-compatible request schema (the subset hetero_spec serves), its error body, stop strings, and chat
templates. Strict, as OpenAI's API is: an unknown field, a number sent as a string, NaN or an unsupported option is
a 400 naming it, never silently ignored or coerced (docs/serving.md lists what is accepted)."""

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP = 4  # OpenAI's limit on stop strings


class ApiError(Exception):
    """An error answered with OpenAI's error body and an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code, self.headers = status, param, kind, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error body: every error of /v1/ has it."""

    error: ErrorDetail


class _Strict(BaseModel):
    """Every request model: unknown fields refused, no coercion ("5" is not 5), no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None  # vLLM's extension: decode to max_tokens past EOS
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # accepted and not acted on (docs/serving.md): they change nothing in the output
    user: str | None = None

    def _refused(self) -> list[tuple[str, bool, str]]:
        """(parameter, whether this request sets it, why not) for each option this server does not implement."""
        stops = self.stop_strings()
        return [("n", self.n != 1, "only n = 1 is supported"),
                ("logprobs", self.logprobs not in (None, False, 0), "logprobs are not supported"),
                ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"),
                ("presence_penalty", bool(self.presence_penalty or self.frequency_penalty),
                 "presence and frequency penalties are not supported (they change the target)"),
                ("stop", len(stops) > MAX_STOP or not all(stops), f"at most {MAX_STOP} non-empty stop strings")]

    def unsupported(self) -> tuple[str, str] | None:
        """(parameter, why) for the first option this request sets that the server does not implement."""
        return next(((name, why) for name, bad, why in self._refused() if bad), None)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def _texts(self) -> bool:
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], str)

    def _refused(self) -> list[tuple[str, bool, str]]:
        return [("echo", self.echo, "echo is not supported"),
                ("best_of", self.best_of not in (None, 1), "only best_of = 1 is supported"),
                ("suffix", bool(self.suffix), "suffix (insertion) is not supported"),
                ("prompt", self._texts() and len(self.prompt) != 1,
                 "one prompt per request (a list of several prompts is not supported)"), *super()._refused()]

    def prompt_value(self) -> str | list[int]:
        return self.prompt[0] if self._texts() else self.prompt


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # accepted and not acted on: chat templates do not read it

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is supported
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # accepted and not acted on (docs/serving.md)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None

    def _refused(self) -> list[tuple[str, bool, str]]:
        fmt = (self.response_format or {}).get("type", "text")
        return [("tools", bool(self.tools or self.functions), "tools and functions are not supported"),
                ("tool_choice", self.tool_choice not in (None, "none"), "tool_choice is not supported"),
                ("function_call", self.function_call not in (None, "none"), "function_call is not supported"),
                ("top_logprobs", bool(self.top_logprobs), "logprobs are not supported"),
                ("response_format", fmt != "text", f"response_format {fmt!r} is not supported (only text)"),
                *super()._refused()]

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class StopMatcher:
    """Cuts the text at the first stop string, across piece boundaries: text that could be the start of a stop
    string is held back until the next piece shows whether it is."""

    def __init__(self, stops: list[str]):
        self.stops, self.buf, self.stopped = stops, "", False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, piece: str, final: bool = False) -> str:
        """Text safe to emit now. After a stop string, `stopped` is set and nothing more is emitted."""
        if self.stopped:
            return ""
        self.buf += piece
        if found := [i for i in map(self.buf.find, self.stops) if i >= 0]:
            out, self.buf, self.stopped = self.buf[:min(found)], "", True
            return out
        cut = len(self.buf) - (0 if final else self._tail())  # no stops: _tail() is 0
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out

    def _tail(self) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        return next((n for n in range(min(self.hold, len(self.buf)), 0, -1)
                     if any(s.startswith(self.buf[-n:]) for s in self.stops)), 0)


def chat_template(model_dir: Path | None) -> tuple[str, dict[str, str]] | None:
    """(jinja template, special tokens) from tokenizer_config.json's chat_template, else from chat_template.jinja
    beside it (where transformers 5 writes it), or None without either."""
    if model_dir is None:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # named templates: take the default
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    if not isinstance(tpl, str) or not tpl:
        try:
            tpl = (Path(model_dir) / "chat_template.jinja").read_text(encoding="utf-8")
        except OSError:
            return None
    if not tpl.strip():
        return None
    special = {name: cfg.get(name) or "" for name in ("bos_token", "eos_token")}  # a string, or an added token
    return tpl, {name: tok.get("content", "") if isinstance(tok, dict) else tok for name, tok in special.items()}


def render_chat(template: tuple[str, dict[str, str]], messages: list[ChatMessage]) -> str:
    """The prompt text of a conversation, with the generation prompt for the assistant's turn."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str):
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    tpl, special = template
    return env.from_string(tpl).render(messages=[{"role": m.role, "content": m.text()} for m in messages],
                                       add_generation_prompt=True, **special)
