"""Coupled (Gumbel-max) sampling: pure verification, its marginals, and seeded identity through the engine.

Pure tests run on constructed p and q. The engine tests check that a seeded coupled run is a pure function
of (seed, prompt, target, sampling settings): every draft (ONNX copy, unrelated random ONNX, n-gram) at
every gamma emits exactly what the target alone (draft kind none) emits, which in turn equals a step-by-step
transformers reference that picks argmax(log p + g) with `gumbel_noise`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats as sps

from hetero_spec.draft.onnx_drafter import OnnxDrafter
from hetero_spec.sampling import (SamplingParams, coupled_choice, coupled_weights, exponential_noise, logits_to_probs,
                                  verify_coupled)
from tests.conftest import _hf_model


def gumbel_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """[vocab] standard Gumbel noise g = -log(E) of the coupled noise E at (seed, position)."""
    return -np.log(exponential_noise(seed, position, vocab))

# -- noise -----------------------------------------------------------------------------------------------


def test_noise_is_keyed_by_full_seed_and_position():
    a = exponential_noise(7, 10, 64)
    np.testing.assert_array_equal(a, exponential_noise(7, 10, 64))
    np.testing.assert_array_equal(a[:16], exponential_noise(7, 10, 16))  # a prefix does not depend on vocab
    for other in [(7, 11), (8, 10), (7 + 2**32, 10), (7 + 2**48, 10), (7 + 2**63, 10)]:
        assert not np.allclose(a, exponential_noise(*other, 64)), other
    assert (a > 0).all()
    np.testing.assert_allclose(gumbel_noise(7, 10, 64), -np.log(a))
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="seed"):
            exponential_noise(bad, 0, 4)


def test_noise_is_drawn_once_and_shared_read_only():
    """The draft and the target of one process ask for the same positions: one draw, which no caller may change."""
    a = exponential_noise(12, 345, 100)
    assert exponential_noise(12, 345, 100) is a and not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 1.0


def test_coupled_weights_choose_what_the_probabilities_choose():
    """argmax(w / E) with the unnormalised float32 weights picks the token argmax(p / E) picks, over 3,000 rows
    of 1,000 logits and their noise; with top-k or top-p the weights are the probabilities themselves."""
    rng = np.random.default_rng(5)
    params = SamplingParams(temperature=0.7, seed=1, sampling="coupled")
    for pos in range(3000):
        x = (rng.standard_normal(1000) * rng.uniform(0.5, 6)).astype(np.float32)
        w, e = coupled_weights(x, params), exponential_noise(1, pos, 1000)
        assert w.dtype == np.float32 and w.max() == 1.0
        assert coupled_choice(w, e) == coupled_choice(logits_to_probs(x[None], params)[0], e)
    for cut in (SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.7, top_p=0.5)):
        np.testing.assert_array_equal(coupled_weights(x, cut), logits_to_probs(x[None], cut)[0])


def test_noise_moments():
    """200,000 entries: Exp(1) mean 1 and variance 1; the Gumbel mean is Euler's constant."""
    e = np.concatenate([exponential_noise(3, pos, 1000) for pos in range(200)])
    assert abs(e.mean() - 1.0) < 0.01 and abs(e.var() - 1.0) < 0.03
    assert abs((-np.log(e)).mean() - np.euler_gamma) < 0.01


def test_sampling_params_mode():
    assert SamplingParams(temperature=0.8, sampling="coupled").coupled
    assert not SamplingParams(temperature=0.8, sampling="coupled").greedy
    assert not SamplingParams(temperature=0.0, sampling="coupled").coupled  # greedy ignores the mode
    assert not SamplingParams(temperature=0.8).coupled  # rejection is the dataclass default
    with pytest.raises(ValueError, match="sampling must be"):
        SamplingParams(sampling="gumbel")


# -- verification on constructed inputs ----------------------------------------------------------------
@pytest.mark.parametrize("draft, target, expected", [
    ([4, 5, 6], [4, 5, 6, 9], (3, 9)),      # all accepted -> bonus token
    ([4, 5, 6], [1, 5, 6, 9], (0, 1)),      # first rejected -> recovered token
    ([4, 5, 6], [4, 2, 6, 9], (1, 2)),      # middle rejected
    ([], [7], (0, 7)),                      # empty draft = target-only step
])
def test_verify_coupled_cases(draft, target, expected):
    """With flat noise the target's choice is argmax p: coupled verification reduces to greedy."""
    p = np.full((len(target), 10), 0.01)
    p[np.arange(len(target)), target] = 0.5
    drawn: list[int] = []

    def noise(i):
        drawn.append(i)
        return np.ones(10)

    assert verify_coupled(draft, p / p.sum(-1, keepdims=True), noise) == expected
    assert drawn == list(range(expected[0] + 1))  # no noise drawn after the first rejection


def test_verify_coupled_emits_the_target_only_tokens():
    """Whatever the draft proposes, the emitted block is the target's own Gumbel-max choices."""
    rng = np.random.default_rng(5)
    for trial in range(300):
        k = int(rng.integers(0, 5))
        p = rng.dirichlet(np.full(6, 0.5), size=k + 1)
        y = [coupled_choice(p[i], exponential_noise(trial, 40 + i, 6)) for i in range(k + 1)]
        draft = [t if rng.random() < 0.7 else int(rng.integers(6)) for t in y[:k]]
        n, nxt = verify_coupled(draft, p, lambda i: exponential_noise(trial, 40 + i, 6))
        assert [*draft[:n], nxt] == y[:n + 1]


def test_verify_coupled_shapes_checked():
    with pytest.raises(ValueError, match="p must be"):
        verify_coupled([1, 2], np.ones((2, 4)) / 4, lambda i: np.ones(4))
    with pytest.raises(ValueError, match="same shape"):
        coupled_choice(np.ones(4) / 4, np.ones(5))


def test_verify_coupled_computes_only_the_rows_it_reaches():
    """p given as a callable: the rows after the first rejection are never computed (their softmax over a large
    vocabulary is the host's main cost of a sampled block), and the result equals the array form's."""
    rng = np.random.default_rng(3)
    p = rng.random((5, 6))
    p /= p.sum(-1, keepdims=True)
    for trial in range(50):
        noise = lambda i: exponential_noise(trial, 7 + i, 6)  # noqa: E731
        y = [coupled_choice(p[i], noise(i)) for i in range(5)]
        draft = [y[0], (y[1] + 1) % 6, *y[2:4]]  # rejected at position 1
        asked = []
        lazy = verify_coupled(draft, lambda i: asked.append(i) or p[i], noise)
        assert lazy == verify_coupled(draft, p, noise) == (1, y[1]) and asked == [0, 1]


# -- marginals: a chi-square test over seeds -----------------------------------------------------------
N_SEEDS = 20_000
P = np.array([0.05, 0.30, 0.0, 0.25, 0.15, 0.0, 0.25])
Q = np.array([0.10, 0.10, 0.35, 0.05, 0.05, 0.30, 0.05])  # much of q's mass where p has none
P2 = np.vstack([P, np.full(7, 1 / 7)])  # k = 1: p_1 and the bonus distribution p_2


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, "a token with target probability 0 was emitted"
    return sps.chisquare(counts[support], probs[support] * counts.sum()).pvalue


def _coupled_first_tokens(q: np.ndarray, verify: bool) -> tuple[np.ndarray, int]:
    """Over N_SEEDS seeds: the draft proposes argmax(log q + g) at position 0; returns (counts of the
    emitted first token, accepted count). verify=False emits the draft token unverified."""
    counts, accepted = np.zeros(7, dtype=np.int64), 0
    for seed in range(N_SEEDS):
        x = coupled_choice(q, exponential_noise(seed, 0, 7))
        n, tok = verify_coupled([x], P2, lambda i: exponential_noise(seed, i, 7))
        accepted += n
        counts[(x if n == 1 else tok) if verify else x] += 1
    return counts, accepted


def test_coupled_first_token_follows_p():
    """20,000 seeds, fixed p and q: the emitted first token's distribution matches p (chi-square,
    p-value > 1e-3), a zero-probability token is never emitted, and acceptance cannot beat the maximal
    coupling, sum(min(p, q))."""
    counts, accepted = _coupled_first_tokens(Q, verify=True)
    assert _chi2_pvalue(counts, P) > 1e-3
    assert accepted / N_SEEDS <= np.minimum(P, Q).sum() + 0.01


def test_chi_square_detects_a_wrong_sampler():
    """Control: emitting the draft's coupled choice unverified follows q, and the same test fails it."""
    counts, _ = _coupled_first_tokens(np.where(P > 0, Q, 0.0) / Q[P > 0].sum(), verify=False)
    assert _chi2_pvalue(counts, P) < 1e-6


def test_coupled_weights_sample_the_distribution():
    """20,000 seeds: argmax(coupled_weights / E) at temperature 0.5 follows softmax(logits / 0.5) (chi-square)."""
    logits = np.log(np.where(P > 0, P, 1e-300)).astype(np.float32) * 0.5  # softmax(logits / 0.5) = P
    params = SamplingParams(temperature=0.5, sampling="coupled")
    counts = np.zeros(7, dtype=np.int64)
    for seed in range(N_SEEDS):
        counts[coupled_choice(coupled_weights(logits, params), exponential_noise(seed, 0, 7))] += 1
    assert _chi2_pvalue(counts, P) > 1e-3


def test_q_equal_to_p_accepts_everything():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(50, 0.3), size=5)  # k = 4
    for seed in range(500):
        draft = [coupled_choice(p[i], exponential_noise(seed, 9 + i, 50)) for i in range(4)]
        n, _ = verify_coupled(draft, p, lambda i: exponential_noise(seed, 9 + i, 50))
        assert n == 4


# -- the ONNX drafter in coupled mode ------------------------------------------------------------------
SEQ = [5, 17, 33, 2, 99, 100, 7]


def test_onnx_drafter_coupled_sends_tokens_only(llama_copy_onnx):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=2**40 + 3, sampling="coupled")
    d = OnnxDrafter(llama_copy_onnx)
    d.begin(SEQ, params)
    draft = d.propose(3)
    assert draft.probs is None and len(draft.ids) == 3
    fresh = OnnxDrafter(llama_copy_onnx)
    logits = fresh.append(SEQ + draft.ids[:2])[-3:]
    q = logits_to_probs(logits, params)
    assert draft.ids == [coupled_choice(q[i], exponential_noise(params.seed, len(SEQ) + i, q.shape[1]))
                         for i in range(3)]
    d.begin(SEQ, params)
    streamed = d.extend(3)
    assert streamed.probs is None and streamed.ids == draft.ids


# -- end to end: seeded identity across drafts and gamma -----------------------------------------------
PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [40, 41, 42, 43, 44, 40, 41, 42]]
MAX_NEW = 40
SETTINGS = [{"temperature": 0.8}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9}]
SEED = 11


@pytest.fixture(scope="module")
def coupled_engines(llama_target, llama_copy_onnx, llama_random_onnx):
    from tests.test_engine_greedy import make_llama_engines

    yield from make_llama_engines(llama_target, llama_copy_onnx, llama_random_onnx, sampling="coupled")


def hf_coupled(model_dir, prompt: list[int], max_new: int, seed: int, settings: dict) -> list[int]:
    """Reference: the target alone in transformers, one full forward per token (no cache), choosing
    argmax(log p + g) with g = gumbel_noise(seed, absolute position); stops after EOS (id 0)."""
    model, params = _hf_model(model_dir), SamplingParams(seed=seed, sampling="coupled", **settings)
    ids = list(prompt)
    while len(ids) - len(prompt) < max_new:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1:].numpy()
        p = logits_to_probs(logits, params)[0]
        with np.errstate(divide="ignore"):
            ids.append(int(np.argmax(np.log(p) + gumbel_noise(seed, len(ids), p.shape[0]))))
        if ids[-1] == 0:
            break
    return ids[len(prompt):]


@pytest.mark.parametrize("settings", SETTINGS, ids=["t0.8", "t0.8-k20-p0.9"])
def test_coupled_seeded_identity(coupled_engines, llama_target, settings):
    for prompt in PROMPTS:
        ref = coupled_engines["none"].generate(prompt, max_new_tokens=MAX_NEW, seed=SEED, **settings)
        assert ref.token_ids == hf_coupled(llama_target, prompt, MAX_NEW, SEED, settings)
        for draft in ("copy", "random", "ngram"):
            for gamma in (1, 4, 8):
                out = coupled_engines[draft].generate(prompt, max_new_tokens=MAX_NEW, seed=SEED, gamma=gamma,
                                                      **settings)
                assert out.token_ids == ref.token_ids, (draft, gamma)
                if draft == "copy":  # the draft is the target in ONNX: (almost) every token is accepted
                    assert out.stats["acceptance_rate"] >= 0.95, gamma
                if draft == "random":  # an unrelated draft: many rejections, same output
                    assert out.stats["acceptance_rate"] <= 0.6, gamma


def test_coupled_seeds_differ(coupled_engines):
    eng = coupled_engines["none"]
    a = eng.generate(PROMPTS[0], max_new_tokens=MAX_NEW, temperature=0.8, seed=SEED).token_ids
    b = eng.generate(PROMPTS[0], max_new_tokens=MAX_NEW, temperature=0.8, seed=SEED + 2**48).token_ids
    assert a != b


# -- the bench's sampled mode ----------------------------------------------------------------------------
def test_bench_sampled_coupled_equals_engine_target_only(tmp_path, llama_target, llama_random_onnx):
    from hetero_spec.bench import BenchSettings, run_bench

    cfg = tmp_path / "random.yaml"
    cfg.write_text(f"target: {{model: {llama_target}, threads: 1}}\n"
                   f"draft: {{kind: onnx, model: {llama_random_onnx}}}\nspeculation: {{gamma: 3}}\n")
    out = tmp_path / "bench"
    report = run_bench(BenchSettings(config=cfg, out=out, prompts=2, max_new_tokens=12,
                                     systems=["target_only", "hetero_spec", "hetero_spec_target_only"],
                                     temperature=0.8, sampling="coupled"), prompt_ids=PROMPTS)
    names = [e["name"] for e in report["systems"]]
    assert names == ["target_only", "hetero_spec", "hetero_spec_target_only"]
    hs = next(e for e in report["systems"] if e["name"] == "hetero_spec")
    assert hs["status"] == "ok" and hs["identical_to_hetero_spec_target_only"] == 2
    assert hs["tokens_per_round"] >= 1.0 and 0.0 <= hs["acceptance_rate"] < 1.0
    assert hs["speedup_vs_hetero_spec_target_only"] > 0
    s = report["settings"]
    assert (s["temperature"], s["sampling"], s["seed"]) == (0.8, "coupled", 0)
    assert "--temperature 0.8 --sampling coupled" in s["command"]
    assert "2 of 2 prompts" in (out / "bench.md").read_text()
