"""llama.cpp's target alone (`llama-completion`) and its speculative decoding (`llama-speculative-simple
--spec-type draft-simple`) on GGUF files: the config's models where they are GGUFs, or --llama-cpp-target /
--llama-cpp-draft. `--llama-cpp BIN_DIR` turns them on (scripts/build-llama-cpp.sh builds it).

- Each run is a new process that loads the model, which no other system pays per prompt: a prompt's time is
  llama.cpp's own clock, prefill + decode, from its timing lines (the process's wall time is in the stats).
  llama-speculative-simple stops only past -n (a last round may add a block): its decode time is scaled to the
  tokens compared, time per token x min(decoded, max_new), and its output cut at max_new.
- Prompts go in as text (the bench's ids decoded with the target's tokenizer, through -f) and outputs come
  back as text, encoded with that tokenizer (on EOS its EOS id appended): counts may differ by a token. A GGUF
  is another quantization than the reference, so llama_cpp_spec is also compared with llama_cpp_target_only.
- Greedy (--temp 0 --top-k 1, fixed seed). Threads (one, every core) are calibrated, and the speculative one's
  --spec-draft-n-max over --gammas, on llama.cpp's own clock.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .harness import SEED, BenchContext, RunOutput, System, calibrate, register, thread_options
from .memory import status_mb

COMPLETION, SPECULATIVE = "llama-completion", "llama-speculative-simple"
BUILD_HINT = "scripts/build-llama-cpp.sh builds them"
CTX_MARGIN = 64  # context beyond prompt + max_new: llama.cpp's tokenization may differ a little
_NUM = r"([0-9]+(?:\.[0-9]*)?)"
_PROMPT_EVAL = re.compile(rf"prompt eval time =\s*{_NUM} ms /\s*(\d+) tokens")
_EVAL = re.compile(rf"(?<!prompt )eval time =\s*{_NUM} ms /\s*(\d+) runs")
_ENCODED = re.compile(rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds")
_DECODED = re.compile(rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds")
# lines may carry llama.cpp's log prefix ("0.02.424.071 I n_drafted = 29"); \b...\s*= keeps n_draft off n_drafted
_COUNTS = {key: re.compile(rf"\b{key}\s*=\s*(\d+)") for key in ("n_draft", "n_drafted", "n_accept")}


@dataclass(frozen=True)
class Timings:
    """One run by llama.cpp's own clock; decoded_tokens: what the decode phase produced."""

    prompt_tokens: int
    prefill_s: float
    decoded_tokens: int
    decode_s: float
    drafted: int | None = None
    accepted: int | None = None
    n_max: int | None = None


def _last(pattern: re.Pattern, text: str, what: str) -> tuple[str, ...]:
    if not (found := pattern.findall(text)):
        raise ValueError(f"no {what!r} line in llama.cpp's output")
    return found[-1]


def parse_completion(stderr: str) -> Timings:
    """llama-completion's perf lines: the prompt's eval (which yields the first token), then one run per token."""
    p_ms, p_n = _last(_PROMPT_EVAL, stderr, "prompt eval time")
    e_ms, e_n = _last(_EVAL, stderr, "eval time")
    return Timings(int(p_n), float(p_ms) / 1e3, int(e_n), float(e_ms) / 1e3)


def parse_speculative(stderr: str) -> Timings:
    """llama-speculative-simple's summary: the encoded / decoded lines and the draft counts."""
    enc_n, enc_s = _last(_ENCODED, stderr, "encoded N tokens")
    dec_n, dec_s = _last(_DECODED, stderr, "decoded N tokens")
    c = {k: int(m[-1]) if (m := p.findall(stderr)) else None for k, p in _COUNTS.items()}
    return Timings(int(enc_n), float(enc_s), int(dec_n), float(dec_s), c["n_drafted"], c["n_accept"], c["n_draft"])


def _common(prompt_file: Path, max_new: int, threads: int, ctx_size: int) -> list[str]:
    return ["-f", str(prompt_file), "-n", str(max_new), "-t", str(threads), "-tb", str(threads),
            "-c", str(ctx_size), "--temp", "0", "--top-k", "1", "-s", str(SEED)]


def completion_args(bin_dir: Path, model: Path, prompt_file: Path, max_new: int, threads: int,
                    ctx_size: int) -> list[str]:
    """Plain text completion: -no-cnv (no chat template), --no-display-prompt (stdout: the new text only)."""
    return [str(Path(bin_dir) / COMPLETION), "-m", str(model), *_common(prompt_file, max_new, threads, ctx_size),
            "-no-cnv", "--no-display-prompt"]


def speculative_args(bin_dir: Path, target: Path, draft: Path, prompt_file: Path, max_new: int, threads: int,
                     n_max: int, ctx_size: int) -> list[str]:
    """Speculation with the draft model (--spec-type draft-simple: without it, it does not speculate), the draft
    on the target's threads (they take turns)."""
    return [str(Path(bin_dir) / SPECULATIVE), "-m", str(target), "-md", str(draft), "--spec-type", "draft-simple",
            "--spec-draft-n-max", str(n_max), *_common(prompt_file, max_new, threads, ctx_size),
            "-td", str(threads), "-tbd", str(threads)]


def gguf_of(model: Path | None) -> Path | None:
    """The GGUF a model is: a .gguf file; a directory's only .gguf; or the .gguf its source stamp names
    (gguf_source.py's conversions carry hetero_spec_gguf.json)."""
    model = Path(model) if model is not None else None
    if model is None or not model.exists():
        return None
    if model.is_file():
        return model if model.suffix == ".gguf" else None
    if len(found := sorted(model.glob("*.gguf"))) == 1:
        return found[0]
    for stamp in (model / "hetero_spec_gguf.json", model / "hetero_spec_source.json"):
        try:
            values = json.loads(stamp.read_text()) if stamp.is_file() else {}
        except ValueError:
            continue
        for v in (values.values() if isinstance(values, dict) else ()):
            if isinstance(v, str) and v.endswith(".gguf") and Path(v).is_file():
                return Path(v)
    return None


def generated_text(stdout: str, prompt_text: str | None) -> tuple[str, bool]:
    """(the new text, stopped on EOS) from a tool's stdout. llama-completion prints the new text, ` [end of
    text]\\n` on EOS, then `\\n\\n`; llama-speculative-simple prints `\\n\\n`, the prompt's pieces, the new text,
    then `\\n\\n\\n\\n` (prompt_text: where the prompt's echo ends; its EOS shows in the counts instead)."""
    if prompt_text is not None:
        if (at := stdout.find(prompt_text)) < 0:
            raise ValueError("the prompt's echo is not in llama-speculative-simple's output")
        text = stdout[at + len(prompt_text):]
        return (text[:-4] if text.endswith("\n\n\n\n") else text), False
    text = stdout[:-2] if stdout.endswith("\n\n") else stdout
    eos = text.endswith(" [end of text]\n")
    return (text[:-len(" [end of text]\n")] if eos else text), eos


@register
class LlamaCppTargetOnly(System):
    """llama.cpp's target alone (llama-completion), greedy, its threads calibrated; needs --llama-cpp."""

    name, speculative, peer_reference, tool = "llama_cpp_target_only", False, "llama_cpp_target_only", COMPLETION

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        if ctx.llama_cpp is None:
            return f"no --llama-cpp BIN_DIR (the folder with {COMPLETION} and {SPECULATIVE}; {BUILD_HINT})"
        if not (path := Path(ctx.llama_cpp) / cls.tool).is_file():
            return f"{path} not found (--llama-cpp names the folder with llama.cpp's binaries; {BUILD_HINT})"
        if ctx.llama_cpp_target is None:
            return (f"no GGUF of the target: target.model {ctx.config.target.model} is not a .gguf "
                    "(pass --llama-cpp-target FILE.gguf)")
        return None if Path(ctx.llama_cpp_target).is_file() else f"the GGUF {ctx.llama_cpp_target} does not exist"

    def setup(self, ctx: BenchContext) -> None:
        self.bin, self.target, self.draft = Path(ctx.llama_cpp), Path(ctx.llama_cpp_target), ctx.llama_cpp_draft
        self.tok, self.peak_rss_mb = ctx.tokenizer(), None
        self.eos_id = self.tok.eos_token_id if isinstance(self.tok.eos_token_id, int) else None
        self._dir = tempfile.TemporaryDirectory(prefix="hetero-spec-llama-cpp-")
        grid = [(t, g) for t in thread_options() for g in ((ctx.gammas or (ctx.gamma,)) if self.speculative else (None,))]
        self.setting = grid[0]
        if len(grid) > 1:
            self.setting, self.calibration = calibrate(self._run, grid, ctx.calibration_prompts, ctx.max_new)

    def _exec(self, args: list[str]) -> tuple[str, str, float]:
        """Run a tool to its end: (stdout, stderr, wall seconds); its peak RSS is polled meanwhile."""
        t = time.perf_counter()
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        while True:
            if (hwm := status_mb(proc.pid)) is not None:
                self.peak_rss_mb = max(self.peak_rss_mb or 0.0, hwm)
            try:
                raw_out, raw_err = proc.communicate(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                continue  # communicate() picks up where it was: no output is lost
        out, err = raw_out.decode("utf-8", "replace"), raw_err.decode("utf-8", "replace")
        if proc.returncode != 0:
            raise RuntimeError(f"{Path(args[0]).name} exited with {proc.returncode}: "
                               + " | ".join(err.strip().splitlines()[-5:]))
        return out, err, time.perf_counter() - t

    def _run(self, setting: tuple[int, int], prompt_ids: list[int], max_new: int) -> RunOutput:
        (threads, k), path = setting, Path(self._dir.name) / "prompt.txt"
        text = self.tok.decode(prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        path.write_bytes((text + "\n").encode("utf-8"))  # -f drops one trailing newline: keep the prompt's own
        n_ctx = len(prompt_ids) + max_new + CTX_MARGIN
        if not k:
            out, err, wall = self._exec(completion_args(self.bin, self.target, path, max_new, threads, n_ctx))
            t, (gen, eos) = parse_completion(err), generated_text(out, None)
            decode_s, counted = t.decode_s, t.decoded_tokens
        else:
            out, err, wall = self._exec(speculative_args(self.bin, self.target, self.draft, path, max_new, threads,
                                                         k, n_ctx))
            t, (gen, _) = parse_speculative(err), generated_text(out, text)
            eos, counted = t.decoded_tokens <= max_new, min(t.decoded_tokens, max_new)  # fewer: it met EOS
            decode_s = t.decode_s * counted / t.decoded_tokens if t.decoded_tokens else t.decode_s
        ids = [int(i) for i in self.tok.encode(gen, add_special_tokens=False)][:max_new]
        if eos and self.eos_id is not None and len(ids) < max_new:
            ids.append(self.eos_id)
        stats = {"prompt_tokens": t.prompt_tokens, "prefill_s": t.prefill_s, "decode_s": decode_s,
                 "decoded_tokens": t.decoded_tokens, "counted_tokens": counted, "process_wall_s": round(wall, 4),
                 "eos": eos, **({"drafted": t.drafted, "accepted": t.accepted, "n_max": t.n_max} if k else {})}
        return RunOutput(ids, stats, prefill_s=t.prefill_s, decode_s=decode_s)

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        return self._run(self.setting, prompt_ids, max_new)

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        t, k = self.setting
        return {"backend": "llama.cpp", "layout": "in_process" + (" (draft and verify in turn)" if k else ""),
                "target_threads": t, "draft_threads": t if k else None, "gamma": k or None,
                "target_gguf": str(self.target), "draft_gguf": str(self.draft) if k else None,
                "peak_rss_mb": self.peak_rss_mb, "timing": "llama.cpp's own clock (prefill + decode)"}

    def close(self) -> None:
        if getattr(self, "_dir", None) is not None:
            self._dir.cleanup()
            self._dir = None


@register
class LlamaCppSpec(LlamaCppTargetOnly):
    """llama.cpp's speculative decoding (llama-speculative-simple) with the draft's GGUF: --spec-draft-n-max
    over --gammas and its threads calibrated; needs --llama-cpp."""

    name, speculative, tool = "llama_cpp_spec", True, SPECULATIVE

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        if reason := super().unavailable(ctx):
            return reason
        if ctx.llama_cpp_draft is None:
            return "no GGUF of the draft: draft.model is not a .gguf (pass --llama-cpp-draft FILE.gguf)"
        return None if Path(ctx.llama_cpp_draft).is_file() else f"the GGUF {ctx.llama_cpp_draft} does not exist"
