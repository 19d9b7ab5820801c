"""The target alone with one greedy request runs several steps a round (Scheduler._plain_run, Verifier.greedy_steps):
the tokens are those of transformers' greedy generate, with max_new_tokens, a stop token and the context limit
reached inside a run. PLAIN_RUN_S is set huge so every run is PLAIN_STEPS_MAX steps or what the room allows: the
run lengths asserted follow from the request alone, never from a clock."""

from __future__ import annotations

import pytest

from hetero_spec import Engine, scheduler
from tests.conftest import hf_greedy

PROMPT = [5, 17, 33, 2, 99, 100, 7]
MAX_NEW = 40


def _engine(target, backend: str, **target_cfg) -> Engine:
    """The target alone, after a first request of one step: a run's length needs the step's time (the first run
    of an engine is one step)."""
    eng = Engine.from_config({"target": {"model": str(target), "dtype": "float32", "backend": backend, **target_cfg},
                              "draft": {"kind": "none"}})
    eng.generate(PROMPT, max_new_tokens=1, temperature=0.0)
    return eng


def _spy(eng: Engine, monkeypatch) -> list[int]:
    """The n of every greedy_steps call the engine's target gets."""
    runs, real = [], eng.target.greedy_steps

    def greedy_steps(state, last_token, n):
        runs.append(n)
        return real(state, last_token, n)
    monkeypatch.setattr(eng.target, "greedy_steps", greedy_steps)
    return runs


@pytest.fixture(params=["onnx", "torch"])
def engine(request, llama_target, monkeypatch):
    monkeypatch.setattr(scheduler, "PLAIN_RUN_S", 1e9)
    with _engine(llama_target, request.param) as eng:
        yield eng


@pytest.mark.parametrize("max_new", [1, 7, 8, 13, MAX_NEW])
def test_runs_of_steps_give_the_target_s_greedy_tokens(engine, llama_target, monkeypatch, max_new):
    runs = _spy(engine, monkeypatch)
    free = hf_greedy(llama_target, PROMPT, MAX_NEW)
    ref = free[:free.index(0) + 1] if 0 in free[:max_new] else free[:max_new]  # the tiny model's EOS is 0
    out = engine.generate(PROMPT, max_new_tokens=max_new, temperature=0.0)
    assert out.token_ids == ref == hf_greedy(llama_target, PROMPT, max_new)
    # one run per PLAIN_STEPS_MAX tokens, the last one cut to the room left
    full = [scheduler.PLAIN_STEPS_MAX] * (max_new // scheduler.PLAIN_STEPS_MAX)
    assert runs[:len(full)] == full[:len(runs)] and sum(runs) >= len(ref)
    assert out.stats["rounds"] == out.stats["new_tokens"] == len(ref)  # a round a token, as one-step rounds count


def test_a_stop_token_inside_a_run_ends_it_there(engine, llama_target, monkeypatch):
    free = hf_greedy(llama_target, PROMPT, MAX_NEW)
    pos = next(i for i in range(3, MAX_NEW) if free[i] not in free[:i] and free[i] != 0
               and i % scheduler.PLAIN_STEPS_MAX != scheduler.PLAIN_STEPS_MAX - 1)  # not a run's last token
    runs = _spy(engine, monkeypatch)
    out = engine.generate(PROMPT, max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[free[pos]])
    assert out.token_ids == free[:pos + 1] and out.finish_reason == "stop"
    assert sum(runs) > pos + 1  # the last run went past the stop token
    # the engine goes on cleanly: the next request's state is fresh
    assert engine.generate(PROMPT, max_new_tokens=MAX_NEW, temperature=0.0).token_ids[:pos + 1] == free[:pos + 1]


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_the_context_limit_inside_a_run(llama_target, monkeypatch, backend):
    monkeypatch.setattr(scheduler, "PLAIN_RUN_S", 1e9)
    room = 11  # a run of 8, then one cut to 3 by the context
    with _engine(llama_target, backend, max_context=len(PROMPT) + room) as eng:
        runs = _spy(eng, monkeypatch)
        out = eng.generate(PROMPT, max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    assert out.token_ids == hf_greedy(llama_target, PROMPT, room, eos_token_id=eng.target.vocab_width - 1)
    assert out.finish_reason == "context" and runs == [8, 3]


def test_sampled_or_drafted_requests_run_one_pass_a_round(llama_target, llama_copy_onnx, monkeypatch):
    """Only greedy requests without a draft source take runs: a sampled request's round is one pass."""
    monkeypatch.setattr(scheduler, "PLAIN_RUN_S", 1e9)
    with _engine(llama_target, "onnx") as eng:
        runs = _spy(eng, monkeypatch)
        eng.generate(PROMPT, max_new_tokens=12, temperature=0.8, seed=3)
        assert runs == []
    with Engine.from_config({"target": {"model": str(llama_target), "dtype": "float32", "backend": "onnx"},
                             "draft": {"kind": "onnx", "model": str(llama_copy_onnx)}}) as eng:
        runs = _spy(eng, monkeypatch)
        out = eng.generate(PROMPT, max_new_tokens=12, temperature=0.0, gamma=3)
        assert runs == [] and out.token_ids == hf_greedy(llama_target, PROMPT, 12)


def test_a_resting_local_draft_lets_the_target_run_steps_until_its_re_probe(llama_target, llama_random_onnx,
                                                                             monkeypatch):
    """gamma auto with a draft that is never right: once the controller rests it, rounds at k 0 run as steps (up to
    the rounds before the re-probe), the draft hears every token, re-probes still come, and the output is the
    target's."""
    monkeypatch.setattr(scheduler, "PLAIN_RUN_S", 1e9)
    with Engine.from_config({"target": {"model": str(llama_target), "dtype": "float32", "backend": "onnx"},
                             "draft": {"kind": "onnx", "model": str(llama_random_onnx)},
                             "speculation": {"gamma": "auto"}, "runtime": {"mode": "in_process"}}) as eng:
        runs = _spy(eng, monkeypatch)
        probes = []
        real = eng.controller.plan

        def plan(*args, **kw):
            out = real(*args, **kw)
            probes.extend(row.k for row in out.rows if row.probing)
            return out
        monkeypatch.setattr(eng.controller, "plan", plan)
        for prompt in (PROMPT, [40, 41, 42, 43, 44, 40, 41, 42]):
            out = eng.generate(prompt, max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
            unused = eng.target.vocab_width - 1
            assert out.token_ids == hf_greedy(llama_target, prompt, MAX_NEW, eos_token_id=unused)
            assert out.stats["rounds"] <= MAX_NEW
    assert any(n > 1 for n in runs) and max(runs) <= scheduler.PLAIN_STEPS_MAX, runs
    assert probes  # the schedule still re-probes the draft
