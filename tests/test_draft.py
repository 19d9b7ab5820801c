"""Proposers: ONNX drafter rollback and agreement with the PyTorch model; the n-gram proposer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hetero_spec.draft.export import ExportError, export_draft
from hetero_spec.draft.ngram import NgramProposer
from hetero_spec.draft.onnx_drafter import OnnxDrafter
from hetero_spec.sampling import SamplingParams
from tests.conftest import _hf_model

SEQ = [5, 17, 33, 2, 99, 100, 7, 8, 9, 10, 11]


def test_rewind_and_reappend_equals_fresh_run(llama_copy_onnx):
    fresh = OnnxDrafter(llama_copy_onnx)
    ref = fresh.append(SEQ)  # [len, vocab]
    d = OnnxDrafter(llama_copy_onnx)
    d.append(SEQ[:6])
    d.append([1, 2, 3])  # tokens that will be rejected
    d.rewind_to(6)
    assert d.n_past == 6
    got = d.append(SEQ[6:])
    np.testing.assert_allclose(got, ref[6:], rtol=1e-4, atol=1e-4)


def test_propose_commit_rolls_back_to_accepted_prefix(llama_copy_onnx):
    d = OnnxDrafter(llama_copy_onnx)
    d.begin(SEQ[:5], SamplingParams())
    draft = d.propose(4)
    assert len(draft.ids) == 4 and draft.probs is None
    d.commit(1, 42)  # one accepted, then the target's correction
    assert d.ids == [*SEQ[:5], draft.ids[0], 42]
    assert d.n_past == 6  # prompt + accepted token cached; the correction is pending
    nxt = d.propose(1).ids
    fresh = OnnxDrafter(llama_copy_onnx)
    logits = fresh.append(d.ids)
    assert nxt == [int(np.argmax(logits[-1]))]


def test_onnx_draft_matches_pytorch_logits(llama_target, llama_copy_onnx):
    d = OnnxDrafter(llama_copy_onnx)
    onnx_logits = d.append(SEQ)
    with torch.no_grad():
        torch_logits = _hf_model(llama_target)(torch.tensor([SEQ])).logits[0].numpy()
    np.testing.assert_allclose(onnx_logits, torch_logits, rtol=1e-3, atol=1e-3)


def test_sampled_proposals_return_q(llama_copy_onnx):
    d = OnnxDrafter(llama_copy_onnx)
    d.begin(SEQ, SamplingParams(temperature=1.0, top_k=20, seed=3))
    draft = d.propose(3)
    assert draft.probs.shape == (3, d.vocab_width)
    np.testing.assert_allclose(draft.probs.sum(-1), 1.0)
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.ids))
    assert all((row > 0).sum() <= 20 for row in draft.probs)


def test_width_is_padded_to_the_target_vocabulary(llama_copy_onnx):
    d = OnnxDrafter(llama_copy_onnx, vocab_width=400)
    logits = d.append(SEQ[:3])
    assert logits.shape == (3, 400) and np.isneginf(logits[:, 384:]).all()


def test_ngram_proposer_prompt_lookup():
    p = NgramProposer(max_n=3, min_n=1)
    p.begin([1, 2, 3, 4, 5, 1, 2, 3], SamplingParams())
    assert p.propose(2).ids == [4, 5]
    p.commit(1, 9)
    assert p.ids == [1, 2, 3, 4, 5, 1, 2, 3, 4, 9]
    assert p.propose(3).ids == []  # 9 never occurred before
    p.commit(0, 1)
    assert p.propose(2).ids == [2, 3]  # matched [1] at its last earlier place


def test_export_errors_are_clear(tmp_path, llama_target):
    with pytest.raises(ExportError, match="no config.json"):
        export_draft(tmp_path, tmp_path / "out")
    nojson = tmp_path / "notok"
    nojson.mkdir()
    (nojson / "config.json").write_text((llama_target / "config.json").read_text())
    with pytest.raises(ExportError, match="no tokenizer.json"):
        export_draft(nojson, tmp_path / "out")
    with pytest.raises(ExportError, match="--precision"):
        export_draft(llama_target, tmp_path / "out", precision="int3")


def test_int4_export_runs(tmp_path, llama_target):
    out = export_draft(llama_target, tmp_path / "int4", precision="int4", quiet=True)
    d = OnnxDrafter(out)
    assert d.append(SEQ).shape == (len(SEQ), 384)


def _drafter(path, ids):
    d = OnnxDrafter(path)
    d.begin(ids, SamplingParams())
    return d


def test_a_catch_up_window_restarts_the_draft_cache_on_the_last_tokens(llama_copy_onnx):
    """A re-probe after a long pause feeds only the last catchup_window committed tokens: the draft then equals a
    draft begun on those tokens alone (RoPE sees relative positions), and the stream goes on consistently."""
    ids = [(7 * i) % 90 + 3 for i in range(40)]
    d, ref = _drafter(llama_copy_onnx, ids), _drafter(llama_copy_onnx, ids[-8:])
    d.catchup_window = 8
    assert d.propose(4).ids == ref.propose(4).ids
    assert d.offset == 32 and d.n_past == 8 + 3 and d.catchup_window is None  # one-shot
    d.commit(2, 11)
    ref.commit(2, 11)
    assert d.propose(3).ids == ref.propose(3).ids
    # a window longer than the backlog changes nothing
    e, full = _drafter(llama_copy_onnx, ids), _drafter(llama_copy_onnx, ids)
    e.catchup_window = 64
    assert e.propose(4).ids == full.propose(4).ids and e.offset == 0
    # text replaced from before the window (another proposer drafted): the cache starts afresh at the cut
    d.sync(ids[:20] + [5, 6, 7])
    assert d.offset == 20 and d.propose(3).ids == _drafter(llama_copy_onnx, [5, 6, 7]).propose(3).ids


class FakeSeq:
    """What a draft source reads of a sequence (draft/base.Seq)."""

    def __init__(self, ids, seq_id=1):
        self.id, self.ids, self.prompt_ids, self.params = seq_id, list(ids), list(ids), SamplingParams()


def rows(*ks, probing=False):
    """A round's plan rows asking ks drafts (tuning/controller.RowPlan)."""
    from hetero_spec.tuning.controller import RowPlan
    return [RowPlan(k=k, ahead=k, probing=probing) for k in ks]


def test_a_re_probe_arms_the_window(llama_copy_onnx):
    """After rounds at gamma 0, a re-probe feeds the draft at most PROBE_WINDOW of the tokens committed meanwhile."""
    from hetero_spec.draft.source import PROBE_WINDOW, LocalSource

    src = LocalSource(OnnxDrafter(llama_copy_onnx))
    seq = FakeSeq([1, 2, 3])
    src.begin(seq)
    src.propose([seq], rows(2))
    src.commit(seq, 0, 5)
    seq.ids += [5, *range(10, 85)]  # 76 tokens committed while the draft rested (the context holds 96)
    armed = []
    real = OnnxDrafter.limit_catchup
    OnnxDrafter.limit_catchup = lambda self, w: armed.append(w) or real(self, w)
    try:
        other = FakeSeq([1, 2, 3], seq_id=2)
        src.begin(other)
        src.propose([other], rows(2))
        assert armed == []  # not probing
        src.propose([seq], rows(2, probing=True))
        assert armed == [PROBE_WINDOW]
    finally:
        OnnxDrafter.limit_catchup = real
    assert src._props[seq.id].offset > 0  # the cache restarted on the window, not on all 76


def test_a_catch_up_skip_feeds_only_the_end_of_a_backlog(llama_copy_onnx):
    """Draft selection: the model drafted up to position 13, then 20 tokens came from another strategy. With
    catchup_skip = 4 only the last 4 are fed after the cached 13: the draft then equals a draft begun on that
    text with a gap (positions are relative), and commit, sync and truncate keep it consistent."""
    ids = [(7 * i) % 90 + 3 for i in range(36)]
    d = _drafter(llama_copy_onnx, ids[:12])
    d.catchup_skip = 4
    d.propose(3)
    d.commit(1, 50)  # the draft's first token accepted, then the target's
    assert d._at == list(range(13))  # the prompt's 12 + the accepted draft token
    text = d.ids + ids[14:34]
    d.sync(text)
    ref = _drafter(llama_copy_onnx, text[:13] + text[-4:])
    assert d.propose(5).ids == ref.propose(5).ids
    assert d.n_past == len(d._at) == 13 + 4 + 4 and d._at[13:17] == list(range(len(text) - 4, len(text)))
    d.commit(2, 77)
    ref.commit(2, 77)
    assert d.propose(3).ids == ref.propose(3).ids and d.n_past == len(d._at)
    # a backlog no longer than the skip is fed whole
    e = _drafter(llama_copy_onnx, ids[:12])
    e.catchup_skip = 4
    e.propose(2)
    e.sync(ids[:15])
    assert e.propose(2).ids == _drafter(llama_copy_onnx, ids[:15]).propose(2).ids and e._at[:15] == list(range(15))
    # text replaced inside the gap: the cache keeps what lies before the cut; the rest is a new backlog
    new = text[:20] + [5, 6]
    d.sync(new)
    assert d._at == list(range(13)) and d.n_past == 13
    assert d.propose(3).ids == _drafter(llama_copy_onnx, new[:13] + new[-4:]).propose(3).ids


def test_a_prompt_window_starts_the_draft_cache_on_the_prompt_end(llama_target, llama_copy_onnx):
    """draft.prompt_window: a prompt longer than the window is read from its last `window` tokens on. The draft
    then equals a draft begun on those tokens alone, the stream goes on consistently (commit, a rejected block,
    the worker's extend/truncate), sampled positions stay absolute, spawned drafters keep the window, and a
    prompt within the window is read whole."""
    ids = [(7 * i) % 90 + 3 for i in range(40)]
    d = OnnxDrafter(llama_copy_onnx, prompt_window=8)
    d.begin(ids, SamplingParams())
    ref = _drafter(llama_copy_onnx, ids[-8:])
    assert d.propose(4).ids == ref.propose(4).ids
    assert d.offset == 32 and d.n_past == 8 + 3 and d._at == list(range(32, 43))
    d.commit(1, 11)
    ref.commit(1, 11)
    assert d.propose(3).ids == ref.propose(3).ids and d.n_past == len(d._at)
    # stream mode (the worker): extend, then a correction truncates inside the drafted run
    w = OnnxDrafter(llama_copy_onnx, prompt_window=8).spawn()
    assert w.prompt_window == 8
    w.begin(ids, SamplingParams())
    wref = _drafter(llama_copy_onnx, ids[-8:])
    assert w.extend(5).ids == wref.extend(5).ids and w.offset == 32
    w.truncate(42)
    wref.truncate(10)
    w.ids.append(61)
    wref.ids.append(61)
    assert w.extend(3).ids == wref.extend(3).ids
    # coupled sampling keys its noise by the absolute position: the windowed draft samples at positions 40..
    params = SamplingParams(temperature=1.0, seed=5)
    s = OnnxDrafter(llama_copy_onnx, prompt_window=8)
    s.begin(ids, params)
    logits = OnnxDrafter(llama_copy_onnx).append(ids[-8:])[-1]
    assert s.propose(1).ids == [s._choose(logits, 40)[0]]
    # another strategy drafted first (selection): the first feed reads the last 8 tokens of the text then
    late = OnnxDrafter(llama_copy_onnx, prompt_window=8)
    late.begin(ids[:20], SamplingParams())
    late.sync(ids)
    assert late.propose(4).ids == _drafter(llama_copy_onnx, ids[-8:]).propose(4).ids and late.offset == 32
    # a re-probe's window does not widen a prompt window that is still armed
    from hetero_spec.draft.source import PROBE_WINDOW

    armed = OnnxDrafter(llama_copy_onnx, prompt_window=8)
    armed.begin(ids, SamplingParams())
    armed.limit_catchup(PROBE_WINDOW)
    assert armed.catchup_window == 8 < PROBE_WINDOW
    # a prompt within the window is read whole
    e = OnnxDrafter(llama_copy_onnx, prompt_window=64)
    e.begin(ids, SamplingParams())
    assert e.propose(3).ids == _drafter(llama_copy_onnx, ids).propose(3).ids and e.offset == 0
    with pytest.raises(ValueError, match="prompt_window"):
        OnnxDrafter(llama_copy_onnx, prompt_window=0)


def test_prompt_window_auto_is_a_window_only_for_a_model_next_to_a_lookup_in_process():
    from hetero_spec.draft.select import PROMPT_WINDOW, prompt_window

    assert prompt_window("auto", ["onnx", "ngram"], "in_process") == PROMPT_WINDOW == 32
    assert prompt_window("auto", ["ngram", "onnx"], "in_process") == PROMPT_WINDOW
    assert prompt_window("auto", ["onnx", "ngram"], "two_process") is None  # the worker drafts every round
    assert prompt_window("auto", [], "in_process") is None  # the model alone
    assert prompt_window("auto", ["onnx"], "in_process") is None
    assert prompt_window(None, ["onnx", "ngram"], "in_process") is None  # null: the whole prompt
    assert prompt_window(7, [], "two_process") == 7


def test_a_pruned_head_proposes_only_its_tokens_and_the_output_stays_the_targets(llama_target, llama_copy_onnx,
                                                                                monkeypatch, tmp_path):
    """draft.head (FR-Spec, draft/head.py): the pruned copy's logits are the full head's at the kept tokens and
    -inf elsewhere; the special tokens are kept whatever their count; greedy output equals the target alone's
    and seeded coupled sampling equals target-only sampling with that seed."""
    import numpy as np

    from hetero_spec import Engine
    from hetero_spec.draft import head
    from hetero_spec.onnx_decoder import OnnxDecoder
    from tests.conftest import hf_greedy

    files = head.corpus_files()[:40]  # a slice of the corpus keeps the test fast; the rule is the same
    monkeypatch.setattr(head, "corpus_files", lambda: files)
    full = OnnxDecoder(llama_copy_onnx)
    n = full.model_vocab // 4
    pruned = OnnxDecoder(head.prune_head(llama_copy_onnx, tmp_path / "pruned", n))
    keep = pruned.head_tokens
    assert len(keep) == n and pruned.model_vocab == full.model_vocab and pruned.head_width == n
    assert pruned.has_logits_from and full.has_logits_from  # the copy is made from the logits_from graph
    assert head.unpruned(tmp_path / "pruned") == llama_copy_onnx.resolve() and head.unpruned(llama_copy_onnx) == llama_copy_onnx
    assert head._special_ids(llama_copy_onnx, full.model_vocab) <= set(keep.tolist())
    counts = head.token_counts(llama_copy_onnx / "tokenizer.json", files)[:full.model_vocab]
    assert counts[keep].sum() > counts.sum() * n / full.model_vocab  # the frequent ones, not any quarter
    prompt = [5, 17, 33, 2, 99, 100, 7]
    a, b = full.append(full.new_state(), prompt), pruned.append(pruned.new_state(), prompt)
    np.testing.assert_allclose(pruned.append(pruned.new_state(), prompt, last_only=True), b[-1:], rtol=1e-5, atol=1e-5)
    out = np.setdiff1d(np.arange(full.model_vocab), keep)
    np.testing.assert_allclose(b[:, keep], a[:, keep], rtol=1e-5, atol=1e-5)
    assert np.isneginf(b[:, out]).all()
    cfg = {"target": {"model": str(llama_target), "dtype": "float32"},
           "draft": {"kind": "onnx", "model": str(llama_copy_onnx), "head": n}}
    with Engine.from_config(cfg) as eng, Engine.from_config({**cfg, "draft": {"kind": "none"}}) as alone:
        assert (Path(eng.config.draft.model) / head.HEAD_TOKENS).is_file()
        for p in (prompt, [40, 41, 42, 43, 44, 40, 41, 42]):
            got = eng.generate(p, max_new_tokens=32, gamma=3, temperature=0.0)
            assert got.token_ids == hf_greedy(llama_target, p, 32) and got.stats["drafted"] > 0
            s = eng.generate(p, max_new_tokens=32, gamma=3, temperature=0.9, seed=11).token_ids
            assert s == alone.generate(p, max_new_tokens=32, temperature=0.9, seed=11).token_ids


def test_the_corpus_table_keeps_what_most_often_followed_each_context():
    """draft/corpus.py: per context of 3-6 tokens, its most frequent next token, kept only where the context was
    seen twice and that token followed it at least half the time; no context spans two files."""
    import numpy as np

    from hetero_spec.draft.corpus import CorpusProposer, CorpusTable

    a = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 5, 9, 9, 9]
    t = CorpusTable.build([np.array(a), np.array([7, 8, 9, 10]), np.array([11, 7, 8, 9])])
    assert t.next([0, 1, 2, 3, 4]) == (5, 4)  # 5 twice, 6 once after 1 2 3 4
    assert t.next([0, 0, 1, 2, 3]) == (4, 3)  # 0 1 2 3 is unseen: the 3-token context answers
    assert t.next([5, 1, 2, 3]) == (4, 3)  # 5 1 2 3 was seen once
    assert t.next([7, 8, 9]) is None  # seen twice, but at a file's end once: followed once only
    assert t.next([9, 9, 9]) is None and t.next([1, 2]) is None  # once; too short a context
    for tiny in ([], [np.array([1, 2])]):  # no corpus, or files shorter than a context: an empty table
        assert CorpusTable.build(tiny).next([1, 2, 3, 4, 5, 6]) is None
    p = CorpusProposer(t)
    p.begin([0, 1, 2, 3], None)
    d = p.propose(16)
    assert d.ids == [4, 5, 1] and d.match == 3  # chained while the corpus knows: 1 2 3 -> 4, 1 2 3 4 -> 5, ...
    assert p.propose(1).ids == [4]
    p.commit(1, 5)
    assert p.ids == [0, 1, 2, 3, 4, 5] and p.propose(2).ids == [1]  # 4 5 1 was seen once: the chain ends
    p.sync([7, 1, 2, 3])
    assert p.ids == [7, 1, 2, 3] and p.propose(1).ids == [4]


def test_the_corpus_lookup_drafts_in_selection_and_the_output_stays_the_targets(monkeypatch, llama_target):
    """draft.candidates [corpus, ngram]: the table is made once from the (here: a slice of the) standard library
    with the target's tokenizer, the corpus drafts where its context was seen, and greedy output is the target's."""
    from hetero_spec import Engine
    from hetero_spec.draft import corpus, head
    from tests.conftest import hf_greedy

    files = head.corpus_files()[:40]
    monkeypatch.setattr(head, "corpus_files", lambda: files)
    ids = max(head.corpus_token_ids(llama_target / "tokenizer.json", files), key=len)
    table = corpus.cached_table(llama_target / "tokenizer.json")
    known = next(i for i in range(6, len(ids)) if table.next(list(ids[i - 6:i])) is not None)
    cfg = {"target": {"model": str(llama_target), "dtype": "float32"},
           "draft": {"kind": "ngram", "candidates": ["corpus", "ngram"]}, "speculation": {"gamma": "auto"}}
    with Engine.from_config(cfg) as eng:
        for prompt in ([int(t) for t in ids[max(0, known - 24):known]], [5, 17, 33, 2, 99, 100, 7]):
            out = eng.generate(prompt, max_new_tokens=24)
            assert out.token_ids == hf_greedy(llama_target, prompt, 24)
        rounds = {k: v["rounds"] for k, v in out.stats["extra"]["draft_selection"]["strategies"].items()}
        assert any(k.startswith("corpus@") and v > 0 for k, v in rounds.items()), rounds


def test_the_corpus_lookup_without_the_targets_tokenizer_json_names_the_key(tmp_path, llama_target):
    import shutil

    from hetero_spec import Engine
    from hetero_spec.errors import ConfigError

    bare = tmp_path / "no-tokenizer-json"
    shutil.copytree(llama_target, bare, ignore=shutil.ignore_patterns("tokenizer.json"))
    cfg = {"target": {"model": str(bare), "dtype": "float32"}, "draft": {"kind": "ngram", "candidates": ["corpus"]}}
    with pytest.raises(ConfigError, match=r"draft\.candidates.*tokenizer\.json"):
        Engine.from_config(cfg)


class _Breaks(NgramProposer):
    """An n-gram proposer that raises in `what` for prompts starting with token 99 (a draft model gone wrong)."""

    def __init__(self, what: str = "propose", **kw):
        super().__init__(**kw)
        self.what, self.broken = what, False

    def spawn(self):
        child = _Breaks(self.what, max_n=self.max_n, min_n=self.min_n)
        return child

    def begin(self, prompt_ids, params=None):
        self.broken = prompt_ids[0] == 99
        if self.broken and self.what == "begin":
            raise RuntimeError("begin broke")
        return super().begin(prompt_ids, params)

    def propose(self, k):
        if self.broken and self.what == "propose":
            raise RuntimeError("propose broke")
        return super().propose(k)

    def commit(self, n_accepted, next_token):
        if self.broken and self.what == "commit":
            raise RuntimeError("commit broke")
        return super().commit(n_accepted, next_token)


@pytest.mark.parametrize("what", ["begin", "propose", "commit"])
def test_a_draft_error_leaves_only_its_row_without_drafts(what, caplog):
    """draft/base.py: no call raises. The broken row drafts nothing, counts its errors, logs once; the other drafts."""
    from hetero_spec.draft.source import LocalSource

    src = LocalSource(_Breaks(what))
    bad, good = FakeSeq([99, 1, 2, 1, 2, 1, 2], seq_id=1), FakeSeq([5, 1, 2, 1, 2, 1, 2], seq_id=2)
    for seq in (bad, good):
        src.begin(seq)
    for _ in range(3):
        drafts = src.propose([bad, good], rows(3, 3))
        assert drafts[1].ids  # the repeating text: the healthy row drafts
        if what != "commit":
            assert drafts[0].ids == []
        for seq, d in zip((bad, good), drafts):
            src.commit(seq, 0, 1)
            seq.ids.append(1)
    assert src.end(good) == {}
    errors = src.end(bad)["draft_errors"]
    assert errors == (1 if what == "begin" else 3)
    assert sum(f"{what} failed for request 1" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_a_draft_error_never_changes_the_output(llama_target, monkeypatch):
    """In the decode loop: the request whose draft raises finishes alone, identical to the target alone, as does the
    one beside it in the batch, and its stats count the errors."""
    from hetero_spec import Engine
    from hetero_spec.draft import ngram

    cfg = {"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"}, "draft": {"kind": "ngram"},
           "speculation": {"gamma": 3}, "runtime": {"mode": "in_process"}}
    prompts = [[99, 5, 6, 5, 6, 5, 6], [7, 5, 6, 5, 6, 5, 6]]
    with Engine.from_config({**cfg, "draft": {"kind": "none"}}) as alone:
        want = [alone.generate(p, max_new_tokens=12).token_ids for p in prompts]
    monkeypatch.setattr(ngram, "NgramProposer", _Breaks)
    with Engine.from_config(cfg) as eng:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda p: eng.generate(p, max_new_tokens=12), prompts))
    assert [o.token_ids for o in outs] == want
    assert outs[0].stats["extra"]["draft_errors"] >= 1 and "draft_errors" not in outs[1].stats["extra"]


def test_the_head_keeps_code_by_count_and_the_rest_by_merge_rank(tmp_path, monkeypatch):
    """draft/head.head_tokens: the special tokens, then CODE_SHARE of the rest the most frequent in the standard
    library's source (tokens seen there only), then the rest by the BPE merge that made them (the alphabet first);
    merge_order falls back to ids where the tokenizer has no merges."""
    import json

    import numpy as np

    from hetero_spec.draft import head

    vocab = {"a": 0, "b": 1, "c": 2, "d": 3, "bc": 4, "ab": 5, "abc": 6, "dd": 7, "<eos>": 8, "zz": 9}
    merges = [["a", "b"], "b c", ["ab", "c"], ["d", "d"]]  # ab (rank 0), bc (1), abc (2), dd (3); zz: no merge
    tok = {"model": {"type": "BPE", "vocab": vocab, "merges": merges},
           "added_tokens": [{"id": 8, "content": "<eos>"}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    assert head.merge_order(tmp_path / "tokenizer.json", 10) == [0, 1, 2, 3, 5, 4, 6, 7, 8, 9]
    (tmp_path / "plain.json").write_text(json.dumps({"model": {"type": "Unigram", "vocab": []}}))
    assert head.merge_order(tmp_path / "plain.json", 4) == [0, 1, 2, 3]
    counts = np.array([0, 0, 0, 0, 5, 0, 9, 7, 0, 1])  # the corpus saw abc, dd, bc and zz
    monkeypatch.setattr(head, "token_counts", lambda path, files=None: counts)
    monkeypatch.setattr(head, "CODE_SHARE", 0.5)
    # 7 rows: <eos>; 3 of the other 6 by count (abc, dd, bc); then by merge rank a, b, c
    assert head.head_tokens(tmp_path, 7, 10).tolist() == sorted([8, 6, 7, 4, 0, 1, 2])
    # all by count while the corpus has them, then merge rank
    assert head.head_tokens(tmp_path, 7, 10, code_share=1.0).tolist() == sorted([8, 6, 7, 4, 9, 0, 1])
    assert head.head_tokens(tmp_path, 20, 10).tolist() == list(range(10))  # never more than the vocabulary
