"""Sliding-window targets: rollback past a full window is exact, and the engine equals transformers' generate.

The window (8) is shorter than the prompt plus the output, so every verify pass after the first few
runs with a full window and every rejected block is cut off a layer that has already slid.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetero_spec import Engine
from hetero_spec.draft.export import export_draft
from hetero_spec.errors import ModelLoadError
from hetero_spec.target.verifier import TargetModel, _check_rollback
from tests.conftest import hf_greedy
from tests.fixtures.tiny_models import build_model

WINDOW = 8
PROMPTS = [[5, 17, 33, 2, 99, 100, 7, 8, 9, 10, 11, 12], [40, 41, 42]]
MAX_NEW = 40
SEQ = list(range(3, 40, 2))  # 19 tokens: well past the window


@pytest.fixture(scope="module")
def mistral_target(models_dir):
    return build_model("mistral", models_dir / "mistral-sw", seed=11, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def qwen2_sw_target(models_dir):
    """Qwen2 with use_sliding_window: layer 0 full attention, layers 1-2 sliding (a hybrid cache)."""
    return build_model("qwen2", models_dir / "qwen2-sw", seed=13, num_hidden_layers=3,
                       use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


@pytest.fixture(scope="module")
def gemma2_target(models_dir):
    """Gemma 2: sliding and full-attention layers alternate, logits soft-capped."""
    return build_model("gemma2", models_dir / "gemma2-sw", seed=21, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def mistral_copy_onnx(models_dir, mistral_target):
    """The target exported as a draft: export_draft spells out `layer_types` (a Mistral config leaves
    it out, and the builder would then attend to the whole context) and asks for a full-length KV cache
    (the builder's ring buffer cannot be rolled back by slicing), so the copy keeps the window."""
    return export_draft(mistral_target, models_dir / "mistral-sw-onnx", "fp32", quiet=True)


def _engine(target, kind, draft=None):
    return Engine.from_config({"target": {"model": str(target), "dtype": "float32"},
                               "draft": {"kind": kind, **({"model": str(draft)} if draft else {})}})


@pytest.mark.parametrize("name", ["mistral_target", "qwen2_sw_target", "gemma2_target"])
def test_rollback_into_full_window_equals_fresh(request, name):
    target = TargetModel(request.getfixturevalue(name), device="cpu", dtype="float32")
    assert target.windowed
    s = target.new_state()
    target.prefill(s, SEQ[:13])  # 12 cached: the window is already full
    target.forward(s, [SEQ[12], SEQ[13], 2, 4, 6, 8])  # last prompt token + 5 draft tokens, 1 right
    target.rollback(s, 14)  # reject 4: the layers had to keep window - 1 + 4 states to do this
    again = target.forward(s, SEQ[14:])
    fresh = target.forward(target.new_state(), SEQ)[14:]
    torch.testing.assert_close(again, fresh, rtol=1e-4, atol=1e-4)
    assert s.n_cached == s.cache.get_seq_length() == len(SEQ)
    # a fully accepted block (nothing to drop) still trims every sliding layer back to the window
    target.rollback(s, s.n_cached)
    assert {layer.keys.shape[-2] for layer in s.cache.layers if layer.is_sliding} == {WINDOW - 1}


@pytest.mark.parametrize("gamma", [1, 4, 8])
@pytest.mark.parametrize("draft", ["copy", "ngram", "none"])
def test_mistral_sliding_window_greedy_identity(request, mistral_target, draft, gamma):
    onnx = request.getfixturevalue("mistral_copy_onnx") if draft == "copy" else None
    with _engine(mistral_target, "onnx" if onnx else draft, onnx) as eng:
        for prompt in PROMPTS:
            out = eng.generate(prompt, max_new_tokens=MAX_NEW, gamma=gamma, temperature=0.0)
            assert out.token_ids == hf_greedy(mistral_target, prompt, MAX_NEW)
            if draft == "copy":  # agrees with the target: whole blocks accepted with a full window
                assert out.stats["acceptance_rate"] >= 0.9


@pytest.mark.parametrize("gamma", [1, 4, 8])
@pytest.mark.parametrize("draft", ["ngram", "none"])
def test_qwen2_sliding_window_greedy_identity(qwen2_sw_target, draft, gamma):
    with _engine(qwen2_sw_target, draft) as eng:
        for prompt in PROMPTS:
            out = eng.generate(prompt, max_new_tokens=MAX_NEW, gamma=gamma, temperature=0.0)
            assert out.token_ids == hf_greedy(qwen2_sw_target, prompt, MAX_NEW)


def test_recurrent_cache_is_refused_at_load(tmp_path):
    """A cache whose state crop cannot restore (Qwen3-Next's linear attention) is a clear load error."""
    from transformers import AutoConfig

    with pytest.raises(ModelLoadError, match=r"'/some/qwen3-next'.*LinearAttentionLayer.*rolled back"):
        _check_rollback(AutoConfig.for_model("qwen3_next"), Path("/some/qwen3-next"))
    assert _check_rollback(AutoConfig.for_model("gemma2"), tmp_path) is True  # sliding + full: supported
