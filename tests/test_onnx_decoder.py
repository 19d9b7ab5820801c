"""The shared ONNX decoder runner (onnx_decoder.py): the in-place shared-buffer layout computes exactly what
the copy layout does through appends, rollbacks at every position of a block and buffer growth, and so
do its one-token steps, whose buffers stay bound."""

from __future__ import annotations

import numpy as np
import pytest

from hetero_spec.onnx_decoder import OnnxDecoder
from hetero_spec.target.onnx_backend import OnnxTarget

PROMPT = [5, 17, 33, 2, 99, 100, 7, 8, 9, 11, 12]
BLOCK = [40, 41, 42, 43, 44, 45, 46, 47, 48]  # [last, d1..d8]


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request, llama_copy_onnx, qwen2_copy_onnx):
    return {"llama": llama_copy_onnx, "qwen2": qwen2_copy_onnx}[request.param]


def _pair(model_dir):
    shared = OnnxDecoder(model_dir, shared_buffer=True)
    shared.initial_capacity = 4  # force several buffer growths within the test's lengths
    copy = OnnxDecoder(model_dir, shared_buffer=False)
    assert (shared.layout, copy.layout) == ("shared", "copy")
    return shared, copy


def test_builder_exports_declare_the_shared_layout(model_dir):
    assert OnnxDecoder(model_dir).layout == "shared"  # the default on the CPU provider


def test_shared_layout_equals_copy_layout_through_growth_and_rollback(model_dir):
    shared, copy = _pair(model_dir)
    rng = np.random.default_rng(0)
    s, c = shared.new_state(), copy.new_state()
    np.testing.assert_allclose(shared.append(s, PROMPT), copy.append(c, PROMPT), rtol=1e-5, atol=1e-5)
    for step in range(12):
        keep = int(rng.integers(max(1, s.n_past - 6), s.n_past + 1))
        shared.rewind(s, keep)
        copy.rewind(c, keep)
        toks = rng.integers(0, 250, int(rng.integers(1, 10))).tolist()
        np.testing.assert_allclose(shared.append(s, toks), copy.append(c, toks), rtol=1e-5, atol=1e-5,
                                   err_msg=f"step {step}")
        assert s.n_past == c.n_past
    assert s.capacity >= s.n_past > 16  # grew from 4 several times


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copy"])
def test_rollback_after_a_rejection_at_every_position_of_a_block(model_dir, shared):
    """Verify a block, keep the first j + 1 positions (j drafts accepted), feed the correction: the logits
    equal those of a state that never saw the rejected tokens."""
    t = OnnxTarget(model_dir)
    t.decoder = OnnxDecoder(model_dir, shared_buffer=shared)
    t.decoder.initial_capacity = 8
    for j in range(len(BLOCK)):
        st = t.new_state()
        t.prefill(st, PROMPT)
        base = st.n_cached
        t.verify(st, BLOCK[0], BLOCK[1:], greedy=True)
        t.rollback(st, base + j + 1)
        got = t.forward(st, [200 + j, 201])
        fresh = t.new_state()
        t.prefill(fresh, PROMPT)
        want = t.forward(fresh, [*BLOCK[:j + 1], 200 + j, 201])[-2:]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"rejected at {j}")


def test_one_token_steps_keep_their_buffers_bound_and_equal_the_copy_layout(model_dir):
    """One-token steps rewrite buffers bound once (DecoderState.step): through several-token runs (which rebind
    those names), rewinds, buffer growth and a KV pool's growth, every step's logits equal the copy
    layout's, and logits already returned are never overwritten by a later step."""
    shared, copy = _pair(model_dir)
    pool = shared.new_pool(2)
    states = [shared.new_state(), pool.acquire(), pool.acquire()]
    refs = [copy.new_state() for _ in states]
    for s, c in zip(states, refs):
        shared.append(s, PROMPT)
        copy.append(c, PROMPT)
    rng = np.random.default_rng(1)
    kept: list[tuple[np.ndarray, np.ndarray]] = []
    for step in range(40):
        i = step % 3
        s, c = states[i], refs[i]
        if step % 7 == 6:  # a block, then a rollback into it
            toks = rng.integers(0, 250, 4).tolist()
            shared.append(s, toks)
            copy.append(c, toks)
            keep = s.n_past - int(rng.integers(1, 4))
            shared.rewind(s, keep)
            copy.rewind(c, keep)
        tok = int(rng.integers(0, 250))
        got = shared.append(s, [tok])
        want = copy.append(c, [tok])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"step {step}, state {i}")
        kept.append((got, got.copy()))
        assert s.n_past == c.n_past
    assert s.step is not None and states[0].capacity > 16  # stepped on bound buffers; grew from 4
    assert pool.capacity > 16  # the pool grew too (every slot rebound)
    for got, snapshot in kept:
        np.testing.assert_array_equal(got, snapshot)


class _CountingSession:
    """A session that counts its runs (to see which session ran what)."""

    def __init__(self, session):
        self.session, self.runs = session, 0

    def io_binding(self):
        return self.session.io_binding()

    def run_with_iobinding(self, io):
        self.runs += 1
        return self.session.run_with_iobinding(io)

    def run(self, *args):
        self.runs += 1
        return self.session.run(*args)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copy"])
def test_a_prefill_on_more_threads_writes_the_cache_the_decoding_session_reads(model_dir, shared):
    """prefill_threads: runs marked wide go to a second session with more threads, bound to the same KV buffers
    (a state of its own, and slots of a KV pool). Its logits, and every later step and block that reads the cache
    it wrote, equal a decoder with one session exactly; only the wide runs of several tokens go to it."""
    dec = OnnxDecoder(model_dir, threads=1, prefill_threads=2, shared_buffer=shared)
    ref = OnnxDecoder(model_dir, threads=1, shared_buffer=shared)
    assert dec.prefill_threads == 2 and ref._wide is None
    assert OnnxDecoder(model_dir, threads=2, prefill_threads=2)._wide is None  # no more threads: no second session
    dec.initial_capacity = ref.initial_capacity = 8  # the wide prefill grows the buffers
    dec._wide = wide = _CountingSession(dec._wide)
    prompts = [PROMPT * 2, PROMPT[::-1], [3, 1, 4, 1, 5, 9, 2, 6]]
    states = [dec.new_state()]
    refs = [ref.new_state()]
    if shared:
        pool, ref_pool = dec.new_pool(2), ref.new_pool(2)
        states += [pool.acquire(), pool.acquire()]
        refs += [ref_pool.acquire(), ref_pool.acquire()]
    for s, r, p in zip(states, refs, prompts):
        np.testing.assert_array_equal(dec.append(s, p, wide=True), ref.append(r, p))
    assert wide.runs == len(states)
    rng = np.random.default_rng(2)
    for step in range(24):
        i = step % len(states)
        toks = rng.integers(0, 250, 1 if step % 4 else 5).tolist()
        np.testing.assert_array_equal(dec.append(states[i], toks, wide=len(toks) == 1), ref.append(refs[i], toks),
                                      err_msg=f"step {step}, state {i}")
        if step % 4 == 0:
            dec.rewind(states[i], states[i].n_past - 2)
            ref.rewind(refs[i], refs[i].n_past - 2)
    assert wide.runs == len(states)  # one-token runs and unmarked blocks stay on the decoding session


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copy"])
def test_last_only_runs_the_lm_head_on_one_position_and_changes_nothing_else(model_dir, shared, tmp_path):
    """Exports get an input `logits_from` (the runner graph, draft/export.add_runner_graph): a last_only run returns
    the last row alone, equal to that row of a full run, and leaves the same cache; a graph without the input (an
    export made before it) runs as before."""
    import shutil

    from hetero_spec.draft.export import RUNNER_MODEL, add_runner_graph

    dec = OnnxDecoder(model_dir, shared_buffer=shared)
    assert dec.has_logits_from and not add_runner_graph(model_dir)  # the fixture's export has it already
    old_dir = tmp_path / "old"
    shutil.copytree(model_dir, old_dir)
    (old_dir / RUNNER_MODEL).unlink()  # an export made before: model.onnx alone
    old = OnnxDecoder(old_dir, shared_buffer=shared)
    assert not old.has_logits_from and not old.has_tree
    a, b = dec.new_state(), old.new_state()
    last, full = dec.append(a, PROMPT, last_only=True), old.append(b, PROMPT)
    assert last.shape == (1, full.shape[1]) and full.shape[0] == len(PROMPT)
    np.testing.assert_allclose(last[0], full[-1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dec.append(a, BLOCK), old.append(b, BLOCK), rtol=1e-5, atol=1e-5)  # same cache
    np.testing.assert_allclose(dec.append(a, [3]), old.append(b, [3]), rtol=1e-5, atol=1e-5)  # a step after
    assert add_runner_graph(old_dir) and OnnxDecoder(old_dir).has_logits_from  # an old export upgraded


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copy"])
def test_a_token_tree_verifies_each_path_as_its_own_chain(model_dir, shared):
    """append_tree: a root, two chains and a branch off the first (parents in topological order) in one pass; each
    token's logits equal those of the chain from the root to it, run alone; a kept path moved into place (move +
    rewind) leaves the cache that chain leaves, so the next step's logits agree too."""
    dec = OnnxDecoder(model_dir, shared_buffer=shared)
    assert dec.has_tree
    tree = dec.new_state()
    dec.append(tree, PROMPT)
    past = tree.n_past
    #        0   1   2   3   4   5   6
    tokens = [40, 41, 50, 42, 51, 43, 60]
    parents = [-1, 0, 0, 1, 2, 3, 1]  # chains 40-41-42-43 and 40-50-51; 60 branches off 41
    out = dec.append_tree(tree, tokens, parents)
    assert out.shape[0] == len(tokens) and tree.n_past == past + len(tokens)
    for path in ([0, 1, 3, 5], [0, 2, 4], [0, 1, 6]):
        chain = dec.new_state()
        dec.append(chain, PROMPT)
        ref = dec.append(chain, [tokens[i] for i in path])
        np.testing.assert_allclose(out[path], ref, rtol=1e-4, atol=1e-4)
    # keep the path 40-50-51 (nodes 0, 2, 4): move nodes 2 and 4 to past + 1 and past + 2
    for depth, node in enumerate([2, 4], 1):
        dec.move(tree, past + node, past + depth)
    dec.rewind(tree, past + 3)
    chain = dec.new_state()
    dec.append(chain, PROMPT + [40, 50, 51])
    np.testing.assert_allclose(dec.append(tree, [7]), dec.append(chain, [7]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dec.append(tree, [8, 9]), dec.append(chain, [8, 9]), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="parent"):
        dec.append_tree(tree, [1, 2], [-1, 1])
