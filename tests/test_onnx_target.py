"""The ONNX Runtime target backend (`target.backend: onnx`): block verification equals single steps,
rollback, lossless output relative to the ONNX target alone (greedy and coupled sampling; in process and
two-process), clear config errors, and no torch import anywhere on that path."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from hetero_spec import Engine
from hetero_spec.errors import ConfigError
from hetero_spec.config import build_config
from hetero_spec.target.onnx_backend import OnnxTarget

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [40, 41, 42, 43, 44, 40, 41, 42]]
SEQ = [5, 17, 33, 2, 99, 100, 7, 8, 9]


def _cfg(target_onnx, kind, draft=None, **extra):
    cfg = {"target": {"model": str(target_onnx), "backend": "onnx"},
           "draft": {"kind": kind, **({"model": str(draft)} if draft else {})}}
    for key, val in extra.items():
        section, _, name = key.partition(".")
        cfg.setdefault(section, {})[name] = val
    return cfg


def test_block_verification_and_rollback(llama_copy_onnx):
    t = OnnxTarget(llama_copy_onnx)
    a = t.new_state()
    t.prefill(a, SEQ[:5])
    block = t.forward(a, SEQ[4:])
    b = t.new_state()
    t.prefill(b, SEQ[:5])
    steps = np.stack([t.forward(b, [tok])[0] for tok in SEQ[4:]])
    np.testing.assert_allclose(block, steps, rtol=1e-4, atol=1e-4)
    t.rollback(a, 6)
    assert a.n_cached == 6
    again = t.forward(a, SEQ[6:])
    np.testing.assert_allclose(again, steps[2:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cannot roll back"):
        t.rollback(a, 100)


@pytest.fixture(scope="module")
def reference(llama_copy_onnx):
    """The ONNX target alone: what every speculative run must reproduce."""
    with Engine.from_config(_cfg(llama_copy_onnx, "none")) as eng:
        greedy = {i: eng.generate(p, max_new_tokens=40).token_ids for i, p in enumerate(PROMPTS)}
        sampled = {i: eng.generate(p, max_new_tokens=40, temperature=0.8, seed=11).token_ids
                   for i, p in enumerate(PROMPTS)}
    return greedy, sampled


@pytest.mark.parametrize("kind", ["copy", "random", "ngram"])
def test_onnx_target_is_lossless_in_process(llama_copy_onnx, llama_random_onnx, reference, kind):
    draft = {"copy": llama_copy_onnx, "random": llama_random_onnx}.get(kind)
    with Engine.from_config(_cfg(llama_copy_onnx, "onnx" if draft else kind, draft)) as eng:
        assert eng.target.decoder.prefill_threads is None  # in process: no second session (prefill_threads auto)
        for gamma in (1, 4, 8):
            for i, p in enumerate(PROMPTS):
                out = eng.generate(p, max_new_tokens=40, gamma=gamma)
                assert out.token_ids == reference[0][i], (kind, gamma, i)
                if kind == "copy":
                    assert out.stats["acceptance_rate"] >= 0.98
                s = eng.generate(p, max_new_tokens=40, gamma=gamma, temperature=0.8, seed=11)
                assert s.token_ids == reference[1][i], ("coupled", kind, gamma, i)


def test_onnx_target_two_process(monkeypatch, llama_copy_onnx, llama_random_onnx, reference):
    from tests.test_pipelined_mem import mem_engine

    cfg = _cfg(llama_copy_onnx, "onnx", llama_random_onnx,
               **{"runtime.mode": "two_process", "runtime.pin_cpus": False, "runtime.heartbeat_s": 1e6})
    eng, _ = mem_engine(monkeypatch, cfg, llama_random_onnx)
    with eng:
        # target.prefill_threads auto: the prompt is read on every core of the process, the rest on the target's
        cores = len(os.sched_getaffinity(0))
        assert eng.target.decoder.prefill_threads == (cores if cores > 1 else None)
        for gamma in (2, 5):
            for i, p in enumerate(PROMPTS):
                assert eng.generate(p, max_new_tokens=40, gamma=gamma).token_ids == reference[0][i]
                s = eng.generate(p, max_new_tokens=40, gamma=gamma, temperature=0.8, seed=11)
                assert s.token_ids == reference[1][i]


def test_hf_target_is_exported_on_first_use_then_reused(tmp_path, monkeypatch, llama_target, llama_copy_onnx,
                                                        reference):
    """backend onnx with a Hugging Face directory: exported once into $HETERO_SPEC_CACHE (with progress on
    stderr), reused by the next engine without running the builder, and the output is the export's."""
    from hetero_spec.draft import export as export_mod
    from hetero_spec.target import export_cache

    monkeypatch.setenv("HETERO_SPEC_CACHE", str(tmp_path / "cache"))
    calls = []
    real = export_mod.export_draft
    monkeypatch.setattr(export_mod, "export_draft", lambda *a, **k: calls.append(a) or real(*a, **k))
    lines: list[str] = []
    entry = export_cache.cached_export(llama_target, progress=lines.append)
    assert entry.parent == tmp_path / "cache" / "onnx" and (entry / "model.onnx").is_file()
    assert len(calls) == 1 and any("exporting the target" in x for x in lines)
    with Engine.from_config(_cfg(llama_target, "none")) as eng:  # finds the cached entry: no second export
        assert eng.target.decoder.model_dir == entry
        assert eng.generate(PROMPTS[0], max_new_tokens=40).token_ids == reference[0][0]
    assert len(calls) == 1
    # a changed checkpoint is a new key; leftovers of an interrupted export are never taken for an entry
    assert export_cache.entry_dir(llama_target) == entry
    assert not list(entry.parent.glob("*.tmp-*"))


def test_auto_backend_picks_onnx_on_cpu_and_torch_when_not_exportable(caplog, llama_copy_onnx, gpt2_target):
    from hetero_spec.config import build_config
    from hetero_spec.target.backends import choose_backend

    def target(model, device="cpu"):
        return build_config({"target": {"model": str(model), "backend": "auto", "device": device}}).target

    assert choose_backend(target(llama_copy_onnx)).backend == "onnx"
    gpt2 = choose_backend(target(gpt2_target))
    assert gpt2.backend == "torch" and "does not export GPT2LMHeadModel" in gpt2.reason
    assert choose_backend(target(gpt2_target, "cuda")).backend == "torch"
    with pytest.raises(ConfigError, match="auto picks torch for a CUDA device"):
        choose_backend(target(llama_copy_onnx, "cuda"))
    with caplog.at_level("INFO", logger="hetero_spec"):
        with Engine.from_config({"target": {"model": str(llama_copy_onnx), "backend": "auto", "device": "cpu"}}) as eng:
            assert eng.target.backend == "onnx" and eng.config.target.backend == "onnx"
    assert any("target backend: onnx (CPU target and target.model is an ONNX export)" in r.getMessage()
               for r in caplog.records)


def test_onnx_backend_errors_name_the_key(gpt2_target, llama_copy_onnx):
    with pytest.raises(ConfigError, match=r"target.model.*needs an ONNX export.*does not export GPT2"):
        Engine.from_config(_cfg(gpt2_target, "ngram"))
    with pytest.raises(ConfigError, match=r"target.model.*ONNX export, which target.backend torch cannot run"):
        Engine.from_config({"target": {"model": str(llama_copy_onnx)}, "draft": {"kind": "ngram"}})


def test_the_onnx_path_never_imports_torch(llama_copy_onnx):
    """An edge box can run both sides on ONNX Runtime alone: in process and with the draft worker."""
    code = f"""
import sys
from hetero_spec import Engine
for mode in ("in_process", "two_process"):
    cfg = {{"target": {{"model": {str(llama_copy_onnx)!r}, "backend": "onnx"}},
           "draft": {{"kind": "onnx", "model": {str(llama_copy_onnx)!r}}},
           "runtime": {{"mode": mode, "pin_cpus": True, "heartbeat_s": 120.0}}}}
    with Engine.from_config(cfg) as eng:
        out = eng.generate([5, 17, 33, 2], max_new_tokens=12, gamma=3)
        assert len(out.token_ids) >= 1, out
        eng.generate("def f(", max_new_tokens=4)
print("torch" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_onnx_target_stop_rules_in_both_layouts(monkeypatch, arch, llama_copy_onnx, qwen2_copy_onnx):
    """Identity with the ONNX target alone (Llama-GQA and Qwen2) at gamma 1, 3 and 8, with a stop token inside
    an accepted block, max_new_tokens inside a block and the context limit, in process and two-process."""
    from tests.test_pipelined_mem import mem_engine

    model = {"llama": llama_copy_onnx, "qwen2": qwen2_copy_onnx}[arch]
    prompt = PROMPTS[0]
    with Engine.from_config(_cfg(model, "none")) as alone:
        free = alone.generate(prompt, max_new_tokens=30).token_ids
        pos = next(i for i in range(4, 30) if free[i] not in free[:i] and free[i] not in alone.target.eos_token_ids)
        stop = free[pos]
        ctx = alone.target.context_len
        long_prompt = [(7 * i + 3) % 200 + 10 for i in range(ctx - 13)]
        ref_ctx = alone.generate(long_prompt, max_new_tokens=100).token_ids
        assert len(long_prompt) + len(ref_ctx) == ctx
    pipelined = {"runtime.mode": "two_process", "runtime.pin_cpus": False, "runtime.heartbeat_s": 1e6}
    for layout, extra in (("in_process", {}), ("two_process", pipelined)):
        cfg = _cfg(model, "onnx", model, **extra)
        eng = mem_engine(monkeypatch, cfg, model)[0] if extra else Engine.from_config(cfg)
        with eng:
            for gamma in (1, 3, 8):
                out = eng.generate(prompt, max_new_tokens=30, gamma=gamma, stop_token_ids=[stop])
                assert (out.token_ids, out.finish_reason) == (free[:pos + 1], "stop"), (layout, gamma)
                if gamma == 8 and layout == "in_process":  # the stop came inside a block: tokens were drafted past it
                    assert out.stats["drafted"] > len(out.token_ids) - out.stats["rounds"]
                for max_new in (1, 5, 11):
                    out = eng.generate(prompt, max_new_tokens=max_new, gamma=gamma)
                    assert (out.token_ids, out.finish_reason) == (free[:max_new], "length"), (layout, gamma, max_new)
                out = eng.generate(long_prompt, max_new_tokens=100, gamma=gamma)
                assert (out.token_ids, out.finish_reason) == (ref_ctx, "context"), (layout, gamma)


def test_both_backends_implement_the_verifier_interface(llama_copy_onnx, llama_target):
    from hetero_spec.target.base import Verifier
    from hetero_spec.target.verifier import TargetModel

    for t in (OnnxTarget(llama_copy_onnx), TargetModel(llama_target, device="cpu", dtype="float32")):
        assert isinstance(t, Verifier) and t.backend in ("onnx", "torch")
        st = t.new_state()
        t.prefill(st, PROMPTS[0])
        assert st.n_cached == len(PROMPTS[0]) - 1


def test_demo_pair_onnx_backend_agrees_with_torch():
    """The shipped demo target under both backends (fp32), greedy, on held-out prompts: token for token equal.
    (ONNX Runtime and PyTorch may round differently; on these prompts they never pick different tokens.)"""
    from pathlib import Path

    from hetero_spec.bench.prompts import heldout_prompt_ids
    from hetero_spec.config import load_config

    demo = Path(__file__).resolve().parents[1] / "configs" / "cpu-demo.yaml"
    prompts = heldout_prompt_ids(load_config(demo), demo, 3, 64)
    outs = {}
    for backend in ("torch", "onnx"):
        with Engine.from_config(demo, overrides={"target.backend": backend, "runtime.mode": "in_process"}) as eng:
            assert eng.target.backend == backend
            outs[backend] = [eng.generate(p, max_new_tokens=48).token_ids for p in prompts]
    assert outs["onnx"] == outs["torch"]


def test_target_spin_reaches_the_session(llama_copy_onnx, reference):
    """target.spin is the session's spinning: `run` spins within a run only (force_spinning_stop), true is ONNX
    Runtime's default, false never spins, auto (the default) is true with no draft beside the target; the output
    does not depend on it."""
    cfg = {"target": {"model": str(llama_copy_onnx), "backend": "onnx", "threads": 2},
           "draft": {"kind": "none"}, "runtime": {"mode": "in_process"}}

    def entries(eng) -> tuple:
        opts = eng.target.decoder.session.get_session_options()
        got = []
        for key in ("session.intra_op.allow_spinning", "session.force_spinning_stop"):
            try:
                got.append(opts.get_session_config_entry(key))
            except Exception:  # not set: ONNX Runtime's default (spinning, not stopped after a run)
                got.append(None)
        return tuple(got)

    outs = []
    for spin, want in (("run", (None, "1")), (True, (None, None)), (False, ("0", None)), ("auto", (None, None))):
        with Engine.from_config(cfg, overrides={"target.spin": spin}) as eng:
            assert entries(eng) == want, spin
            outs.append(eng.generate(PROMPTS[0], max_new_tokens=20).token_ids)
    assert build_config(cfg).target.spin == "auto"
    assert outs == [reference[0][0][:20]] * 4
    # auto with an ONNX draft in this process: `run` (the draft's session needs the cores between the target's runs)
    with Engine.from_config({**cfg, "draft": {"kind": "onnx", "model": str(llama_copy_onnx), "threads": 1}}) as eng:
        assert entries(eng) == (None, "1")
        assert eng.generate(PROMPTS[0], max_new_tokens=20).token_ids == reference[0][0][:20]


def test_target_spin_auto_is_run_only_beside_an_in_process_draft():
    from types import SimpleNamespace

    from hetero_spec.target.backends import target_spin

    def config(spin="auto", kind="onnx", candidates=(), mode="in_process"):
        return SimpleNamespace(target=SimpleNamespace(spin=spin), runtime=SimpleNamespace(mode=mode),
                               draft=SimpleNamespace(kind=kind, candidates=list(candidates)))

    assert target_spin(config()) == "run" and target_spin(config(mode="auto")) == "run"
    assert target_spin(config(kind="ngram", candidates=["onnx", "ngram"])) == "run"
    assert target_spin(config(kind="none")) is True and target_spin(config(kind="ngram")) is True
    assert target_spin(config(candidates=["ngram", "corpus"])) is True
    assert target_spin(config(mode="two_process")) is True
    assert target_spin(config(spin=False, kind="none")) is False
    assert target_spin(config(spin="run", kind="none")) == "run"
