"""End-to-end greedy identity: the engine's tokens equal transformers' generate on the target alone."""

from __future__ import annotations

import pytest

from hetero_spec import Engine
from hetero_spec.errors import PromptTooLongError, RequestError
from tests.conftest import hf_greedy

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [40, 41, 42, 43, 44, 40, 41, 42]]
MAX_NEW = 40


def _engine(target, kind, draft=None, **extra):
    cfg = {"target": {"model": str(target), "dtype": "float32"},
           "draft": {"kind": kind, **({"model": str(draft)} if draft else {})}}
    for key, val in extra.items():
        section, _, field = key.partition(".")
        cfg.setdefault(section, {})[field] = val
    return Engine.from_config(cfg)


@pytest.fixture(scope="module")
def llama_engines(llama_target, llama_copy_onnx, llama_random_onnx):
    yield from make_llama_engines(llama_target, llama_copy_onnx, llama_random_onnx)


def make_llama_engines(llama_target, llama_copy_onnx, llama_random_onnx, sampling: str = "coupled"):
    """One engine per draft kind, closed when the generator is (test_coupled.py uses it too)."""
    extra = {"speculation.sampling": sampling}
    engines = {"copy": _engine(llama_target, "onnx", llama_copy_onnx, **extra),
               "random": _engine(llama_target, "onnx", llama_random_onnx, **extra),
               "ngram": _engine(llama_target, "ngram", **extra),
               "none": _engine(llama_target, "none", **extra)}
    yield engines
    for e in engines.values():
        e.close()


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("draft", ["copy", "random", "ngram", "none"])
def test_llama_gqa_greedy_identity(llama_engines, llama_target, draft, gamma):
    eng = llama_engines[draft]
    for prompt in PROMPTS:
        ref = hf_greedy(llama_target, prompt, MAX_NEW)
        out = eng.generate(prompt, max_new_tokens=MAX_NEW, gamma=gamma, temperature=0.0)
        assert out.token_ids == ref
        assert out.stats["new_tokens"] == len(ref)
        assert out.finish_reason == ("stop" if ref[-1] == 0 and len(ref) < MAX_NEW else "length")
        if draft == "copy":
            assert out.stats["acceptance_rate"] >= 0.98
            assert out.stats["rounds"] <= -(-MAX_NEW // (gamma + 1)) + 1
        if draft == "random":
            assert out.stats["acceptance_rate"] <= 0.3
            assert out.stats["drafted"] > 0


def test_prompt_window_in_process_identity(llama_target, llama_random_onnx):
    """draft.prompt_window: the engine's drafter (and each request's, spawned from it) reads only the prompt's
    last 3 tokens; output is identical to the target alone, for a draft that is corrected nearly every round."""
    with _engine(llama_target, "onnx", llama_random_onnx, **{"draft.prompt_window": 3}) as eng:
        assert eng.source.proposer.prompt_window == 3 and eng.source.proposer.spawn().prompt_window == 3
        for prompt in PROMPTS:  # one strategy at a fixed gamma: it drafts every round
            for gamma in (2, 5):
                out = eng.generate(prompt, max_new_tokens=MAX_NEW, gamma=gamma)
                assert out.token_ids == hf_greedy(llama_target, prompt, MAX_NEW) and out.stats["drafted"] > 0
    with _engine(llama_target, "onnx", llama_random_onnx, **{"draft.candidates": ["onnx", "ngram"]}) as eng:
        onnx = eng.source.cands["onnx"].proposer
        assert onnx.prompt_window == 32 and onnx.spawn().prompt_window == 32  # auto, with a lookup next to the model
        for prompt in PROMPTS:  # whether a round drafts is the selection's choice, from measured costs
            out = eng.generate(prompt, max_new_tokens=MAX_NEW, gamma=3)
            assert out.token_ids == hf_greedy(llama_target, prompt, MAX_NEW)


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_qwen2_greedy_identity(qwen2_target, qwen2_copy_onnx, gamma):
    with _engine(qwen2_target, "onnx", qwen2_copy_onnx) as eng:
        for prompt in PROMPTS:
            out = eng.generate(prompt, max_new_tokens=MAX_NEW, gamma=gamma, temperature=0.0)
            assert out.token_ids == hf_greedy(qwen2_target, prompt, MAX_NEW)
            assert out.stats["acceptance_rate"] >= 0.98


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_gpt2_greedy_identity_ngram(gpt2_target, gamma):
    with _engine(gpt2_target, "ngram") as eng:
        for prompt in PROMPTS:
            out = eng.generate(prompt, max_new_tokens=MAX_NEW, gamma=gamma)
            assert out.token_ids == hf_greedy(gpt2_target, prompt, MAX_NEW)


def test_eos_inside_accepted_block(llama_engines, llama_target):
    """A stop token reached inside a fully accepted block ends generation there and is kept."""
    prompt = PROMPTS[0]
    free = hf_greedy(llama_target, prompt, MAX_NEW)
    pos = next(i for i in range(4, MAX_NEW) if free[i] not in free[:i] and free[i] != 0)
    stop = free[pos]
    ref = hf_greedy(llama_target, prompt, MAX_NEW, eos_token_id=[0, stop])
    assert ref == free[:pos + 1]
    for gamma in (3, 8):
        out = llama_engines["copy"].generate(prompt, max_new_tokens=MAX_NEW, gamma=gamma, stop_token_ids=[stop])
        assert out.token_ids == ref
        assert out.finish_reason == "stop"
        # it stopped inside a block: the last round proposed tokens beyond the stop token
        assert out.stats["drafted"] > len(ref) - out.stats["rounds"]


def test_ignore_eos_decodes_past_the_eos_to_max_new_tokens(llama_engines, llama_target, monkeypatch):
    """generation.ignore_eos: the model's EOS ids no longer stop (stop_token_ids still do); output still the
    target's."""
    prompt, eng = PROMPTS[0], llama_engines["copy"]
    free = hf_greedy(llama_target, prompt, MAX_NEW)
    pos = next(i for i in range(4, MAX_NEW - 4) if free[i] not in free[:i] and free[i] != 0)
    monkeypatch.setattr(eng.target, "eos_token_ids", {free[pos]})  # an EOS the greedy output meets early
    assert eng.generate(prompt, max_new_tokens=MAX_NEW, gamma=3).token_ids == free[:pos + 1]
    out = eng.generate(prompt, max_new_tokens=MAX_NEW, gamma=3, ignore_eos=True)
    unused = eng.target.vocab_width - 1  # the reference ignores the model's EOS too: its EOS is a token not met
    assert unused not in out.token_ids and out.finish_reason == "length"
    assert out.token_ids == hf_greedy(llama_target, prompt, MAX_NEW, eos_token_id=unused)
    out = eng.generate(prompt, max_new_tokens=MAX_NEW, gamma=3, ignore_eos=True, stop_token_ids=[free[pos]])
    assert out.token_ids == free[:pos + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 5, 10, 11])
def test_max_new_tokens_inside_block(llama_engines, llama_target, max_new):
    out = llama_engines["copy"].generate(PROMPTS[0], max_new_tokens=max_new, gamma=8)
    assert out.token_ids == hf_greedy(llama_target, PROMPTS[0], max_new)
    assert len(out.token_ids) == max_new and out.finish_reason == "length"


def test_context_limit_is_never_exceeded(llama_engines, llama_target):
    eng = llama_engines["copy"]
    ctx = eng.target.context_len  # 96 in the fixture config
    prompt = list(range(10, 10 + ctx - 13))
    out = eng.generate(prompt, max_new_tokens=100, gamma=8)
    assert len(prompt) + len(out.token_ids) == ctx
    assert out.finish_reason == "context"
    assert out.token_ids == hf_greedy(llama_target, prompt, ctx - len(prompt))


def test_prompt_over_context_is_a_clear_error(llama_engines):
    eng = llama_engines["none"]
    ctx = eng.target.context_len
    with pytest.raises(PromptTooLongError, match=f"{ctx} tokens but the context holds {ctx}"):
        eng.generate(list(range(1, ctx + 1)), max_new_tokens=4)


def test_bad_request_arguments(llama_engines):
    eng = llama_engines["none"]
    with pytest.raises(RequestError, match="empty"):
        eng.generate([], max_new_tokens=4)
    with pytest.raises(RequestError, match="out of range"):
        eng.generate([1, 100000], max_new_tokens=4)
    with pytest.raises(RequestError, match="max_new_tokens"):
        eng.generate([1, 2], max_new_tokens=0)


def test_text_prompt_and_stream_match_generate(llama_engines):
    eng = llama_engines["copy"]
    out = eng.generate("def parse(text):", max_new_tokens=20)
    pieces = list(eng.stream("def parse(text):", max_new_tokens=20))
    assert "".join(pieces) == out.text
    assert out.text == eng.tokenizer.decode(out.token_ids)
    for key in ("rounds", "drafted", "accepted", "acceptance_rate", "accept_hist", "tokens_per_s",
                "time_draft_s", "time_verify_s", "time_idle_s"):
        assert key in out.stats


def test_sampled_generation_is_seeded(llama_engines):
    eng = llama_engines["random"]
    a = eng.generate(PROMPTS[0], max_new_tokens=24, temperature=0.8, top_k=50, seed=11, gamma=3)
    b = eng.generate(PROMPTS[0], max_new_tokens=24, temperature=0.8, top_k=50, seed=11, gamma=3)
    c = eng.generate(PROMPTS[0], max_new_tokens=24, temperature=0.8, top_k=50, seed=12, gamma=3)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    # coupled sampling (the default): seeded output depends neither on gamma nor on the draft
    assert eng.config.speculation.sampling == "coupled"
    d = eng.generate(PROMPTS[0], max_new_tokens=24, temperature=0.8, top_k=50, seed=11, gamma=5)
    e = llama_engines["none"].generate(PROMPTS[0], max_new_tokens=24, temperature=0.8, top_k=50, seed=11)
    assert d.token_ids == a.token_ids == e.token_ids
