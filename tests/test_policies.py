"""Identity with the target alone under every tuning policy, in both layouts, for greedy and coupled
(seeded) sampling: fixed gamma, gamma auto (the real controller), and draft selection among [onnx, ngram].
Policies change speed, never output. The two-process runs use the
in-memory worker (test_pipelined_mem.py: deterministic scheduling, real protocol and decode loop) with the
real controller; test_two_process.py covers real worker processes."""

from __future__ import annotations

import pytest

from hetero_spec import Engine
from tests.fixtures.memworker import mem_engine

# the second prompt repeats itself, so the n-gram lookup finds matches
PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [40, 41, 42, 43, 44, 40, 41, 42]]
SAMPLING = {"greedy": {"temperature": 0.0}, "coupled": {"temperature": 0.9, "seed": 11}}
POLICIES = {
    "fixed": {"speculation": {"gamma": 4}},
    "auto": {"speculation": {"gamma": "auto"}},
    "auto+select": {"speculation": {"gamma": "auto"}, "draft": {"candidates": ["onnx", "ngram"]}},
    "fixed+select-ngram-only": {"speculation": {"gamma": 3}, "draft": {"candidates": ["ngram"]}},
}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture(scope="module")
def references(llama_target):
    """The target alone, per sampling mode and prompt."""
    with Engine.from_config({"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
                             "draft": {"kind": "none"}}) as eng:
        return {mode: [eng.generate(p, max_new_tokens=36, **kw).token_ids for p in PROMPTS]
                for mode, kw in SAMPLING.items()}


@pytest.mark.parametrize("layout", ["in_process", "two_process"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("draft", ["copy", "random"])
def test_every_policy_is_lossless(monkeypatch, llama_target, llama_copy_onnx, llama_random_onnx, references,
                                  layout, policy, draft):
    draft_dir = llama_copy_onnx if draft == "copy" else llama_random_onnx
    cfg = _merge({"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
                  "draft": {"kind": "onnx", "model": str(draft_dir)},
                  "runtime": {"mode": layout, "pin_cpus": False, "heartbeat_s": 1e6}}, POLICIES[policy])
    if layout == "two_process":
        eng, _ = mem_engine(monkeypatch, cfg, draft_dir, state=None)  # the real controller
    else:
        eng = Engine.from_config(cfg)
    with eng:
        for _ in range(2):  # the second pass runs on what the first taught (costs, acceptance, choices)
            for mode, kw in SAMPLING.items():
                for p, ref in zip(PROMPTS, references[mode]):
                    out = eng.generate(p, max_new_tokens=36, **kw)
                    assert out.token_ids == ref, (mode, p)
        extra = out.stats["extra"]
        if "select" in policy:
            sel = extra["draft_selection"]
            assert {n.partition("@")[0] for n in sel["strategies"]} == set(POLICIES[policy]["draft"]["candidates"])
            assert sel["last_reason"]
        if "auto" in policy:
            assert "gamma_auto" in extra
