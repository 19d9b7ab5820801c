"""The peers, greedy: transformers' assisted generation, ONNX Runtime GenAI and llama.cpp (target alone and own
speculation). llama.cpp runs a process per prompt on GGUF files, timed by its own clock (prefill + decode); its
speculative tool decodes past -n, so its decode time is scaled to the tokens compared and its output cut. It
reads and writes text, through the target's tokenizer (counts may differ by a token); a GGUF is another
quantization, so llama_cpp_spec is also compared with llama_cpp_target_only."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..draft.head import unpruned
from .harness import SEED, WARMUP_TOKENS, BenchContext, RunOutput, System, cores, gguf_of, tune  # noqa: F401

COMPLETION, SPECULATIVE = "llama-completion", "llama-speculative-simple"
CTX_MARGIN = 64  # llama.cpp's context beyond prompt + max_new: its tokenization may differ a little
_NUM = r"([0-9]+(?:\.[0-9]*)?)"
_PROMPT_EVAL = re.compile(rf"prompt eval time =\s*{_NUM} ms /\s*(\d+) tokens")
_EVAL = re.compile(rf"(?<!prompt )eval time =\s*{_NUM} ms /\s*(\d+) runs")
_ENCODED = re.compile(rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds")
_DECODED = re.compile(rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds")
# lines may carry llama.cpp's log prefix ("0.02.424.071 I n_drafted = 29"); \b...\s*= keeps n_draft off n_drafted;
# in the order of Timings' drafted, accepted, n_max
_COUNTS = {key: re.compile(rf"\b{key}\s*=\s*(\d+)") for key in ("n_drafted", "n_accept", "n_draft")}


class Peer(System):
    """A peer: load(ctx), then its best setting (threads, gamma) by `tune` over one thread and every core, x
    --gammas (else the config's gamma; 8 for auto) where it drafts. Subclasses set `backend` (what it runs on)."""

    def setup(self, ctx: BenchContext) -> None:
        self.ctx, gamma = ctx, ctx.config.speculation.gamma
        self.load(ctx)
        gammas = (ctx.gammas or (gamma if isinstance(gamma, int) else 8,)) if self.speculative else (None,)
        self.setting = tune(self, ctx, self._run, [(t, k) for t in dict.fromkeys((1, cores())) for k in gammas])

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        threads, gamma = self.setting
        return {"backend": self.backend, "layout": "in_process" + (" (draft and verify in turn)" if gamma else ""),
                "target_threads": threads, "draft_threads": threads if gamma else None, "gamma": gamma}


class HfAssisted(Peer):
    """transformers assisted generation on the fp32 checkpoints of the target and the draft (--draft-hf), a
    constant num_assistant_tokens calibrated. Only when named in --systems (fp32 copies of both models)."""

    name, opt_in, backend = "hf_assisted", True, "transformers (fp32)"

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        found = ctx.draft_hf is not None and (Path(ctx.draft_hf) / "config.json").is_file()
        return None if found else f"no Hugging Face draft checkpoint at {ctx.draft_hf} (pass --draft-hf DIR)"

    def load(self, ctx: BenchContext) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        self.model, self.assistant = (AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval()
                                      for m in (ctx.config.target.model, ctx.draft_hf))
        assistant = self.assistant.generation_config  # a pure constant number of drafted tokens
        assistant.num_assistant_tokens_schedule, assistant.assistant_confidence_threshold = "constant", 0.0
        defaults = self.model.generation_config
        eos = defaults.eos_token_id[0] if isinstance(defaults.eos_token_id, list) else defaults.eos_token_id
        self.pad_id = defaults.pad_token_id if defaults.pad_token_id is not None else eos or 0

    def _run(self, setting: tuple, prompt_ids: list[int], max_new: int) -> RunOutput:
        import torch
        torch.set_num_threads(setting[0])
        self.assistant.generation_config.num_assistant_tokens = setting[1]
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                      min_new_tokens=max_new if self.ctx.config.generation.ignore_eos else 0,
                                      do_sample=False, num_beams=1, assistant_model=self.assistant,
                                      pad_token_id=self.pad_id)
        return RunOutput(out[0, len(prompt_ids):].tolist())


def _place(src: Path, dst: Path, keep: Callable[[Path], bool]) -> None:
    """Hard-link (or copy) the files of folder src that `keep` accepts into dst, but for those already there."""
    dst.mkdir(parents=True, exist_ok=True)
    stamp = lambda path: (path.stat().st_size, path.stat().st_mtime_ns)  # noqa: E731
    for path in filter(keep, src.iterdir()):
        if not (placed := dst / path.name).is_file() or stamp(placed) != stamp(path):
            placed.unlink(missing_ok=True)
            try:
                os.link(path, placed)
            except OSError:
                shutil.copy2(path, placed)


class OrtGenaiTargetOnly(Peer):
    """ONNX Runtime GenAI's target alone: the target's ONNX export at target.precision (the onnx backend's, or
    --ort-target), linked into OUT/ort_models/."""

    name, speculative, backend = "ort_genai_target_only", False, "onnxruntime-genai"
    peer_reference = name

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        return "onnxruntime-genai is not installed" if importlib.util.find_spec("onnxruntime_genai") is None else None

    def load(self, ctx: BenchContext) -> None:
        import onnxruntime_genai
        from ..target.backends import precision_of
        from ..target.export_cache import SOURCE_NAME, cached_export
        precision, self.genai, self.models = precision_of(ctx.config.target), onnxruntime_genai, {}
        self.dir = ctx.out / "ort_models" / ("target" if precision == "fp32" else f"target-{precision}")
        src = Path(ctx.ort_target) if ctx.ort_target else cached_export(ctx.config.target.model, precision)
        _place(src, self.dir, lambda f: f.is_file() and f.name != SOURCE_NAME)
        if self.speculative:  # ORT GenAI refuses model paths outside the target's folder: the draft goes inside,
            # with its whole vocabulary (unpruned): model.onnx and its external data, names kept
            _place(unpruned(ctx.config.draft.model), self.dir / "draft", lambda f: f.name.startswith("model.onnx"))
        eos = json.loads((self.dir / "genai_config.json").read_text())["model"].get("eos_token_id", [])
        self.eos = {int(e) for e in (eos if isinstance(eos, list) else [eos])}

    def _model(self, setting: tuple):
        """The model loaded with these threads, warmed up once (max_draft_tokens is set per generator)."""
        if (threads := setting[0]) not in self.models:
            overlay: dict[str, Any] = {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}
            if gamma := setting[1]:
                draft = json.loads((unpruned(self.ctx.config.draft.model) / "genai_config.json").read_text())
                block = {**draft["model"]["decoder"], "filename": "draft/model.onnx"}
                block["session_options"] = {**block.get("session_options", {}), "intra_op_num_threads": threads}
                overlay = {"model": {**overlay["model"], "draft": block}, "speculative": {"max_draft_tokens": gamma}}
            config = self.genai.Config(str(self.dir))
            config.overlay(json.dumps(overlay))
            self.models[threads] = self.genai.Model(config)
            self._run(setting, self.ctx.prompts[0], min(WARMUP_TOKENS, self.ctx.max_new))
        return self.models[threads]

    def _run(self, setting: tuple, prompt_ids: list[int], max_new: int) -> RunOutput:
        (_, gamma), model, start = setting, self._model(setting), len(prompt_ids)
        params = self.genai.GeneratorParams(model)
        min_length = start + max_new if self.ctx.config.generation.ignore_eos else 0  # EOS masked until max_length
        params.set_search_options(max_length=start + max_new, min_length=min_length, do_sample=False)
        if gamma:
            params.set_speculative_options(max_draft_tokens=gamma)  # onnxruntime-genai 0.18
        gen = self.genai.Generator(model, params)
        gen.append_tokens(prompt_ids)
        while not gen.is_done() and gen.token_count() - start < max_new:
            gen.generate_next_token()
        ids = [int(t) for t in gen.get_sequence(0)[start:start + max_new]]
        if gen.is_done() and len(ids) < max_new and (last := int(gen.get_next_tokens()[0])) in self.eos:
            ids.append(last)  # ORT GenAI drops the stop token; the others keep it
        stats = gen.get_speculative_stats() if gamma else {}
        names = {"drafted": "draft_tokens_proposed", "accepted": "draft_tokens_accepted", "rounds": "rounds",
                 "effective_k": "effective_k"}
        return RunOutput(ids, {key: stats.get(name) for key, name in names.items()} if stats else None)

    def setup(self, ctx: BenchContext) -> None:
        super().setup(ctx)
        self.models = {self.setting[0]: self.models[self.setting[0]]}  # free the others


class OrtGenaiSpec(OrtGenaiTargetOnly):
    """ONNX Runtime GenAI's speculative decoding with the config's ONNX draft (its max_draft_tokens calibrated)."""

    name, speculative = "ort_genai_spec", True

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        draft = ctx.config.draft
        if draft.kind != "onnx" or draft.model is None or not (Path(draft.model) / "genai_config.json").is_file():
            return "needs an ONNX draft exported by the model builder (draft.kind onnx, with genai_config.json)"
        return super().unavailable(ctx)


# one llama.cpp run by its own clock; decoded_tokens: what the decode phase produced
Timings = namedtuple("Timings", "prompt_tokens prefill_s decoded_tokens decode_s drafted accepted n_max",
                     defaults=(None, None, None))


def _last(pattern: re.Pattern, text: str, what: str) -> tuple[str, ...]:
    if not (found := pattern.findall(text)):
        raise ValueError(f"no {what!r} line in llama.cpp's output")
    return found[-1]


def parse_timings(stderr: str, speculative: bool) -> Timings:
    """llama-completion's perf lines (the prompt's eval, which yields the first token, then one run per token), or
    llama-speculative-simple's summary (the encoded / decoded lines and the draft counts)."""
    if not speculative:
        (p_ms, p_n), (e_ms, e_n) = _last(_PROMPT_EVAL, stderr, "prompt eval time"), _last(_EVAL, stderr, "eval time")
        return Timings(int(p_n), float(p_ms) / 1e3, int(e_n), float(e_ms) / 1e3)
    (e_n, e_s), (d_n, d_s) = _last(_ENCODED, stderr, "encoded N tokens"), _last(_DECODED, stderr, "decoded N tokens")
    counts = [int(m[-1]) if (m := pattern.findall(stderr)) else None for pattern in _COUNTS.values()]
    return Timings(int(e_n), float(e_s), int(d_n), float(d_s), *counts)


def llama_args(bin_dir: Path, target: Path, prompt_file: Path, max_new: int, threads: int, ctx_size: int,
               draft: Path | None = None, n_max: int | None = None, ignore_eos: bool = False) -> list[str]:
    """Greedy llama-completion (-no-cnv: no chat template; --no-display-prompt: stdout is the new text), or with a
    draft llama-speculative-simple (--spec-type draft-simple, else it does not draft; draft on the target's threads)."""
    common = ["-f", str(prompt_file), "-n", str(max_new), "-t", str(threads), "-tb", str(threads),
              "-c", str(ctx_size), "--temp", "0", "--top-k", "1", "-s", str(SEED)] + ["--ignore-eos"] * ignore_eos
    if draft is None:
        return [str(Path(bin_dir) / COMPLETION), "-m", str(target), *common, "-no-cnv", "--no-display-prompt"]
    return [str(Path(bin_dir) / SPECULATIVE), "-m", str(target), "-md", str(draft), "--spec-type", "draft-simple",
            "--spec-draft-n-max", str(n_max), *common, "-td", str(threads), "-tbd", str(threads)]


def generated_text(stdout: str, prompt_text: str | None) -> tuple[str, bool]:
    """(the new text, stopped on EOS) from a tool's stdout. llama-completion prints the new text, ` [end of
    text]\\n` on EOS, then `\\n\\n`; llama-speculative-simple prints `\\n\\n`, the prompt's pieces, the new text,
    then `\\n\\n\\n\\n` (prompt_text: where the prompt's echo ends; its EOS shows in the counts instead)."""
    if prompt_text is not None:
        if (echo_at := stdout.find(prompt_text)) < 0:
            raise ValueError("the prompt's echo is not in llama-speculative-simple's output")
        return stdout[echo_at + len(prompt_text):].removesuffix("\n\n\n\n"), False
    text = stdout.removesuffix("\n\n")
    return text.removesuffix(" [end of text]\n"), text.endswith(" [end of text]\n")


class LlamaCppTargetOnly(Peer):
    """llama.cpp's target alone (llama-completion) on the target's GGUF; needs --llama-cpp."""

    name, speculative, backend, tool = "llama_cpp_target_only", False, "llama.cpp", COMPLETION
    peer_reference = name

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        hint = "scripts/build-llama-cpp.sh builds them"
        if ctx.llama_cpp is None:
            return f"no --llama-cpp BIN_DIR (the folder with {COMPLETION} and {SPECULATIVE}; {hint})"
        if not (path := Path(ctx.llama_cpp) / cls.tool).is_file():
            return f"{path} not found (--llama-cpp names the folder with llama.cpp's binaries; {hint})"
        for role, gguf in (("target", ctx.llama_cpp_target), ("draft", ctx.llama_cpp_draft if cls.speculative else 0)):
            if gguf is None:
                return f"no GGUF of the {role}: {role}.model is not a .gguf (pass --llama-cpp-{role} FILE.gguf)"
            if gguf and not Path(gguf).is_file():
                return f"the GGUF {gguf} does not exist"
        return None

    def load(self, ctx: BenchContext) -> None:
        from .prompts import load_tokenizer
        self.tok, self._dir = load_tokenizer(ctx.config.target.model), tempfile.TemporaryDirectory(prefix="llama-cpp-")
        self.eos_id = self.tok.eos_token_id if isinstance(self.tok.eos_token_id, int) else None

    def _run(self, setting: tuple, prompt_ids: list[int], max_new: int) -> RunOutput:
        (threads, gamma), path, ctx = setting, Path(self._dir.name) / "prompt.txt", self.ctx
        text = self.tok.decode(prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        path.write_bytes((text + "\n").encode("utf-8"))  # -f drops one trailing newline: keep the prompt's own
        n_ctx, started = len(prompt_ids) + max_new + CTX_MARGIN, time.perf_counter()
        args = llama_args(ctx.llama_cpp, ctx.llama_cpp_target, path, max_new, threads, n_ctx,
                          ctx.llama_cpp_draft if gamma else None, gamma, ctx.config.generation.ignore_eos)
        proc = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True)
        out, err = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
        if proc.returncode != 0:
            raise RuntimeError(f"{self.tool} exited with {proc.returncode}: {' | '.join(err.splitlines()[-5:])}")
        perf, (gen, eos) = parse_timings(err, bool(gamma)), generated_text(out, text if gamma else None)
        decode_s, decoded, counted = perf.decode_s, perf.decoded_tokens, perf.decoded_tokens
        if gamma:  # it decodes past -n: its time scaled to the tokens compared
            eos, counted = decoded <= max_new, min(decoded, max_new)  # fewer: it met EOS
            decode_s = perf.decode_s * counted / decoded if decoded else perf.decode_s
        ids = [int(i) for i in self.tok.encode(gen, add_special_tokens=False)][:max_new]
        ids += [self.eos_id] if eos and self.eos_id is not None and len(ids) < max_new else []
        stats = {"prompt_tokens": perf.prompt_tokens, "prefill_s": perf.prefill_s, "decode_s": decode_s,
                 "decoded_tokens": decoded, "counted_tokens": counted, "eos": eos,
                 "process_wall_s": round(time.perf_counter() - started, 4),
                 **({"drafted": perf.drafted, "accepted": perf.accepted, "n_max": perf.n_max} if gamma else {})}
        return RunOutput(ids, stats, own_wall_s=perf.prefill_s + decode_s)

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        return {**super().describe(ctx), "target_gguf": str(ctx.llama_cpp_target), "timing": "llama.cpp's own clock",
                **({"draft_gguf": str(ctx.llama_cpp_draft)} if self.speculative else {})}

    def close(self) -> None:
        self._dir.cleanup()


class LlamaCppSpec(LlamaCppTargetOnly):
    """llama.cpp's speculative decoding (llama-speculative-simple --spec-type draft-simple) with the draft's
    GGUF, its --spec-draft-n-max calibrated; needs --llama-cpp."""

    name, speculative, tool = "llama_cpp_spec", True, SPECULATIVE
