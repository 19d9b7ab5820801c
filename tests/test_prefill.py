"""Chunked prefill (serving.prefill_chunk): a long prompt that arrives while other requests decode is cached a chunk
a round, so none of the running streams waits for all of it; outputs are unchanged. The "clock" is the prompt
tokens the target cached between two of a stream's rounds: no wall-clock outcome is asserted."""

from __future__ import annotations

import numpy as np
import pytest

from hetero_spec import Engine
from tests.fixtures.tiny_models import build_model
from tests.test_batch import Collect, held

CHUNK = 64


@pytest.fixture(scope="module")
def long_target(tmp_path_factory):
    """The tiny Llama with room for a 1,000-token prompt."""
    return build_model("llama_gqa", tmp_path_factory.mktemp("long") / "llama", seed=1, max_position_embeddings=1200)


def _engine(target, chunk: int, backend_cfg: dict | None = None) -> Engine:
    return Engine.from_config({"target": {"model": str(target), "dtype": "float32", "device": "cpu",
                                          **(backend_cfg or {})},
                               "draft": {"kind": "none"}, "runtime": {"mode": "in_process"},
                               "serving": {"max_batch": 4, "prefill_chunk": chunk}})


def _run(eng: Engine, long_prompt: list[int], short: list[list[int]]):
    """Three short requests decode; after their second round a long one arrives. Returns each one's tokens and the
    log of events: ("prefill", tokens cached) and ("round", stream)."""
    log: list[tuple[str, int]] = []
    real = eng.target.prefill

    def prefill(state, prompt_ids, start=0, stop=None):
        stop = len(prompt_ids) - 1 if stop is None else stop
        log.append(("prefill", stop - start))
        return real(state, prompt_ids, start, stop)

    eng.target.prefill = prefill
    long_sink = Collect()

    def arrive(n: int) -> None:
        if n == 2:  # in the scheduler's thread, between rounds: it joins at the next round
            eng.submit(long_prompt, long_sink, max_new_tokens=8)

    sinks = [Collect(on_chunk=(lambda n, i=i: (log.append(("round", i)), i == 0 and arrive(n))))
             for i in range(len(short))]
    with held(eng):
        for prompt, sink in zip(short, sinks):
            eng.submit(prompt, sink, max_new_tokens=30)
    outs = [sink.wait() for sink in sinks]
    return outs, long_sink.wait(), log


def _gaps(log: list[tuple[str, int]], stream: int) -> list[int]:
    """Prompt tokens the target cached between consecutive rounds of `stream`."""
    gaps, cached, seen = [], 0, False
    for kind, value in log:
        if kind == "prefill":
            cached += value
        elif value == stream:
            if seen:
                gaps.append(cached)
            cached, seen = 0, True
    return gaps


def test_a_long_prompt_delays_no_running_stream_by_more_than_two_chunks(long_target):
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(3, 380, 1000).tolist()
    short = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    with _engine(long_target, 0) as alone:
        want = [alone.generate(p, max_new_tokens=30).token_ids for p in short]
        want_long = alone.generate(long_prompt, max_new_tokens=8).token_ids
        whole = _run(alone, long_prompt, short)[2]
    assert max(max(_gaps(whole, i)) for i in range(3)) == 999  # unchunked: one round waited for all of it
    with _engine(long_target, CHUNK) as eng:
        outs, out_long, log = _run(eng, long_prompt, short)
    assert outs == want and out_long == want_long  # identical, chunked or not
    prefills = [n for kind, n in log if kind == "prefill"]
    assert sum(prefills[len(short):]) == 999 and max(prefills[len(short):]) <= CHUNK  # the long one, in chunks
    for i in range(3):
        assert max(_gaps(log, i)) <= 2 * CHUNK, (i, _gaps(log, i))


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_a_prefill_in_parts_equals_one_whole(llama_target, llama_copy_onnx, backend):
    """Both target backends: caching a prompt in chunks leaves the same state as caching it at once (the next
    verify's logits)."""
    if backend == "torch":
        from hetero_spec.target.verifier import TargetModel
        target = TargetModel(llama_target, device="cpu", dtype="float32")
    else:
        from hetero_spec.target.onnx_backend import OnnxTarget
        target = OnnxTarget(llama_copy_onnx)
    prompt = list(range(5, 45))
    whole, parts = target.new_state(), target.new_state()
    target.prefill(whole, prompt)
    for start in range(0, len(prompt) - 1, 7):
        target.prefill(parts, prompt, start, min(start + 7, len(prompt) - 1))
    a = np.asarray(target.verify(whole, prompt[-1], [1, 2, 3], greedy=False))
    b = np.asarray(target.verify(parts, prompt[-1], [1, 2, 3], greedy=False))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
