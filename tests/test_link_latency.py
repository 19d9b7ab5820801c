"""What a slow link does to the two-process layout: with a one-way latency injected in the fake transport
(tests/fixtures/memworker, fake time), the worker source measures it as the proposals' transfer time; the cost
model then turns speculation off exactly where that time passes its break-even. No wall clock is asserted on."""

from __future__ import annotations

import pytest

from hetero_spec.tuning.cost_model import CostModel
from tests.fixtures.memworker import mem_engine, worker_of

PROMPT = "def read_lines(filename):"


def _cfg(target, draft):
    return {"target": {"model": str(target), "dtype": "float32", "device": "cpu"},
            "draft": {"kind": "onnx", "model": str(draft)}, "speculation": {"gamma": 4},
            "runtime": {"mode": "two_process", "heartbeat_s": 1e6}}


@pytest.mark.parametrize("latency_ms", [0.2, 1.0, 5.0])
def test_the_link_measures_an_injected_latency_as_transfer_time(monkeypatch, llama_target, llama_copy_onnx,
                                                                 latency_ms):
    eng, launcher = mem_engine(monkeypatch, _cfg(llama_target, llama_copy_onnx), llama_copy_onnx,
                               latency_s=latency_ms / 1e3, tick_s=1e-6)
    with eng:
        out = eng.generate(PROMPT, max_new_tokens=32, temperature=0.0)
        assert out.stats["drafted"] > 0
        transfer = worker_of(eng).costs().transfer_s
    # each waited-for proposal took the latency to arrive, plus the fake clock's few ticks
    assert latency_ms / 1e3 <= transfer <= latency_ms / 1e3 + 1e-4


def test_speculation_turns_off_where_transfer_passes_its_break_even():
    # the demo pair's order of magnitude on this machine: a 5.5 ms step, 0.3 ms per verified token, 1 ms a draft
    model = CostModel(verify_fixed_s=0.0052, verify_per_token_s=0.0003, draft_token_s=0.001)
    for a in (0.5, 0.7, 0.9):
        even = model.break_even_transfer_s(a)
        assert even > 0
        below = CostModel(**{**model.to_dict(), "transfer_s": even * 0.99})
        above = CostModel(**{**model.to_dict(), "transfer_s": even * 1.01})
        assert below.best_gamma(a, "two_process")[0] > 0
        assert above.best_gamma(a, "two_process")[0] == 0
    # a worse draft affords less latency
    assert model.break_even_transfer_s(0.5) < model.break_even_transfer_s(0.9)
