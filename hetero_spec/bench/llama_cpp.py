"""llama.cpp systems: its target alone (`llama-completion`) and its speculative decoding
(`llama-speculative-simple`), on GGUF files, each on one thread and on every core.

`hetero-spec bench --llama-cpp BIN_DIR` turns them on (scripts/build-llama-cpp.sh builds BIN_DIR from the
llama-cpp-python sdist, which vendors llama.cpp). The GGUFs are the ones the config's models are (a `.gguf`
target.model / draft.model, or a directory holding one), or --llama-cpp-target / --llama-cpp-draft.

How a run is measured, and what differs from the other systems:
- Each run is a new process: it loads (mmaps) the model and warms it up, which no other system pays per prompt.
  So a prompt's time is llama.cpp's own clock, prefill + decode (RunOutput.prefill_s / decode_s), from its
  timing lines; the process's wall time is kept in the stats (process_wall_s).
  - llama-completion: `prompt eval time = X ms / N tokens` (the whole prompt, which yields the first new
    token) and `eval time = Y ms / M runs` (one run per further token; the last sampled token is not evaluated).
  - llama-speculative-simple: `encoded N tokens in X seconds` (target and draft prefill of all but the last
    prompt token) and `decoded M tokens in Y seconds` (every round after that); `n_drafted`, `n_accept`.
    It stops only once it has MORE than -n tokens (the last round may add a whole block): its decode time is
    scaled to the tokens compared, Y * min(M, max_new) / M (time per generated token, times max_new), and its
    output is cut at max_new.
- Prompts: llama.cpp takes text. The bench's token ids are decoded with the target's tokenizer and passed in a
  file (-f; llama.cpp drops one trailing newline of the file, so one is added). llama.cpp tokenizes that text
  again (with BOS where the GGUF says so, special-token text parsed as special tokens): its prompt may differ
  from the bench's ids by a token or so (the prompt token count it reports is in the stats, prompt_tokens).
- Outputs: the generated text (stdout) is encoded with the same tokenizer to compare with the other systems;
  on EOS the tokenizer's EOS id is appended, as ORT GenAI's outputs are. A GGUF is a different quantization of
  the model than the reference, so identity with target_only is reported, not expected; llama_cpp_spec is also
  compared with llama_cpp_target_only (identical_to_llama_cpp_target_only).
- Greedy: --temp 0 --top-k 1, seed fixed. --spec-draft-n-max is calibrated over --gammas like ORT GenAI's
  max_draft_tokens (systems.calibrate, on llama.cpp's own clock); llama.cpp's p_min stays at its default (0).
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

from .context import BENCH_SEED, BenchContext, RunOutput
from .memory import vm_hwm_mb
from .systems import System, calibrate, cores, register

COMPLETION = "llama-completion"
SPECULATIVE = "llama-speculative-simple"
BUILD_HINT = "scripts/build-llama-cpp.sh builds them"
MEMORY_POLL_S = 0.05  # how often a running tool's VmHWM is read
CTX_MARGIN = 64  # tokens of context beyond prompt + max_new: llama.cpp's tokenization may differ a little
SOURCE_STAMPS = ("hetero_spec_gguf.json", "hetero_spec_source.json")  # gguf_source.SOURCE_NAME first

_NUM = r"([0-9]+(?:\.[0-9]*)?)"
_PROMPT_EVAL = re.compile(rf"prompt eval time =\s*{_NUM} ms /\s*(\d+) tokens")
_EVAL = re.compile(rf"(?<!prompt )eval time =\s*{_NUM} ms /\s*(\d+) runs")
_ENCODED = re.compile(rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds")
_DECODED = re.compile(rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds")
# a line may carry llama.cpp's log prefix ("0.02.424.071 I n_drafted = 29"); \b...\s*= keeps n_draft from matching
# n_drafted
_SPEC_COUNTS = {key: re.compile(rf"\b{key}\s*=\s*(\d+)") for key in ("n_draft", "n_drafted", "n_accept")}


# -- timing lines ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timings:
    """One llama.cpp run, from its own clock. decoded_tokens: tokens the decode phase produced (speculative:
    all of them; completion: the runs, one token each, after the prefill's first)."""

    prompt_tokens: int
    prefill_s: float
    decoded_tokens: int
    decode_s: float
    drafted: int | None = None
    accepted: int | None = None
    n_max: int | None = None


def _last(pattern: re.Pattern, text: str, what: str) -> tuple[str, ...]:
    found = pattern.findall(text)
    if not found:
        raise ValueError(f"no {what!r} line in llama.cpp's output")
    return found[-1]


def parse_completion(stderr: str) -> Timings:
    """llama-completion's perf lines (the last ones printed: the generation's context)."""
    p_ms, p_n = _last(_PROMPT_EVAL, stderr, "prompt eval time")
    e_ms, e_n = _last(_EVAL, stderr, "eval time")
    return Timings(int(p_n), float(p_ms) / 1e3, int(e_n), float(e_ms) / 1e3)


def parse_speculative(stderr: str) -> Timings:
    """llama-speculative-simple's summary: encoded/decoded lines and the draft counts."""
    enc_n, enc_s = _last(_ENCODED, stderr, "encoded N tokens")
    dec_n, dec_s = _last(_DECODED, stderr, "decoded N tokens")
    counts = {k: int(m[-1]) if (m := p.findall(stderr)) else None for k, p in _SPEC_COUNTS.items()}
    return Timings(int(enc_n), float(enc_s), int(dec_n), float(dec_s), drafted=counts["n_drafted"],
                   accepted=counts["n_accept"], n_max=counts["n_draft"])


# -- command lines ---------------------------------------------------------------------------------
def _common_args(prompt_file: Path, max_new: int, threads: int, ctx_size: int) -> list[str]:
    return ["-f", str(prompt_file), "-n", str(max_new), "-t", str(threads), "-tb", str(threads),
            "-c", str(ctx_size), "--temp", "0", "--top-k", "1", "-s", str(BENCH_SEED)]


def completion_args(bin_dir: Path, model: Path, prompt_file: Path, max_new: int, threads: int,
                    ctx_size: int) -> list[str]:
    """llama-completion, greedy, plain text completion: -no-cnv (no chat template, no interactive turn),
    --no-display-prompt (stdout is the generated text only)."""
    return [str(Path(bin_dir) / COMPLETION), "-m", str(model), *_common_args(prompt_file, max_new, threads, ctx_size),
            "-no-cnv", "--no-display-prompt"]


def speculative_args(bin_dir: Path, target: Path, draft: Path, prompt_file: Path, max_new: int, threads: int,
                     n_max: int, ctx_size: int) -> list[str]:
    """llama-speculative-simple with the draft model: --spec-type draft-simple (without it, it does not
    speculate), --spec-draft-n-max n_max; the draft on the same threads as the target (they take turns)."""
    return [str(Path(bin_dir) / SPECULATIVE), "-m", str(target), "-md", str(draft),
            "--spec-type", "draft-simple", "--spec-draft-n-max", str(n_max),
            *_common_args(prompt_file, max_new, threads, ctx_size), "-td", str(threads), "-tbd", str(threads)]


# -- GGUF files ------------------------------------------------------------------------------------
def gguf_of(model: Path | None) -> Path | None:
    """The GGUF a model came from: the path itself when it is a .gguf file; in a directory, its only .gguf, or
    the .gguf a source stamp names (gguf_source.py's conversions carry hetero_spec_gguf.json {"gguf": path})."""
    if model is None:
        return None
    model = Path(model)
    if model.is_file():
        return model if model.suffix == ".gguf" else None
    if not model.is_dir():
        return None
    found = sorted(model.glob("*.gguf"))
    if len(found) == 1:
        return found[0]
    for name in SOURCE_STAMPS:
        stamp = model / name
        if not stamp.is_file():
            continue
        try:
            values = json.loads(stamp.read_text())
        except ValueError:
            continue
        for v in (values.values() if isinstance(values, dict) else ()):
            if isinstance(v, str) and v.endswith(".gguf") and Path(v).is_file():
                return Path(v)
    return None


def target_gguf(ctx: BenchContext) -> Path | None:
    return Path(ctx.llama_cpp_target) if ctx.llama_cpp_target else gguf_of(ctx.config.target.model)


def draft_gguf(ctx: BenchContext) -> Path | None:
    if ctx.llama_cpp_draft:
        return Path(ctx.llama_cpp_draft)
    d = ctx.config.draft
    return gguf_of(d.model) if d.kind != "none" and getattr(d, "model", None) else None


def _missing(ctx: BenchContext, binary: str) -> str | None:
    if ctx.llama_cpp is None:
        return f"no --llama-cpp BIN_DIR (the folder with {COMPLETION} and {SPECULATIVE}; {BUILD_HINT})"
    path = Path(ctx.llama_cpp) / binary
    if not path.is_file():
        return f"{path} not found (--llama-cpp names the folder with llama.cpp's binaries; {BUILD_HINT})"
    gguf = target_gguf(ctx)
    if gguf is None:
        return (f"no GGUF of the target: target.model {ctx.config.target.model} is not a .gguf "
                "(pass --llama-cpp-target FILE.gguf)")
    if not gguf.is_file():
        return f"the target GGUF {gguf} does not exist"
    return None


# -- text in, text out -----------------------------------------------------------------------------
def generated_text(stdout: str, prompt_text: str | None) -> tuple[str, bool]:
    """(the generated text, stopped on EOS) from a tool's stdout.

    llama-completion with --no-display-prompt prints the new text, then ` [end of text]\\n` on EOS, then
    `\\n\\n`. llama-speculative-simple prints `\\n\\n`, the prompt's pieces (BOS's too, if any), the new text,
    then `\\n\\n` and `\\n\\n`; prompt_text locates the prompt's end (its pieces spell the text again).
    """
    text = stdout
    if prompt_text is not None:
        at = text.find(prompt_text)
        if at < 0:
            raise ValueError("the prompt's echo is not in llama-speculative-simple's output (its tokens spell a "
                             "different text)")
        text = text[at + len(prompt_text):]
        text = text[:-4] if text.endswith("\n\n\n\n") else text
        return text, False  # EOS shows in the token count instead (LlamaCppSpec._run_k)
    text = text[:-2] if text.endswith("\n\n") else text
    eos = text.endswith(" [end of text]\n")
    return (text[:-len(" [end of text]\n")] if eos else text), eos


class _LlamaCpp(System):
    """One llama.cpp tool run per prompt, in a fresh process; the system times itself (RunOutput.prefill_s
    and decode_s, from llama.cpp's own clock)."""

    all_cores = False
    peer_reference = "llama_cpp_target_only"

    @property
    def threads(self) -> int:
        return cores() if self.all_cores else 1

    def setup(self, ctx: BenchContext) -> None:
        self.bin_dir, self.target = Path(ctx.llama_cpp), target_gguf(ctx)
        self.tok = ctx.tokenizer()
        eos = self.tok.eos_token_id
        self.eos_id = eos if isinstance(eos, int) else None
        self._dir = tempfile.TemporaryDirectory(prefix="hetero-spec-llama-cpp-")
        self.peak_rss_mb: float | None = None

    def _prompt_file(self, prompt_ids: list[int]) -> tuple[Path, str]:
        text = self.tok.decode(prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        path = Path(self._dir.name) / "prompt.txt"
        path.write_bytes((text + "\n").encode("utf-8"))  # -f drops one trailing newline: keep the prompt's own
        return path, text

    def _ctx_size(self, prompt_ids: list[int], max_new: int) -> int:
        return len(prompt_ids) + max_new + CTX_MARGIN

    def _exec(self, args: list[str]) -> tuple[str, str, float]:
        """Run one tool to its end: (stdout, stderr, wall seconds). Its RSS high-water mark is polled while it
        runs (memory.vm_hwm_mb) into self.peak_rss_mb."""
        t = time.perf_counter()
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        while True:
            hwm = vm_hwm_mb(proc.pid)
            if hwm is not None:
                self.peak_rss_mb = max(self.peak_rss_mb or 0.0, hwm)
            try:
                raw_out, raw_err = proc.communicate(timeout=MEMORY_POLL_S)
                break
            except subprocess.TimeoutExpired:
                continue  # no output is lost: communicate() picks up where it was
        wall = time.perf_counter() - t
        out, err = raw_out.decode("utf-8", "replace"), raw_err.decode("utf-8", "replace")
        if proc.returncode != 0:
            tail = " | ".join(err.strip().splitlines()[-5:])
            raise RuntimeError(f"{Path(args[0]).name} exited with {proc.returncode}: {tail}")
        return out, err, wall

    def _ids(self, text: str, eos: bool, max_new: int) -> list[int]:
        """The generated text in the target tokenizer's ids, cut at max_new; on EOS the tokenizer's EOS id is
        appended (which of the model's stop tokens llama.cpp met is not printed)."""
        ids = [int(t) for t in self.tok.encode(text, add_special_tokens=False)][:max_new]
        if eos and self.eos_id is not None and len(ids) < max_new:
            ids.append(self.eos_id)
        return ids

    def extra(self) -> dict[str, Any]:
        return {"peak_rss_mb": self.peak_rss_mb}  # the largest of its processes (polled VmHWM)

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        return {"backend": "llama.cpp", "layout": "in_process", "target_threads": self.threads,
                "draft_threads": None, "target_gguf": str(self.target),
                "timing": "llama.cpp's own clock (prefill + decode), not the process's start, load or warm-up"}

    def close(self) -> None:
        if getattr(self, "_dir", None) is not None:
            self._dir.cleanup()
            self._dir = None


@register
class LlamaCppTargetOnly(_LlamaCpp):
    """llama.cpp's target alone: `llama-completion`, greedy, one thread."""

    name = "llama_cpp_target_only"

    @staticmethod
    def unavailable(ctx: BenchContext) -> str | None:
        return _missing(ctx, COMPLETION)

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        path, _ = self._prompt_file(prompt_ids)
        out, err, wall = self._exec(completion_args(self.bin_dir, self.target, path, max_new, self.threads,
                                                    self._ctx_size(prompt_ids, max_new)))
        t = parse_completion(err)
        text, eos = generated_text(out, None)
        stats = {"prompt_tokens": t.prompt_tokens, "prefill_s": t.prefill_s, "decode_s": t.decode_s,
                 "decode_runs": t.decoded_tokens, "process_wall_s": round(wall, 4), "eos": eos}
        return RunOutput(self._ids(text, eos, max_new), stats, prefill_s=t.prefill_s, decode_s=t.decode_s)


@register
class LlamaCppTargetOnlyAllCores(LlamaCppTargetOnly):
    """llama.cpp's target alone on every core."""

    name = "llama_cpp_target_only_all_cores"
    all_cores = True


@register
class LlamaCppSpec(_LlamaCpp):
    """llama.cpp's speculative decoding: `llama-speculative-simple --spec-type draft-simple` with the draft's
    GGUF, drafting and verifying in turn on one thread; --spec-draft-n-max calibrated over --gammas."""

    name = "llama_cpp_spec"
    acceptance_keys = ("accepted", "drafted")

    @staticmethod
    def unavailable(ctx: BenchContext) -> str | None:
        if reason := _missing(ctx, SPECULATIVE):
            return reason
        draft = draft_gguf(ctx)
        if draft is None:
            return "no GGUF of the draft: draft.model is not a .gguf (pass --llama-cpp-draft FILE.gguf)"
        if not draft.is_file():
            return f"the draft GGUF {draft} does not exist"
        return None

    def setup(self, ctx: BenchContext) -> None:
        super().setup(ctx)
        self.draft = draft_gguf(ctx)
        self.calibration: dict[int, float] | None = None
        self.gamma = ctx.gamma
        if ctx.gammas:
            self.gamma, self.calibration = calibrate(self._run_k, ctx.gammas, ctx.calibration_prompts, ctx.max_new)

    def _run_k(self, k: int, prompt_ids: list[int], max_new: int) -> RunOutput:
        path, text = self._prompt_file(prompt_ids)
        out, err, wall = self._exec(speculative_args(self.bin_dir, self.target, self.draft, path, max_new,
                                                     self.threads, k, self._ctx_size(prompt_ids, max_new)))
        t = parse_speculative(err)
        gen, _ = generated_text(out, text)
        # it stops past max_new unless it met EOS (whose piece it does not print): fewer tokens means EOS
        eos = t.decoded_tokens <= max_new
        ids = self._ids(gen, eos, max_new)
        counted = min(t.decoded_tokens, max_new)
        decode_s = t.decode_s * counted / t.decoded_tokens if t.decoded_tokens else t.decode_s
        stats = {"prompt_tokens": t.prompt_tokens, "prefill_s": t.prefill_s, "decode_s_reported": t.decode_s,
                 "decoded_tokens": t.decoded_tokens, "counted_tokens": counted, "decode_s": decode_s,
                 "drafted": t.drafted, "accepted": t.accepted, "n_max": t.n_max, "process_wall_s": round(wall, 4),
                 "eos": eos}
        return RunOutput(ids, stats, prefill_s=t.prefill_s, decode_s=decode_s)

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        return self._run_k(self.gamma, prompt_ids, max_new)

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        return {**super().describe(ctx), "layout": "in_process (draft and verify in turn)",
                "draft_threads": self.threads, "draft_gguf": str(self.draft)}

    def extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {**super().extra(), "gamma": self.gamma}
        if self.calibration:
            out["calibration_s"] = {str(k): round(v, 4) for k, v in self.calibration.items()}
        return out


@register
class LlamaCppSpecAllCores(LlamaCppSpec):
    """llama.cpp's speculative decoding with every core for both models."""

    name = "llama_cpp_spec_all_cores"
    all_cores = True
