"""GPU check: proves the CUDA paths (torch target on CUDA against a CPU reference, CPU ONNX draft in process and in
its own process, pinned staging, batching, stored KV caches, bf16, ONNX Runtime's CUDA EP) in one offline call, and
prints a table.

Run it through scripts/gpu_check.sh, which installs the carried wheels (scripts/gpu_wheels.sh) first. Each section
runs in its own try/except; each row is printed and flushed as soon as it is made, and the table is rewritten to
$OUT/gpu_check.md (and .json) after every row, so one failure never loses the rest. The whole run keeps to
--budget-s (default 180 s); a section that would start past it is a FAIL that says so.

--rehearse runs the same sections on a machine without CUDA: the CUDA-only sections are reported as skipped and
every other one runs for real on the CPU (the torch target on device cpu). --device-stack is the same rehearsal on
a venv of the GPU machine's own packages with the carried wheels (make gpu-rehearse-device). --quick is the short
form CI runs.

Models: the demo target (models/target, a Hugging Face checkpoint) and the demo draft's int4 ONNX export
(.gpu/draft-onnx-int4 from scripts/gpu_wheels.sh, else the cached export, made here on first use), unless
--target/--draft name others. Exit status: 0 when no row failed, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python scripts/gpu_check.py` puts scripts/ on the path, not the repository
    sys.path.insert(0, str(ROOT))

PASS, FAIL, SKIP, INFO, TIE = "PASS", "FAIL", "skip", "info", "near-tie"
#: a greedy divergence where the target's own top-2 logits are this close is a near-tie: a one-token pass and a
#: block pass may use different kernels on CUDA, which round differently (reported, not failed)
TIE_MARGIN = 1e-3
#: at most this many seconds for one batched request (a hung shared pass is a FAIL row, not a hung call)
BATCH_WAIT_S = 60
SEEDS = (2, 4, 7)  # seeded coupled sampling, one request each (on the demo pair, seed 7 stops at EOS early)
PROMPT_TEXT = "def read_config(path):\n    with open(path) as f:\n"

Add = Callable[..., None]


class Table:
    """The rows so far: printed and flushed one by one, and rewritten to OUT (markdown and JSON) after each."""

    def __init__(self, out_dir: Path | None, budget_s: float, clock: Callable[[], float] = time.monotonic,
                 stream=None):
        self.rows: list[dict[str, str]] = []
        self.out_dir, self.budget_s, self.clock = out_dir, budget_s, clock
        self.t0 = clock()
        self.stream = stream or sys.stdout
        self.header: list[str] = []
        print("| section | check | result | detail |\n|---|---|---|---|", file=self.stream, flush=True)

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def add(self, section: str, check: str, result: str, detail: str = "") -> None:
        detail = " ".join(str(detail).split())[:400]
        row = {"section": section, "check": check, "result": result, "detail": detail,
               "at_s": f"{self.elapsed():.1f}"}
        self.rows.append(row)
        print(f"| {section} | {check} | {result} | {detail} |", file=self.stream, flush=True)
        self.write()

    def failed(self) -> list[dict[str, str]]:
        return [r for r in self.rows if r["result"] == FAIL]

    def markdown(self) -> str:
        lines = [*self.header, "", "| section | check | result | detail |", "|---|---|---|---|"]
        lines += [f"| {r['section']} | {r['check']} | {r['result']} | {r['detail']} |" for r in self.rows]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, text in (("gpu_check.md", self.markdown()),
                           ("gpu_check.json", json.dumps({"header": self.header, "rows": self.rows}, indent=1))):
            tmp = self.out_dir / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(self.out_dir / name)


@dataclass
class Section:
    name: str
    run: Callable[[Context, Add], None]
    cuda_only: bool = False
    est_s: float = 10.0  # what it needs at least on a GPU machine: it does not start with less left


def run_sections(table: Table, ctx: Context, sections: list[Section]) -> None:
    """Each section in its own try/except: a failure is a row, and the next section still runs."""
    for sec in sections:
        add = lambda check, result, detail="", name=sec.name: table.add(name, check, result, detail)  # noqa: E731
        if sec.cuda_only and not ctx.cuda:
            add("-", SKIP, "needs CUDA: " + ("rehearsal on a machine without it" if ctx.rehearse else "no device"))
            continue
        if table.left() < sec.est_s:
            add("-", FAIL, f"not run: {table.left():.0f} s left of the {table.budget_s:.0f} s budget, "
                           f"it needs about {sec.est_s:.0f} s")
            continue
        try:
            sec.run(ctx, add)
        except Exception as exc:  # noqa: BLE001 - the table goes on; the traceback goes to stderr
            traceback.print_exc()
            add("raised", FAIL, f"{type(exc).__name__}: {exc}")


@dataclass
class Context:
    target: Path
    draft: Path | None
    device: str  # cuda, or cpu in a rehearsal
    rehearse: bool
    quick: bool
    tokens: int
    prompt: list[int] = field(default_factory=list)
    ref: list[int] = field(default_factory=list)  # the target alone, greedy
    ref_sampled: list[list[int]] = field(default_factory=list)  # the target alone, T 0.8, one per SEEDS
    margin_targets: dict = field(default_factory=dict)  # (device, kv cache dtype) -> a TargetModel, loaded lazily

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def cfg(self, **sections) -> dict:
        """An engine config over the check's pair: the torch target on the device, the ONNX draft on the CPU."""
        alone = sections.get("draft", {}).get("kind") == "none"  # the target alone needs no draft
        out = {"target": {"model": str(self.target), "backend": "torch", "device": self.device, "dtype": "float32",
                          "threads": 1},
               "draft": {"kind": "none"} if alone else
                        {"kind": "onnx", "model": str(self.need_draft()), "threads": 1},
               "runtime": {"mode": "in_process", "cpus": None},
               "speculation": {"gamma": 4}}
        for key, value in sections.items():
            out[key] = {**out.get(key, {}), **value}
        return out

    def need_draft(self) -> Path:
        if self.draft is None:
            raise RuntimeError("no ONNX draft: the models section could not provide one")
        return self.draft


# -- sections ------------------------------------------------------------------------------------------------
def environment(ctx: Context, add: Add) -> None:
    """Versions, and what the paths need of them: a transformers whose Llama takes `cache=`, CUDA, the imports."""
    import platform

    import torch
    import transformers

    add("python", INFO, f"{platform.python_version()} at {sys.executable}")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    add("torch", INFO, f"{torch.__version__}, CUDA {torch.version.cuda}, device {gpu}")
    if not ctx.cuda:
        add("CUDA device", SKIP if ctx.rehearse else FAIL,
            "rehearsal: the CUDA sections are skipped" if ctx.rehearse else "torch sees no CUDA device")
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    from hetero_spec.target.verifier import cache_keyword

    try:
        keyword, why = cache_keyword(LlamaForCausalLM), ""
    except TypeError as exc:
        keyword, why = None, str(exc)
    add(f"transformers {transformers.__version__}: the verifier's KV cache argument", PASS if keyword else FAIL,
        f"{keyword}=" if keyword else why)
    import msgspec
    import onnxruntime as ort
    import pydantic
    import zmq

    add("imports", PASS, f"pydantic {pydantic.VERSION}, pyzmq {zmq.__version__}, msgspec {msgspec.__version__}, "
                         f"onnxruntime {ort.__version__} ({', '.join(ort.get_available_providers())})")
    import hetero_spec

    add("hetero_spec", PASS, f"imported from {Path(hetero_spec.__file__).parent}")


def models(ctx: Context, add: Add) -> None:
    """The target checkpoint and the ONNX draft (one step under ONNX Runtime on the CPU); the prompt."""
    from tokenizers import Tokenizer

    from hetero_spec.onnx_decoder import OnnxDecoder

    if not (ctx.target / "config.json").is_file():
        raise FileNotFoundError(f"target {ctx.target}: no config.json")
    ctx.prompt = Tokenizer.from_file(str(ctx.target / "tokenizer.json")).encode(PROMPT_TEXT).ids
    add("target checkpoint", PASS, f"{ctx.target}, prompt of {len(ctx.prompt)} tokens")
    if ctx.draft is None:
        ctx.draft = _demo_draft(add)
    dec = OnnxDecoder(ctx.draft, threads=1)
    state = dec.new_state()
    logits = dec.append(state, ctx.prompt)
    add("ONNX draft, one CPU pass", PASS, f"{ctx.draft}, logits {tuple(logits.shape)}")


def _demo_draft(add: Add) -> Path:
    carried = ROOT / ".gpu" / "draft-onnx-int4"
    if (carried / "model.onnx").is_file():
        return carried
    import importlib.util

    if importlib.util.find_spec("onnxruntime_genai") is None:
        raise RuntimeError(f"no {carried} and no onnxruntime-genai builder here to export one: run "
                           "scripts/gpu_wheels.sh where the package registries are, and carry .gpu")
    from hetero_spec.target.export_cache import cached_export

    out = cached_export(ROOT / "models" / "draft", "int4", role="draft")
    add("ONNX draft export", INFO, f"{carried} absent: exported into the cache, {out}")
    return out


def staging(ctx: Context, add: Add) -> None:
    """`Staging` itself on CUDA: pinned, ordered against earlier readers, asynchronous; host-to-device copy costs."""
    import torch

    from hetero_spec.target.staging import Staging

    dev = torch.device("cuda")
    st = Staging(dev, max_tokens=16)
    add("staging buffers pinned", *judge_pinned(st.pinned, copies=None))
    # a kernel queued behind long work still reads the ids it was given, not the next block's
    big = torch.randn(8192, 8192, device=dev)
    torch.cuda.synchronize()
    first = st.tokens([1, 2, 3])
    _ = big @ big @ big
    seen = first.clone()
    st.tokens([7, 8, 9])
    add("staging copy waits for earlier readers", PASS if seen.tolist() == [[1, 2, 3]] else FAIL,
        f"read {seen.tolist()}")
    # Staging.tokens behind long GPU work: its copy is queued behind that work, so the call returns at once
    torch.cuda.synchronize()
    t = time.perf_counter()
    _ = big @ big @ big
    t_call = time.perf_counter()
    staged = st.tokens(list(range(8)))
    t_call = (time.perf_counter() - t_call) * 1e3
    torch.cuda.synchronize()
    total = (time.perf_counter() - t) * 1e3
    add("Staging.tokens returns before the GPU is done (non_blocking)",
        *judge_async(t_call, total, staged.tolist() == [list(range(8))]))
    pageable = torch.empty(4096, dtype=torch.long)
    pinned = torch.empty(4096, dtype=torch.long, pin_memory=True)
    d = torch.empty(4096, dtype=torch.long, device=dev)
    add("H2D: 8 ids staged / 32 KB pageable / 32 KB pinned (ms)", INFO,
        f"{_median_ms(lambda: st.tokens(list(range(8)))):.4f} / {_median_ms(lambda: d.copy_(pageable)):.4f} / "
        f"{_median_ms(lambda: d.copy_(pinned, non_blocking=True)):.4f}")


def judge_pinned(pinned: bool, copies: int | None) -> tuple[str, str]:
    """A staging buffer must be page-locked (else every copy is synchronous), and, for the engine's own, have been
    used: copies counts the blocks it staged."""
    if not pinned:
        return FAIL, "the host buffer is not page-locked: every copy would be synchronous"
    if copies is not None and copies <= 0:
        return FAIL, "pinned, but it staged nothing: the decode loop did not use it"
    return PASS, "page-locked" + (f", {copies} blocks staged" if copies is not None else "")


def judge_async(call_ms: float, total_ms: float, ids_ok: bool) -> tuple[str, str]:
    """Staging.tokens queued behind long GPU work: the call must return in under half of the time until the GPU is
    done (a synchronous copy would wait for that work), and the staged ids must be the ones given."""
    detail = f"call {call_ms:.3f} ms vs {total_ms:.3f} ms until the GPU finished"
    if not ids_ok:
        return FAIL, detail + "; the staged ids differ from the ones given"
    return (PASS if call_ms < total_ms / 2 else FAIL), detail


def _median_ms(fn, n: int = 30) -> float:
    import torch

    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def target_alone(ctx: Context, add: Add) -> None:
    """The references: the target alone on the device, greedy and seeded sampling."""
    from hetero_spec import Engine

    with Engine.from_config(ctx.cfg(draft={"kind": "none", "model": None})) as eng:
        eng.generate(ctx.prompt, max_new_tokens=4)  # warm-up (CUDA context, kernels)
        ref = eng.generate(ctx.prompt, max_new_tokens=ctx.tokens)
        ctx.ref = ref.token_ids
        ctx.ref_sampled = [eng.generate(ctx.prompt, max_new_tokens=ctx.tokens, temperature=0.8, seed=seed).token_ids
                           for seed in SEEDS]
    s = ref.stats
    add(f"target alone on {ctx.device}, greedy", PASS if len(ctx.ref) == ctx.tokens else FAIL,
        f"{len(ctx.ref)} tokens, prefill {1e3 * s['time_prefill_s']:.2f} ms (synced), {s['tokens_per_s']:.0f} tok/s")


def cpu_reference(ctx: Context, add: Add) -> None:
    """The device's greedy reference against the same model on the CPU (fp32 both): every other identity row
    compares the device with itself, so this is the row that catches a device that is wrong the same way twice."""
    from hetero_spec import Engine

    _need_refs(ctx)
    cfg = ctx.cfg(target={"device": "cpu"}, draft={"kind": "none", "model": None})
    with Engine.from_config(cfg) as eng:
        cpu = eng.generate(ctx.prompt, max_new_tokens=ctx.tokens).token_ids
    result, why = same_greedy(ctx, ctx.ref, cpu, ctx.prompt, device="cpu")
    note = "; rehearsal: both on the CPU" if not ctx.cuda else ""
    add(f"target alone on {ctx.device}: identical to it on the CPU", result, why + note)


def in_process(ctx: Context, add: Add) -> None:
    _speculative(ctx, add, "in_process")


def two_process(ctx: Context, add: Add) -> None:
    _speculative(ctx, add, "two_process")


def _speculative(ctx: Context, add: Add, mode: str) -> None:
    """Greedy and coupled sampling identical to the target alone, at a fixed gamma (speculation cannot turn
    itself off and match trivially) and drafts proven to have run; then where a round's time goes."""
    from hetero_spec import Engine

    _need_refs(ctx)
    runtime = {"mode": mode, "pin_cpus": mode == "two_process"}
    with Engine.from_config(ctx.cfg(runtime=runtime)) as eng:
        eng.generate(ctx.prompt, max_new_tokens=4)
        out = eng.generate(ctx.prompt, max_new_tokens=ctx.tokens, gamma=4)
        sampled = [eng.generate(ctx.prompt, max_new_tokens=ctx.tokens, gamma=4, temperature=0.8, seed=seed)
                   for seed in SEEDS]
        staged = getattr(eng.target, "staging", None)
        pinned, copies = (staged.pinned, staged.copies) if staged is not None else (False, 0)
    s = out.stats
    result, why = identity(ctx, out.token_ids, ctx.ref, s["drafted"])
    add("greedy: identical to the target alone", result,
        f"{why}; drafted {s['drafted']}, acceptance {s['acceptance_rate']:.2f}, {s['tokens_per_s']:.0f} tok/s")
    for seed, out_s, ref_s in zip(SEEDS, sampled, ctx.ref_sampled):
        result, why = identity(ctx, out_s.token_ids, ref_s, out_s.stats["drafted"], greedy=False)
        add(f"coupled sampling (T 0.8, seed {seed}): identical to the target alone", result,
            f"{why}; drafted {out_s.stats['drafted']}, acceptance {out_s.stats['acceptance_rate']:.2f}")
    if ctx.cuda:
        add("the engine's staging: pinned, and used", *judge_pinned(pinned, copies))
    else:
        add("the engine's staging: pinned, and used", SKIP, "needs CUDA: on a CPU the ids are a plain tensor")
    rounds = max(1, s["rounds"])
    add("per round: draft / wait / verify (ms); prefill (ms)", INFO,
        f"{1e3 * s['time_draft_s'] / rounds:.3f} / {1e3 * s['time_wait_s'] / rounds:.3f} / "
        f"{1e3 * s['time_verify_s'] / rounds:.3f}; {1e3 * s['time_prefill_s']:.2f}; staging copies {copies}")


def _need_refs(ctx: Context) -> None:
    if not ctx.ref:
        raise RuntimeError("no reference: the target-alone section did not finish")


def identity(ctx: Context, got: list[int], ref: list[int], drafted: int, greedy: bool = True,
             prompt: list[int] | None = None, kv: str = "auto") -> tuple[str, str]:
    """(result, why): PASS when identical and drafts ran. Greedy output goes through `same_greedy` (a divergence at
    a near-tie is TIE); sampled output must be identical."""
    if drafted <= 0:
        return FAIL, "nothing was drafted: identity would prove nothing"
    if greedy:
        return same_greedy(ctx, got, ref, prompt, kv=kv)
    if got == ref:
        return PASS, f"{len(got)} tokens identical"
    i = first_divergence(got, ref)
    return FAIL, f"first divergence at generated token {i}: reference {ref[i:i + 1]}, checked {got[i:i + 1]}"


def first_divergence(got: list[int], ref: list[int]) -> int:
    return next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))


def same_greedy(ctx: Context, got: list[int], ref: list[int], prompt: list[int] | None = None, kv: str = "auto",
                device: str | None = None) -> tuple[str, str]:
    """Greedy outputs of one model from two runs (pass shapes, devices): PASS when identical; a divergence where the
    target's own top-2 logits are within TIE_MARGIN is TIE (one-token and block passes, or two devices, may run
    kernels that round differently), anything else FAIL, including one run stopping early."""
    if got == ref:
        return PASS, f"{len(got)} tokens identical"
    prompt = ctx.prompt if prompt is None else prompt
    i = first_divergence(got, ref)
    head = f"first divergence at generated token {i}: reference {ref[i:i + 1]}, checked {got[i:i + 1]}"
    if i >= min(len(got), len(ref)):
        return FAIL, head + " (one stopped early)"
    margin = top2_margin(ctx, prompt + ref[:i], kv=kv, device=device)
    return (TIE if margin < TIE_MARGIN else FAIL), f"{head}; the target's top-2 logit margin there {margin:.2e}"


def top2_margin(ctx: Context, ids: list[int], kv: str = "auto", device: str | None = None) -> float:
    """The gap between the target's two best logits after ids: teacher-forced, fp32, by the verifier itself (with
    the same stored KV cache dtype) on the check's device unless device names another."""
    import torch

    from hetero_spec.target.verifier import TargetModel

    key = (device or ctx.device, kv)
    if key not in ctx.margin_targets:
        ctx.margin_targets[key] = TargetModel(ctx.target, device=key[0], dtype="float32", kv_cache_dtype=kv)
    target = ctx.margin_targets[key]
    state = target.new_state()
    try:
        logits = target.forward(state, ids)[-1].float()
    finally:
        target.release_state(state)
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def batched(ctx: Context, add: Add) -> None:
    """4 requests started together share passes (a batch of more than one ran), each equal to its solo run."""
    from hetero_spec import Engine

    prompts = [ctx.prompt, ctx.prompt[::-1], ctx.prompt[5:], ctx.prompt[:9] * 2]
    with Engine.from_config(ctx.cfg(serving={"max_batch": 4})) as eng:
        solo = [eng.generate(p, max_new_tokens=ctx.tokens).token_ids for p in prompts]
        eng.batch_sizes()  # drop the solo rounds
        got = together(eng, prompts, ctx.tokens)
        sizes = eng.batch_sizes()
    add("4 requests started together: a shared pass ran", PASS if sizes and max(sizes) > 1 else FAIL,
        f"largest batch {max(sizes, default=0)}, {len(sizes)} rounds")
    judged = [same_greedy(ctx, got[i], solo[i], prompts[i]) for i in range(len(prompts))]
    odd = [f"request {i}: {r} ({why})" for i, (r, why) in enumerate(judged) if r != PASS]
    add("each equals its solo run", worst(r for r, _ in judged),
        "; ".join(odd) or f"{len(judged)} of {len(judged)} identical")


def worst(results) -> str:
    """FAIL over near-tie over PASS."""
    results = list(results)
    return next((r for r in (FAIL, TIE) if r in results), PASS)


def together(eng, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Submit every prompt while the scheduler waits at its next round (its round lock is held), so they start in
    the same round; returns each one's token ids."""
    done = [threading.Event() for _ in prompts]
    ids: list[list[int]] = [[] for _ in prompts]
    errors: list[BaseException] = []

    def sink(i: int):
        def put(item):
            if isinstance(item, list):
                ids[i].extend(item)
            else:
                if isinstance(item, BaseException):
                    errors.append(item)
                done[i].set()
        return put

    with eng.lock:
        for i, p in enumerate(prompts):
            eng.submit(p, sink(i), max_new_tokens=tokens)
    for ev in done:
        if not ev.wait(BATCH_WAIT_S):
            raise TimeoutError(f"a batched request did not finish within {BATCH_WAIT_S} s")
    if errors:
        raise errors[0]
    return ids


def kv_caches(ctx: Context, add: Add) -> None:
    """Each stored KV cache against its own target alone (a stored cache changes the target's numbers)."""
    from hetero_spec import Engine

    for kv in (("int8",) if ctx.quick else ("fp8", "int8", "fp16")):
        with Engine.from_config(ctx.cfg(target={"kv_cache_dtype": kv}, draft={"kind": "none", "model": None})) as eng:
            ref = eng.generate(ctx.prompt, max_new_tokens=ctx.tokens).token_ids
        with Engine.from_config(ctx.cfg(target={"kv_cache_dtype": kv})) as eng:
            out = eng.generate(ctx.prompt, max_new_tokens=ctx.tokens, gamma=4)
        result, why = identity(ctx, out.token_ids, ref, out.stats["drafted"], kv=kv)
        add(f"KV cache {kv}: identical to its target alone", result,
            f"{why}; acceptance {out.stats['acceptance_rate']:.2f}")


def bf16(ctx: Context, add: Add) -> None:
    """A bf16 target against itself alone (identity is not promised at bf16: a difference is reported), with drafts
    proven to have run."""
    from hetero_spec import Engine

    t = {"dtype": "auto", "precision": "bf16"}
    with Engine.from_config(ctx.cfg(target=t, draft={"kind": "none", "model": None})) as eng:
        ref = eng.generate(ctx.prompt, max_new_tokens=ctx.tokens).token_ids
    with Engine.from_config(ctx.cfg(target=t)) as eng:
        out = eng.generate(ctx.prompt, max_new_tokens=ctx.tokens, gamma=4)
    same, drafted = out.token_ids == ref, out.stats["drafted"]
    if drafted <= 0:
        result, why = FAIL, "nothing was drafted: the comparison would prove nothing"
    else:
        result, why = (PASS, "same") if same else (INFO, "differs (not promised at bf16)")
    add("bf16 target: identical to its target alone", result,
        f"{why}; drafted {drafted}, acceptance {out.stats['acceptance_rate']:.2f}")


def onnx_cuda(ctx: Context, add: Add) -> None:
    """target.backend onnx on ONNX Runtime's CUDA EP, checked to be the provider in use (ORT falls back to the
    CPU silently), and speculation on it identical to its own target alone. Skipped on the lent H200's image, whose
    onnxruntime is the CPU build (onnxruntime-gpu is far too large to carry), and wherever the export builder
    (onnxruntime-genai) is missing: it runs only where both are installed."""
    import importlib.util

    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        add("-", SKIP, f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (onnxruntime-gpu is not here)")
        return
    if importlib.util.find_spec("onnxruntime_genai") is None:
        add("-", SKIP, "exporting the target needs the onnxruntime-genai builder, which is not here")
        return
    from hetero_spec import Engine

    target = {"backend": "onnx", "providers": ["CUDAExecutionProvider"]}
    with Engine.from_config(ctx.cfg(target=target, draft={"kind": "none", "model": None})) as eng:
        used = eng.target.decoder.session.get_providers()[0]
        ref = eng.generate(ctx.prompt, max_new_tokens=ctx.tokens).token_ids
    add("the provider in use", PASS if used == "CUDAExecutionProvider" else FAIL, used)
    for mode in ("in_process", "two_process"):
        with Engine.from_config(ctx.cfg(target=target, runtime={"mode": mode})) as eng:
            out = eng.generate(ctx.prompt, max_new_tokens=ctx.tokens, gamma=4)
        result, why = identity(ctx, out.token_ids, ref, out.stats["drafted"])
        add(f"{mode}: identical to its target alone", result, why)


SECTIONS = [
    Section("environment", environment, est_s=5),
    Section("models", models, est_s=20),
    Section("staging", staging, cuda_only=True, est_s=10),
    Section("target alone", target_alone, est_s=10),
    Section("CPU reference", cpu_reference, est_s=10),
    Section("in process", in_process, est_s=15),
    Section("two processes", two_process, est_s=20),
    Section("batched", batched, est_s=15),
    Section("KV caches", kv_caches, est_s=20),
    Section("bf16", bf16, cuda_only=True, est_s=10),
    Section("ONNX CUDA EP", onnx_cuda, cuda_only=True, est_s=30),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Run it through scripts/gpu_check.sh; docs/gpu-check.md has the device call.")
    ap.add_argument("--rehearse", action="store_true", help="no CUDA here: skip the CUDA sections, run the rest")
    ap.add_argument("--device-stack", action="store_true",
                    help="a rehearsal on a venv of the GPU machine's packages with the carried wheels "
                         "(scripts/gpu_check.sh --device-stack sets it up)")
    ap.add_argument("--quick", action="store_true", help="16 tokens and one KV cache dtype (what CI runs)")
    ap.add_argument("--target", type=Path, default=ROOT / "models" / "target", help="Hugging Face target directory")
    ap.add_argument("--draft", type=Path, help="ONNX draft directory (default: .gpu/draft-onnx-int4, else the "
                                               "demo draft's cached int4 export)")
    ap.add_argument("--tokens", type=int, help="new tokens per request (default 64; 16 with --quick)")
    ap.add_argument("--budget-s", type=float, default=180.0, help="the whole run's time limit (default 180)")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                    help="write gpu_check.md/json here (default: $OUT when set)")
    args = ap.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    rehearse = args.rehearse or args.device_stack
    ctx = Context(target=args.target.resolve(), draft=args.draft.resolve() if args.draft else None,
                  device="cuda" if cuda else "cpu", rehearse=rehearse, quick=args.quick,
                  tokens=args.tokens or (16 if args.quick else 64))
    table = Table(args.out, args.budget_s)
    mode = " --device-stack" if args.device_stack else " --rehearse" if args.rehearse else ""
    table.header = [f"# gpu_check{mode}{' --quick' if args.quick else ''}: "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}, device {ctx.device}, {ctx.tokens} tokens"]
    if not cuda and not rehearse:
        table.add("environment", "CUDA device", FAIL, "torch sees no CUDA device; on a CPU machine use --rehearse")
        return 1
    run_sections(table, ctx, SECTIONS)
    bad = table.failed()
    verdict = (f"gpu_check: {'FAILED' if bad else 'PASSED'} in {table.elapsed():.0f} s: {len(table.rows)} rows, "
               f"{len(bad)} failed" + "".join(f"\n  FAIL {r['section']}: {r['check']}: {r['detail']}" for r in bad))
    table.header.append(verdict.splitlines()[0])
    table.write()
    print(verdict, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
