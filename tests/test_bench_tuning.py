"""scripts/tuning_scenarios.py, the tuning scenarios re-run through the bench harness: its repetitive prompts
and each scenario's arms. The runs themselves are a developer's measurements, not tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tuning_scenarios.py"
_spec = importlib.util.spec_from_file_location("tuning_scenarios", SCRIPT)
ts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ts)


def test_repetitive_text_repeats_the_first_complete_lines():
    # the cut first and last lines are dropped; the block's first half follows it again (round(5 / 2) = 2 lines)
    assert ts.repetitive_text("cut mid-line\nline a\nline b\n\nline c\nline d\nlast cut") == \
        "line a\nline b\n\nline c\nline d\nline a\nline b\n"
    assert ts.repetitive_text("x\none\n\ntwo\ny") is None  # two non-blank lines: too few


def test_repetitive_set_skips_texts_without_enough_lines(llama_target):
    from hetero_spec.bench.prompts import load_tokenizer

    tok = load_tokenizer(llama_target)
    texts = ["a\nb\nc", "x\n1\n2\n3\n4\ny", "x\n5\n6\n7\n8\n9\ny"]
    config = SimpleNamespace(target=SimpleNamespace(model=llama_target))
    built = ts.repetitive_set(config, [tok.encode(t, add_special_tokens=False) for t in texts], 5)
    assert [tok.decode(p) for p in built] == ["1\n2\n3\n4\n1\n2\n", "5\n6\n7\n8\n9\n5\n6\n"]  # round(2.5) = 2


def test_each_scenario_has_its_arms():
    args = SimpleNamespace(scenario="gamma-sweep", layout="two_process", gammas=[2, 4])
    engines, arms = ts.arms_of(args, None)
    assert arms == {"target_only": ("target_only", None), "gamma=2": ("fixed", 2), "gamma=4": ("fixed", 4),
                    "auto": ("auto", None)}
    assert engines["auto"] == {"draft.kind": "onnx", "draft.candidates": [], "runtime.mode": "two_process",
                               "speculation.gamma": "auto"}
    args.scenario = "repetitive"
    engines, arms = ts.arms_of(args, None)
    assert list(arms) == ["target_only", "onnx", "ngram", "select"]
    assert engines["ngram"]["runtime.mode"] == "in_process"  # the n-gram lookup has no worker
    assert engines["select"]["draft.candidates"] == ["onnx", "ngram"]
