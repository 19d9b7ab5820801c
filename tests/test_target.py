"""PyTorch verifier: one-pass block verification equals step-by-step logits; rollback; staging on CPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hetero_spec.errors import ModelLoadError
from hetero_spec.target.staging import Staging
from hetero_spec.target.verifier import TargetModel

SEQ = [5, 17, 33, 2, 99, 100, 7, 8, 9]


@pytest.fixture(scope="module")
def target(llama_target):
    return TargetModel(llama_target, device="cpu", dtype="float32")


def test_block_verification_matches_single_steps(target):
    a = target.new_state()
    target.prefill(a, SEQ[:5])
    block = target.forward(a, SEQ[4:])  # last prompt token + 4 "draft" tokens, one pass
    b = target.new_state()
    target.prefill(b, SEQ[:5])
    steps = torch.stack([target.forward(b, [t])[0] for t in SEQ[4:]])
    torch.testing.assert_close(block, steps, rtol=1e-4, atol=1e-4)


def test_rollback_then_reverify_equals_fresh(target):
    s = target.new_state()
    target.forward(s, SEQ[:6])
    target.forward(s, [1, 2, 3])  # rejected draft tokens
    target.rollback(s, 6)
    assert s.n_cached == 6 and s.cache.get_seq_length() == 6
    again = target.forward(s, SEQ[6:])
    fresh = target.forward(target.new_state(), SEQ)[6:]
    torch.testing.assert_close(again, fresh, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cannot roll back"):
        target.rollback(s, 100)


def test_cpu_staging_is_a_plain_copy():
    st = Staging(torch.device("cpu"))
    assert not st.pinned
    t = st.tokens([1, 2, 3])
    assert t.shape == (1, 3) and t.dtype == torch.long and st.copies == 0


class _FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")

    def wait_event(self, event):
        self.log.append(f"{self.name} waits copy")


class _FakeEvent:
    def __init__(self, st, log):
        self.st, self.log = st, log

    def synchronize(self):  # records what the pinned buffer holds when the host waits
        self.log.append(f"host waits copy {self.st._tok_host[:3].tolist()}")

    def record(self, stream):
        self.log.append(f"copy on {stream.name} {self.st._tok_dev[:3].tolist()}")


def test_cuda_staging_orders_the_reused_buffers(monkeypatch):
    """The CUDA path's ordering, with fake streams: the host waits for the previous copy before it
    overwrites the pinned buffer; the side stream waits for the compute stream (an earlier forward
    may still read the device buffer) before copying; the compute stream waits for the copy."""
    log: list[str] = []
    st = Staging(torch.device("cpu"))
    st.cuda, st.device = True, torch.device("cpu")
    st._tok_host, st._tok_dev = torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long)
    st.stream, st._copied = _FakeStream("side", log), _FakeEvent(st, log)
    compute = _FakeStream("compute", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    assert st.tokens([1, 2, 3]).tolist() == [[1, 2, 3]]
    assert st.tokens([4, 5, 6]).tolist() == [[4, 5, 6]]
    assert log == ["host waits copy [0, 0, 0]", "side waits compute", "copy on side [1, 2, 3]", "compute waits copy",
                   "host waits copy [1, 2, 3]", "side waits compute", "copy on side [4, 5, 6]", "compute waits copy"]
    assert st.copies == 2


def test_prefill_ends_when_the_device_is_done(target, monkeypatch):
    """A timed prefill must not leave its GPU work to the first verify: on CUDA the staging syncs the device
    after the prefill's pass (here the CUDA path is faked: cuda on, synchronize recorded)."""
    log: list[str] = []
    st = Staging(torch.device("cpu"))
    monkeypatch.setattr(target, "staging", st)
    real_forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: (log.append("forward"), real_forward(*a, **k))[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("synchronize"))
    st.sync()
    assert log == []  # a CPU staging has nothing to wait for
    st.cuda = True
    st.tokens = lambda ids: torch.tensor([ids], dtype=torch.long)
    state = target.new_state()
    target.prefill(state, SEQ[:5])
    assert log == ["forward", "synchronize"] and state.n_cached == 4
    target.prefill(target.new_state(), SEQ[:1])  # a one-token prompt queues nothing: no wait
    assert log == ["forward", "synchronize"]


def test_cuda_on_a_cpu_build_is_a_clear_error(llama_target):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        TargetModel(llama_target, device="cuda")


class _PastKeyValuesLlama(__import__("transformers").LlamaForCausalLM):
    """transformers 5.17's signature (the GPU machine's image): the KV cache comes as past_key_values=. A cache
    passed as cache= would land in **kwargs and be dropped, so that raises."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        assert "cache" not in kwargs, "the cache was passed by a keyword this forward does not take"
        assert past_key_values is not None, "no KV cache was given"
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)


class _NoCacheLlama(__import__("transformers").LlamaForCausalLM):
    def forward(self, input_ids=None, **kwargs):
        return super().forward(input_ids=input_ids, **kwargs)


def _load_as(monkeypatch, cls):
    from hetero_spec.target import verifier

    monkeypatch.setattr(verifier, "AutoModelForCausalLM", cls)


def test_the_cache_goes_by_cache_on_this_transformers(target):
    assert target.cache_kw == "cache"


def test_the_cache_goes_by_past_key_values_where_forward_takes_that(llama_target, target, monkeypatch):
    _load_as(monkeypatch, _PastKeyValuesLlama)
    old = TargetModel(llama_target, device="cpu", dtype="float32")
    assert type(old.model) is _PastKeyValuesLlama and old.cache_kw == "past_key_values"
    # the same numbers as the cache= path: prefill, a block verified, a rejection rolled back, a batched pass
    results = {}
    for t in (target, old):
        a, b = t.new_state(), t.new_state()
        t.prefill(a, SEQ[:5])
        t.prefill(b, SEQ[:3])
        out = [t.forward(a, SEQ[4:])]
        t.rollback(a, 6)
        out.append(t.forward(a, [1, 2]))
        out += [torch.as_tensor(r) for r in t.verify_batch([(a, 3, [4, 5]), (b, SEQ[2], [6])], greedy=[False, False])]
        assert (a.n_cached, b.n_cached) == (11, 4)
        results[t.cache_kw] = out
    assert len(results["past_key_values"]) == 4
    for got, want in zip(results["past_key_values"], results["cache"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_forward_that_takes_no_cache_is_refused(llama_target, monkeypatch):
    _load_as(monkeypatch, _NoCacheLlama)
    with pytest.raises(ModelLoadError, match="neither cache= nor past_key_values="):
        TargetModel(llama_target, device="cpu", dtype="float32")
