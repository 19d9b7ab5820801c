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
                assert stats["tree_tokens"] > 0 and stats["tree_taken"] > 0
                # every drafting round took its swapped second choice: 2 tokens a round (the choice and the next)
                assert stats["tree_taken"] >= stats["rounds"] - 2


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "coupled"])
def test_second_choices_of_a_random_draft_keep_the_target_s_output(llama_copy_onnx, llama_random_onnx, temperature):
    alone, tree = _engines(llama_copy_onnx, llama_random_onnx, **{"speculation.sampling": "coupled"})
    with alone, tree:
        for seed, prompt in enumerate(PROMPTS):
            ref = alone.generate(prompt, max_new_tokens=MAX_NEW, temperature=temperature, seed=seed)
            for gamma in (2, 4):
                out = tree.generate(prompt, max_new_tokens=MAX_NEW, gamma=gamma, temperature=temperature, seed=seed)
                assert out.token_ids == ref.token_ids
                assert out.stats["tree_tokens"] > 0


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
        assert len(prompt) + len(out.token_ids) == ctx and out.stats["tree_taken"] > 0


def test_ngram_branches_merge_other_continuations_into_a_tree():
    """draft.ngram.branches: the chain continues the suffix's latest earlier occurrence; other occurrences, then
    shorter suffixes', become branches, shared prefixes merged, an occurrence already used (or one whose shorter
    suffix ends where a used one does) skipped, at most `branches` of them."""
    from hetero_spec.draft.ngram import NgramProposer
    from hetero_spec.sampling import SamplingParams
    text = [1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2, 3, 7, 9, 2, 8, 9, 1, 2]
    plain, tree = NgramProposer(max_n=3), NgramProposer(max_n=3, branches=3)
    for p in (plain, tree):
        p.begin(text, SamplingParams())
    chain, grown = plain.propose(3), tree.propose(3)
    assert chain.ids == grown.ids == [3, 7, 9] and chain.alts == [] and grown.match == 3
    # [5, 6, 9] (the suffix's older occurrence), [3, 4, 9] off the chain's first node (via [1, 2]), [8, 9, 1] (via [2])
    assert grown.alts == [(0, 5), (4, 6), (5, 9), (1, 4), (7, 9), (0, 8), (9, 9), (10, 1)]
    tree.branches = 1
    assert tree.propose(3).alts == [(0, 5), (4, 6), (5, 9)]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "coupled"])
def test_ngram_branches_keep_the_target_s_output(llama_copy_onnx, temperature):
    """Lookup branches taken (the text repeats with different continuations): output equal to the target alone's;
    a pass never takes more than TREE_MAX_TOKENS tokens. Coupled with top_k 1: the fixture's random target samples
    nearly uniformly, so only a one-token support makes its tokens follow the text (the coupled path all the same:
    weights, noise, and the walk by the coupled choice)."""
    top_k = 1 if temperature else 0
    from hetero_spec import scheduler
    alone = Engine.from_config(_cfg(llama_copy_onnx, "none"))
    tree = Engine.from_config(_cfg(llama_copy_onnx, "ngram", **{"draft.ngram": {"max_n": 3, "branches": 4},
                                                                 "speculation.sampling": "coupled"}))
    widest = []
    verify_tree = tree.target.verify_tree

    def spy(state, last, ids, alts, greedy):
        widest.append(1 + len(ids) + len(alts))
        return verify_tree(state, last, ids, alts, greedy)

    tree.target.verify_tree = spy
    prompt = [5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 11, 5, 12, 13, 5, 6]
    with alone, tree:
        taken = 0
        for seed, gamma in enumerate((2, 3, 4, 7)):
            ref = alone.generate(prompt, max_new_tokens=MAX_NEW, temperature=temperature, seed=seed, top_k=top_k)
            out = tree.generate(prompt, max_new_tokens=MAX_NEW, gamma=gamma, temperature=temperature, seed=seed,
                                top_k=top_k)
            assert out.token_ids == ref.token_ids
            taken += out.stats["tree_taken"]
            assert out.stats["tree_tokens"] > 0 or gamma == 7  # 1 + 7 tokens fill the pass: no room for branches
        assert taken > 0 and max(widest) <= scheduler.TREE_MAX_TOKENS


def test_the_walk_keeps_a_branch_two_nodes_deep_and_moves_both_into_place():
    """scheduler._decide_tree on a fake target: the chain's first token kept, then a branch off it two nodes deep;
    both branch nodes' cached positions move to the places the path gives them, then the cache is cut after them."""
    from hetero_spec.draft.base import Draft
    from hetero_spec.sampling import SamplingParams
    from hetero_spec.scheduler import decide_block

    class Target:
        def __init__(self):
            self.calls = []

        def move(self, state, src, dst):
            self.calls.append(("move", src, dst))

        def rollback(self, state, n_keep):
            self.calls.append(("rollback", n_keep))

    ids = list(range(100, 110))  # base 10: the pass fed ids[-1] at 9, then its nodes at 10, 11, ...
    a, b, c, x, y, z = 1, 2, 3, 4, 5, 6
    draft = Draft(ids=[a, b, c], alts=[(1, x), (4, y), (0, 9)])  # node 4: x after a; node 5: y after x; node 6
    out = {0: a, 1: x, 2: 0, 3: 0, 4: y, 5: z, 6: 0}  # the target's token after each node
    target = Target()
    accepted, next_token = decide_block(target, None, SamplingParams(), ids, draft, [out[i] for i in range(7)])
    assert (accepted, next_token) == (3, z) and draft.accepted_ids(accepted) == [a, x, y] and draft.chain_kept == 1
    assert target.calls == [("move", 13, 11), ("move", 14, 12), ("rollback", 13)]
    chain = Draft(ids=[a, b, c], alts=[(1, x)])
    assert decide_block(Target(), None, SamplingParams(), ids, chain, [a, b, c, 7, 0]) == (3, 7)
    assert chain.path is None and chain.accepted_ids(3) == [a, b, c]


def test_a_tree_cut_to_a_shorter_gamma_keeps_the_branches_within_it():
    """Draft.cut (draft selection asks a lookup at the row's cap, then drafts the plan's gamma): the chain and the
    branches that hang from kept nodes within the depth stay, renumbered; deeper nodes and their children go."""
    from hetero_spec.draft.base import Draft
    draft = Draft(ids=[1, 2, 3, 4], alts=[(0, 5), (5, 6), (6, 7), (2, 8), (3, 9), (1, 10)])
    # nodes: 1-4 the chain; 5: 5 after root; 6: 6 after 5; 7: 7 after 6 (depth 3); 8: 8 after node 2 (depth 3);
    # 9: 9 after node 3 (depth 4); 10: 10 after node 1 (depth 2)
    assert draft.cut(4) == (draft.ids, draft.alts)
    assert draft.cut(2) == ([1, 2], [(0, 5), (3, 6), (1, 10)])
    assert draft.cut(3) == ([1, 2, 3], [(0, 5), (4, 6), (5, 7), (2, 8), (1, 10)])
    assert draft.cut(1) == ([1], [(0, 5)])


def test_draft_selection_passes_a_lookup_s_branches_cut_to_the_plan_s_gamma():
    """SelectingSource asks the lookup at the row's cap (offers), then drafts the plan's gamma: the branches come
    through, cut to that depth."""
    from types import SimpleNamespace

    from hetero_spec.draft.ngram import NgramProposer
    from hetero_spec.draft.source import LocalSource, SelectingSource
    from hetero_spec.sampling import SamplingParams
    from hetero_spec.tuning.controller import RowPlan
    text = [1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2, 3, 7, 9, 2, 8, 9, 1, 2]
    source = SelectingSource({"ngram": LocalSource(NgramProposer(max_n=3, branches=3))})
    seq = SimpleNamespace(id=1, ids=list(text), params=SamplingParams(), prompt_ids=list(text))
    source.begin(seq)
    assert source.offers([seq], [3]) == [["ngram@3"]]
    (draft,) = source.propose([seq], [RowPlan(k=2, strategy="ngram@3")], 0.0)
    assert draft.ids == [3, 7] and draft.alts == [(0, 5), (3, 6), (1, 4), (0, 8), (6, 9)]
