"""`hetero-spec profile`: measure this machine's costs for a config, fit the cost model, recommend gamma.
See tuning/profile.py for what each measurement is; this driver runs them on Engines and writes the profile."""

import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .config import load_config
from .engine import Engine
from .tuning.cost_model import LAYOUTS, CostModel, expected_tokens, fit_line
from .tuning.profile import (batch_points, decoder_token_s, median_s, prefilled, recommended_batch,
                             step_overhead_s, transfer_points, verify_points)

IN_PROCESS = {"runtime.mode": "in_process", "runtime.cpus": None}  # every cost on its own; layouts come after


def _draft_decoder(eng: Engine):
    """The OnnxDecoder of the Engine's in-process onnx draft (None for a lookup or none)."""
    return getattr(getattr(eng.source, "proposer", None), "decoder", None)


def _draft_token_s(eng: Engine, prompt: list[int], reps: int) -> float:
    """Median time per greedy token of the Engine's onnx draft in this process (0.0 for a lookup or none)."""
    return 0.0 if (decoder := _draft_decoder(eng)) is None else decoder_token_s(decoder, prompt, reps)


def _step_overhead(decoder, prompt: list[int], reps: int) -> dict[str, float] | None:
    """A decoder's one-token step against ONNX Runtime's own run of it (tuning/profile.step_overhead_s), in ms."""
    if decoder is None or (timed := step_overhead_s(decoder, prompt, reps)) is None:
        return None
    step_s, run_s = timed
    return {"step_ms": round(step_s * 1e3, 4), "run_ms": round(run_s * 1e3, 4),
            "overhead_ms": round((step_s - run_s) * 1e3, 4)}


def _acceptance(engine, prompts: list[list[int]], max_new: int, gamma: int = 8) -> tuple[float, dict]:
    """Per-token acceptance over calibration prompts (greedy): accepted / tested, as the controller counts it
    (tuning/cost_model.Acceptance: a round cut short by max_new_tokens tests only what it verified)."""
    runs = [engine.generate(p, max_new_tokens=max_new, gamma=gamma).stats for p in prompts]
    acc, tested = sum(s["accepted"] for s in runs), sum(s["tested"] for s in runs)
    return acc / max(1, tested), {"accepted": acc, "drafted": sum(s["drafted"] for s in runs),
                                  "rejections": tested - acc, "prompts": len(prompts), "max_new_tokens": max_new,
                                  "gamma": gamma}


def _decode_goodput(engine, prompts: list[list[int]], max_new: int, **options) -> float:
    """Committed tokens per second of decoding the prompts (prefill excluded, as in the cost model)."""
    stats = [engine.generate(p, max_new_tokens=max_new, **options).stats for p in prompts]
    return sum(s["new_tokens"] for s in stats) / max(1e-9, sum(s["time_total_s"] - s["time_prefill_s"] for s in stats))


def _cost_model(vpoints: list[tuple[int, float]], draft_token_s: float, transfer_s: float = 0.0) -> CostModel:
    """The verify line fitted to (tokens, seconds) points, clipped at 0, and the points themselves (measured)."""
    fixed_s, per_token_s = fit_line([(float(x), y) for x, y in vpoints])
    return CostModel(verify_fixed_s=max(fixed_s, 0.0), verify_per_token_s=max(per_token_s, 0.0),
                     draft_token_s=draft_token_s, transfer_s=transfer_s, measured={x - 1: y for x, y in vpoints})


def _by_k(vpoints: list[tuple[int, float]]) -> dict[str, float]:
    """Verify seconds keyed by draft tokens (a point's tokens include the one after the cached text)."""
    return {str(x - 1): round(y, 6) for x, y in vpoints}


def _profile_drafts(config, model: CostModel, drafts: list[Path], calib: list[list[int]], max_new: int,
                    reps: int, say) -> dict[str, Any]:
    """Each draft (the configured one first, then --draft DIRs, and the n-gram lookup when draft.candidates
    names it): time per token, acceptance on the calibration prompts, best gamma and predicted goodput per
    layout with the target's measured verify line."""
    out: dict[str, Any] = {}
    runs = [(str(draft), {"draft.kind": "onnx", "draft.model": str(draft)}) for draft in drafts]
    if "ngram" in config.draft.candidates:
        runs.append(("ngram", {"draft.kind": "ngram"}))
    for name, over in runs:
        say(f"draft {name}: time per token and acceptance")
        with Engine.from_config(config, overrides={**over, "draft.candidates": [], "speculation.gamma": 8}) as eng:
            draft_token_s = _draft_token_s(eng, calib[0], reps)  # 0.0: the n-gram lookup costs microseconds
            acceptance, info = _acceptance(eng, calib, max_new)
        drafted = replace(model, draft_token_s=draft_token_s)
        best = {lay: drafted.best_gamma(acceptance, lay) for lay in LAYOUTS}
        out[name] = {"kind": over["draft.kind"], "draft_token_s": round(draft_token_s, 7),
                     "acceptance": round(acceptance, 4), "tested_tokens": info["accepted"] + info["rejections"],
                     "best": {lay: {"gamma": g, "predicted_tok_s": round(r, 2)} for lay, (g, r) in best.items()}}
    return out


def precisions_here(config) -> list[str]:
    """Target precisions this backend runs on this machine (precision.py)."""
    from .target.backends import choose_backend
    if choose_backend(config.target).backend == "onnx":
        return ["fp32", "int8", "int4"] if (Path(config.target.model) / "config.json").is_file() else []
    return ["fp32", "int8"] if config.target.device == "cpu" else ["fp32", "bf16", "fp16"]


def _profile_precisions(config, prompt: list[int], calib: list[list[int]], max_new: int, reps: int,
                        say) -> dict[str, Any]:
    """Each target precision this machine runs: its verify line, the draft's time per token and acceptance
    against it (quantization moves both), the best gamma and predicted goodput in process, and target-only's
    rate. recommended: the best predicted goodput (taken by target.precision auto only with allow_lossy)."""
    rows: dict[str, Any] = {}
    for precision in precisions_here(config):
        say(f"target precision {precision}: verify line, draft cost and acceptance (exported once if needed)")
        with Engine.from_config(config, overrides={"target.precision": precision, **IN_PROCESS}) as eng:
            vpoints = verify_points(eng.target, prompt, [0, 8], reps)
            acceptance = _acceptance(eng, calib, max_new)[0]
            draft_token_s = _draft_token_s(eng, prompt, reps)
        model = _cost_model(vpoints, draft_token_s)
        gamma, rate = model.best_gamma(acceptance, "in_process")
        rows[precision] = {"verify_s": _by_k(vpoints), "draft_token_s": round(draft_token_s, 6),
                           "acceptance": round(acceptance, 4), "best_gamma": gamma, "predicted_tok_s": round(rate, 1),
                           "target_only_tok_s": round(1.0 / model.verify(0), 1),
                           "lossless_vs_checkpoint": precision == "fp32"}
    return {"candidates": rows, "recommended": max(rows, key=lambda p: rows[p]["predicted_tok_s"], default=None),
            "note": "used by target.precision: auto only with target.allow_lossy: true (quantizing changes "
                    "the model's output)"}


def _profile_placement(config, acceptance: float, calib: list[list[int]], max_new: int, say) -> dict[str, Any]:
    """Every layout this machine allows (tuning/placement.py): costs, predicted and measured goodput at best gamma."""
    from .tuning import placement
    probe = config.model_copy(deep=True)
    probe.runtime.mode, probe.runtime.cpus = "auto", "auto"
    layouts = placement.candidates(probe, placement.allowed_cpus())
    costs = placement.measure(probe, layouts, say)
    best, rows = placement.choose(costs, layouts, acceptance)
    for row, lay in zip(rows, layouts):
        say(f"measured goodput of {lay.label()} at gamma {max(1, row['gamma'])}")
        over = {"runtime.mode": lay.mode, "runtime.cpus": None, "target.threads": lay.target_threads,
                "draft.threads": lay.draft_threads, "speculation.gamma": max(1, row["gamma"]),
                "runtime.pin_cpus": True, "draft.candidates": []}
        with Engine.from_config(config, overrides=over) as eng:
            eng.generate(calib[0], max_new_tokens=16)  # warm (the worker's first request)
            row["measured_tok_s"] = round(_decode_goodput(eng, calib, max_new), 2)
    measured_best = max(rows, key=lambda r: r["measured_tok_s"])
    keys = ("mode", "target_threads", "draft_threads")
    return {"costs": costs.to_dict(), "candidates": rows,
            "recommended": {k: getattr(best, k) for k in keys}, "measured_best": {k: measured_best[k] for k in keys}}


def run_profile(config_path: Path, out: Path, quick: bool = False, prompts_file: Path | None = None,
                overrides: dict | None = None, say=None, drafts: list[Path] | None = None,
                placement: bool = True, precisions: bool = True) -> dict[str, Any]:
    """Measure, fit, recommend; write out (YAML) and out with .png. Returns the profile dict."""
    import yaml
    from .bench.prompts import heldout_prompt_ids, prompts_from_file
    from .gguf_source import resolve as resolve_gguf
    from .precision import resolve_draft
    say = say or (lambda m: print(f"profile: {m}", file=sys.stderr, flush=True))
    t_start = time.perf_counter()
    base_config = load_config(config_path, overrides={**(overrides or {}), **IN_PROCESS})
    # a GGUF converted, a checkpoint with draft.precision exported: draft.model is then the export it measures
    config = resolve_draft(resolve_gguf(base_config))
    if config.draft.kind != "onnx":
        raise config.error("draft.kind", config.draft.kind, "profile measures a model draft: use draft.kind: onnx")
    n_prompts, max_new, reps = (2, 48, 8) if quick else (6, 128, 20)
    say(f"loading {config_path} (target backend {config.target.backend})")
    with Engine.from_config(config) as eng:
        prompts = (prompts_from_file(prompts_file, config)[:n_prompts] if prompts_file is not None
                   else heldout_prompt_ids(config, Path(config_path), n_prompts + 1, 128))
        ctx_prompt, calib = prompts[0], prompts[1:] or prompts
        drafts_k = [1, 2, 4, 8, 12, 16] if quick else list(range(0, 17))
        say(f"target verification, k = {drafts_k[0]}..{drafts_k[-1]} draft tokens after {len(ctx_prompt)} cached")
        vpoints = verify_points(eng.target, ctx_prompt, drafts_k, reps)
        say("draft time per token")
        draft_token_s = _draft_token_s(eng, ctx_prompt, reps)
        say("per-step overhead: one step of the target and of the draft against their sessions' own runs")
        overhead = {"target": _step_overhead(getattr(eng.target, "decoder", None), ctx_prompt, reps),
                    "draft": _step_overhead(_draft_decoder(eng), ctx_prompt, reps)}
        if overhead["target"] is not None:  # the verifier interface's one-token pass, V(0), against the same run
            overhead["target"]["verify_0_ms"] = round(vpoints[0][1] * 1e3, 4) if drafts_k[0] == 0 else None
        say("transfer time against payload")
        tpoints = transfer_points([64, 4096, 65536, 1 << 20], reps)
        say("prefill time against prompt length")

        def prefill(length: int) -> None:
            with prefilled(eng.target, ctx_prompt[:length]):  # one state, prefilled and released
                pass

        ppoints = [(n, median_s(lambda n=n: prefill(n), max(2, reps // 4))) for n in (16, 64, len(ctx_prompt))]
        limit = eng.config.serving.max_batch
        sizes = [b for b in (1, 2, 4, 8, 16, 32) if b <= limit]
        say(f"shared target pass against batch size {sizes} (serving.max_batch {limit})")
        bpoints = batch_points(eng.target, ctx_prompt, sizes, reps)
        say(f"acceptance on {len(calib)} calibration prompts x {max_new} tokens")
        acceptance, acc_info = _acceptance(eng, calib, max_new)
        model = _cost_model(vpoints, draft_token_s, transfer_s=tpoints[0][1])
        gammas = [2, 4, 8, 12] if quick else [1, 2, 4, 6, 8, 10, 12, 16]
        say(f"measured goodput at gamma {gammas} (in process, decoding time: prefill excluded, as in the model)")
        measured = {g: _decode_goodput(eng, calib, max_new, gamma=g) for g in gammas}
    draft_rows = _profile_drafts(base_config, model, [config.draft.model, *(drafts or [])], calib, max_new, reps, say)
    place = _profile_placement(base_config, acceptance, calib, max_new, say) if placement else None
    recommended = {lay: model.best_gamma(acceptance, lay)[0] for lay in LAYOUTS}
    profile = {
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None},
        "config": str(config_path), "target_backend": config.target.backend, "target_threads": config.target.threads,
        "draft": str(config.draft.model), "draft_threads": config.draft.threads, "quick": quick,
        "measured": {"verify_s": _by_k(vpoints), "draft_token_s": round(draft_token_s, 6),
                     "transfer_s": {str(size): round(y, 7) for size, y in tpoints},
                     "prefill_s": {str(n): round(y, 6) for n, y in ppoints},
                     "goodput_tok_s_in_process": {str(g): round(v, 2) for g, v in measured.items()},
                     "step_overhead": overhead},
        "cost_model": {k: ({g: round(x, 7) for g, x in v.items()} if isinstance(v, dict) else round(v, 7))
                       for k, v in model.to_dict().items()},
        "acceptance": {"per_token": round(acceptance, 4), **acc_info}, "recommended_gamma": recommended,
        "drafts": draft_rows, "recommended_draft": max(draft_rows, key=lambda name: max(
            row["predicted_tok_s"] for row in draft_rows[name]["best"].values())),
        "placement": place,
        "precision": _profile_precisions(base_config, ctx_prompt, calib, max_new, reps, say) if precisions else None,
        "batch": {"shared_pass_s": {str(b): round(y, 6) for b, y in bpoints},
                  "tokens_per_s": {str(b): round(b / y, 1) for b, y in bpoints},
                  "recommended_max_batch": recommended_batch(bpoints)},
        "predicted_goodput_tok_s": {lay: {str(g): round(model.goodput(g, acceptance, lay), 2) for g in range(17)}
                                    for lay in LAYOUTS},
        "formula": "E = (1 - a^(g+1)) / (1 - a); in_process R = g*d + V(g); two_process R = V(g) + transfer + "
                   "(1 - a^g) * g * d; V(g) = measured[g], else verify_fixed_s + verify_per_token_s * (g + 1)",
        "elapsed_s": round(time.perf_counter() - t_start, 1)}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(profile, sort_keys=False))
    _plot(profile, out.with_suffix(".png"))
    say(f"wrote {out} and {out.with_suffix('.png')} in {profile['elapsed_s']} s; recommended gamma "
        f"{recommended} at acceptance {acceptance:.3f} (E at gamma 8: {expected_tokens(acceptance, 8):.2f})")
    if place is not None:
        for row in place["candidates"]:
            say("  {mode:<11} target {target_threads} / draft {draft_threads} thread(s), gamma {gamma}: predicted "
                "{predicted_tok_s:.1f} tok/s, measured {measured_tok_s:.1f}".format_map(row))
        say(f"  recommended layout {place['recommended']} (measured best {place['measured_best']})")
    return profile


def _plot(profile: dict, path: Path) -> None:
    from matplotlib.figure import Figure  # saved without pyplot: no GUI backend, no global figure state
    fig = Figure(figsize=(6.0, 4.0), layout="constrained")
    axes = fig.add_subplot()
    for lay, pts in profile["predicted_goodput_tok_s"].items():
        axes.plot([int(g) for g in pts], list(pts.values()), label=f"predicted, {lay}")
    meas = profile["measured"]["goodput_tok_s_in_process"]
    axes.plot([int(g) for g in meas], list(meas.values()), "o", label="measured, in_process")
    for row in (profile.get("placement") or {}).get("candidates", []):
        axes.plot([row["gamma"]], [row["measured_tok_s"]], "x", markersize=9,
                  label="measured, {mode} {target_threads}+{draft_threads} threads".format_map(row))
    axes.set(xlabel="gamma (draft tokens per round)", ylabel="goodput (committed tokens/s)",
             title=f"acceptance {profile['acceptance']['per_token']:.3f}; recommended {profile['recommended_gamma']}")
    axes.legend()
    fig.savefig(path, dpi=110)
