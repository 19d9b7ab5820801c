"""Token trees (draft.second_choices): the draft's second choices verified beside its chain in one pass. Output
equals the ONNX target alone's, greedy and seeded coupled sampling, when second choices are taken (a draft made to
put the target's token second) and when they are mostly wrong (a random draft)."""

from __future__ import annotations

import pytest

from hetero_spec import Engine
from hetero_spec.draft.onnx_drafter import OnnxDrafter
from tests.test_onnx_target import PROMPTS, _cfg

MAX_NEW = 40


class SecondBest(OnnxDrafter):
    """A drafter that swaps its first token and that token's second choice: with a draft equal to the target, the
    chain is then wrong at once and the second choice is the target's token."""

    def spawn(self) -> OnnxDrafter:
        new = super().spawn()
        new.__class__ = SecondBest
        return new

    def propose(self, k: int):
        draft = super().propose(k)
        if draft.alts and draft.alts[0][0] == 0:
            (j, alt), first = draft.alts[0], draft.ids[0]
            draft.ids[0], draft.alts[0] = alt, (0, first)
            self._proposed = draft.ids
        return draft


def _engines(target, draft, **extra):
    alone = Engine.from_config(_cfg(target, "none"))
    tree = Engine.from_config(_cfg(target, "onnx", draft, **{"draft.second_choices": 2, **extra}))
    return alone, tree


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "coupled"])
def test_second_choices_taken_keep_the_target_s_output(llama_copy_onnx, temperature):
    alone, tree = _engines(llama_copy_onnx, llama_copy_onnx, **{"speculation.sampling": "coupled"})
    with alone, tree:
        assert tree.target.supports_tree and tree.source.proposer.second_choices == 2
        tree.source.proposer.__class__ = SecondBest
        for seed, prompt in enumerate(PROMPTS):
            ref = alone.generate(prompt, max_new_tokens=MAX_NEW, temperature=temperature, seed=seed)
            for gamma in (1, 3):
                out = tree.generate(prompt, max_new_tokens=MAX_NEW, gamma=gamma, temperature=temperature, seed=seed)
                assert out.token_ids == ref.token_ids
                stats = out.stats
                assert stats["second_choices"] > 0 and stats["second_choices_taken"] > 0
                # every drafting round took its swapped second choice: 2 tokens a round (the choice and the next)
                assert stats["second_choices_taken"] >= stats["rounds"] - 2


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "coupled"])
def test_second_choices_of_a_random_draft_keep_the_target_s_output(llama_copy_onnx, llama_random_onnx, temperature):
    alone, tree = _engines(llama_copy_onnx, llama_random_onnx, **{"speculation.sampling": "coupled"})
    with alone, tree:
        for seed, prompt in enumerate(PROMPTS):
            ref = alone.generate(prompt, max_new_tokens=MAX_NEW, temperature=temperature, seed=seed)
            for gamma in (2, 4):
                out = tree.generate(prompt, max_new_tokens=MAX_NEW, gamma=gamma, temperature=temperature, seed=seed)
                assert out.token_ids == ref.token_ids
                assert out.stats["second_choices"] > 0


def test_stop_token_and_max_new_tokens_inside_a_tree_round(llama_copy_onnx):
    """max_new_tokens reached on the taken second choice, and a stop token there: the output ends as the
    target alone's does."""
    alone, tree = _engines(llama_copy_onnx, llama_copy_onnx)
    with alone, tree:
        tree.source.proposer.__class__ = SecondBest
        ref = alone.generate(PROMPTS[0], max_new_tokens=MAX_NEW, temperature=0.0)
        for n in (1, 2, 3, 7):
            out = tree.generate(PROMPTS[0], max_new_tokens=n, gamma=2, temperature=0.0)
            assert out.token_ids == ref.token_ids[:n] and out.finish_reason == "length"
        stop = ref.token_ids[5]
        first = ref.token_ids.index(stop)
        out = tree.generate(PROMPTS[0], max_new_tokens=MAX_NEW, gamma=2, temperature=0.0, stop_token_ids=[stop])
        assert out.token_ids == ref.token_ids[:first + 1] and out.finish_reason == "stop"


def test_a_tree_never_caches_past_the_context(llama_copy_onnx):
    """Near the context's end the siblings would take positions past it: the round verifies the chain alone, and
    the output still ends at the context as the target alone's does."""
    alone, tree = _engines(llama_copy_onnx, llama_copy_onnx)
    with alone, tree:
        tree.source.proposer.__class__ = SecondBest
        ctx = tree.target.context_len
        prompt = list(range(10, 10 + ctx - 13))
        ref = alone.generate(prompt, max_new_tokens=100, temperature=0.0)
        out = tree.generate(prompt, max_new_tokens=100, gamma=4, temperature=0.0)
        assert out.token_ids == ref.token_ids and out.finish_reason == "context" == ref.finish_reason
        assert len(prompt) + len(out.token_ids) == ctx and out.stats["second_choices_taken"] > 0
