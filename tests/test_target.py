"""PyTorch verifier: one-pass block verification equals step-by-step logits; rollback; staging on CPU."""

from __future__ import annotations

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


def test_cuda_on_a_cpu_build_is_a_clear_error(llama_target):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        TargetModel(llama_target, device="cuda")
