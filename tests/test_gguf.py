"""GGUF files as target.model / draft.model / `export --model` (gguf_source.py): the tiny GGUF fixture is right,
the conversion is exact and cached, speculation stays identical to the target alone, every EOS id stops both
backends, the chat template survives, and bad files fail early with errors naming the key and the value."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hetero_spec import Engine, gguf_source
from hetero_spec.cli import main
from hetero_spec.config import build_config, load_config
from hetero_spec.preflight import check_paths
from hetero_spec.errors import ConfigError
from tests.conftest import _hf_model, hf_greedy
from tests.fixtures.tiny_gguf import CHAT_TEMPLATE, DEMO_TOKENIZER, VOCAB, demo_vocab, rename_tokens, write_gguf
from tests.fixtures.tiny_models import build_model

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [40, 41, 42, 43, 44, 40, 41, 42]]
MAX_NEW = 32
IM_END = VOCAB - 1  # the llama GGUF's vocabulary spells this id <|im_end|>: a second end token


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def hf_models(gguf_dir) -> dict[str, Path]:
    """The tiny llama (GQA) and qwen2 with the demo tokenizer's 4096-token vocabulary."""
    return {"llama": build_model("llama_gqa", gguf_dir / "llama", seed=1, vocab_size=VOCAB),
            "qwen2": build_model("qwen2", gguf_dir / "qwen2", seed=3, vocab_size=VOCAB)}


@pytest.fixture(scope="module")
def ggufs(gguf_dir, hf_models) -> dict[str, Path]:
    """The llama declares EOS 0 (<|endoftext|>) and spells IM_END <|im_end|>; the qwen2 has the demo vocabulary."""
    vocab = rename_tokens(*demo_vocab(), {IM_END: "<|im_end|>"})
    return {"llama": write_gguf(hf_models["llama"], gguf_dir / "tiny-llama.gguf", vocab=vocab),
            "qwen2": write_gguf(hf_models["qwen2"], gguf_dir / "tiny-qwen2.gguf")}


@pytest.fixture(scope="module")
def converted(ggufs) -> dict[str, Path]:
    return {name: gguf_source.cached_hf(path) for name, path in ggufs.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fixture_gguf_loads_as_the_source_model(hf_models, ggufs, arch):
    """The writer is right (llama's q/k permuted as llama.cpp does): transformers' own GGUF loader gives the
    source model's logits."""
    from transformers import AutoModelForCausalLM

    path = ggufs[arch]
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0] + [4000, 123]])
    with torch.no_grad():
        want, got = _hf_model(hf_models[arch])(ids).logits, loaded(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_conversion_is_exact(hf_models, converted, arch):
    src = load_file(str(hf_models[arch] / "model.safetensors"))
    out = load_file(str(converted[arch] / "model.safetensors"))
    assert set(out) == set(src)
    for name, tensor in src.items():
        assert out[name].dtype == torch.float32 and torch.equal(out[name], tensor), name
    cfg = json.loads((converted[arch] / "config.json").read_text())
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert "quantization_config" not in cfg
    assert (converted[arch] / "tokenizer.json").is_file()


def test_converted_tokenizer_is_the_demo_tokenizer(converted):
    from tokenizers import Tokenizer

    text = "def parse(text):\n    return [line.split(',') for line in text.splitlines()]  # héllo<|endoftext|>"
    demo = Tokenizer.from_file(str(DEMO_TOKENIZER))
    conv = Tokenizer.from_file(str(converted["qwen2"] / "tokenizer.json"))
    assert conv.encode(text).ids == demo.encode(text).ids
    assert conv.get_vocab_size() == VOCAB


def test_chat_template_is_kept(converted):
    from transformers import AutoTokenizer

    assert (converted["llama"] / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    tok = AutoTokenizer.from_pretrained(converted["llama"])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_conversion_is_cached_and_redone_for_an_edited_file(tmp_path, monkeypatch, capsys, hf_models, ggufs):
    monkeypatch.setenv("HETERO_SPEC_CACHE", str(tmp_path / "cache"))
    calls = []
    real = gguf_source._convert
    monkeypatch.setattr(gguf_source, "_convert", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    path = write_gguf(hf_models["qwen2"], tmp_path / "q.gguf")
    cfg = build_config({"target": {"model": str(path)}, "draft": {"kind": "none"}})
    first = gguf_source.resolve(cfg).target.model
    assert first.parent == tmp_path / "cache" / "gguf-hf" and len(calls) == 1
    assert "converting q.gguf to a Hugging Face checkpoint once, into the cache" in capsys.readouterr().err
    assert gguf_source.resolve(cfg).target.model == first and len(calls) == 1  # found, not converted
    check_paths(cfg)  # the preflight of a converted file reads nothing
    write_gguf(hf_models["qwen2"], path, chat_template="{{ messages[0]['content'] }}")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new mtime even on a coarse clock
    second = gguf_source.resolve(cfg).target.model
    assert second != first and len(calls) == 2
    assert (second / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }}"
    assert not list((tmp_path / "cache" / "gguf-hf").glob("*.tmp-*"))  # scratch folders renamed or removed


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_gguf_target_and_draft_are_greedy_identical_to_the_target_alone(ggufs, converted, hf_models, backend):
    """target.model and draft.model are the same GGUF (draft at fp32: an ONNX export of its conversion, which
    the onnx target reuses): every draft token is accepted and the output is the target's alone."""
    cfg = {"target": {"model": str(ggufs["llama"]), "dtype": "float32", "backend": backend},
           "draft": {"model": str(ggufs["llama"]), "precision": "fp32"}}
    with Engine.from_config(cfg) as eng:
        assert eng.config.target.model == converted["llama"] and eng.config.draft.kind == "onnx"
        assert type(eng.target).__name__ == {"torch": "TargetModel", "onnx": "OnnxTarget"}[backend]
        assert (eng.config.draft.model / "model.onnx").is_file()
        assert eng.target.eos_token_ids == {0, IM_END}  # both backends read every EOS id
        outs = [eng.generate(p, max_new_tokens=MAX_NEW, gamma=3) for p in PROMPTS]
    if backend == "torch":
        refs = [hf_greedy(hf_models["llama"], p, MAX_NEW, eos_token_id=[0, IM_END]) for p in PROMPTS]
    else:
        with Engine.from_config({**cfg, "draft": {"kind": "none"}}) as alone:
            refs = [alone.generate(p, max_new_tokens=MAX_NEW).token_ids for p in PROMPTS]
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref
        assert out.stats["acceptance_rate"] >= 0.98


def test_gguf_draft_defaults_to_int4(caplog, ggufs, converted):
    cfg = build_config({"target": {"model": str(ggufs["llama"])}, "draft": {"model": str(ggufs["llama"])}})
    assert cfg.draft.kind == "onnx"  # inferred from the .gguf
    with caplog.at_level("INFO", logger="hetero_spec.gguf"):
        out = gguf_source.resolve(cfg)
    assert out.draft.model == converted["llama"] and out.draft.precision == "int4"
    assert "draft.precision is unset: exporting the draft at int4" in caplog.text


def _two_new_tokens(hf_dir: Path) -> tuple[list[int], int, int]:
    """(greedy output, i, a token of it): out[i] and tok appear nowhere in out[:i], so a model that ends on
    either stops after out[i]."""
    out = hf_greedy(hf_dir, PROMPTS[0], 16)
    tokens = demo_vocab()[0]
    i = next(k for k in range(2, len(out)) if out[k] not in out[:k] and out[k] != 0 and len(tokens[out[k]]) > 1)
    other = next(t for t in out[i + 1:] if t not in out[:i + 1] and t != 0 and len(tokens[t]) > 1)
    return out, i, other


@pytest.mark.parametrize("declared", ["eos_first", "im_end_first"])
def test_every_eos_id_is_kept_and_stops_generation(gguf_dir, hf_models, declared):
    """A GGUF declaring one EOS whose vocabulary has another end token (<|im_end|>): generation_config.json lists
    both (and <|endoftext|>), and the engine stops on whichever comes first."""
    out, i, other = _two_new_tokens(hf_models["llama"])
    eos, im_end = (out[i], other) if declared == "eos_first" else (other, out[i])
    vocab = rename_tokens(*demo_vocab(), {im_end: "<|im_end|>"})
    path = write_gguf(hf_models["llama"], gguf_dir / f"eos-{declared}.gguf", vocab=vocab, eos_id=eos)
    hf = gguf_source.cached_hf(path)
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == sorted({0, eos, im_end})
    with Engine.from_config({"target": {"model": str(path), "dtype": "float32"}, "draft": {"kind": "ngram"}}) as eng:
        res = eng.generate(PROMPTS[0], max_new_tokens=16)
    assert res.token_ids == out[:i + 1] and res.finish_reason == "stop"


def test_eot_and_fim_ids_are_end_tokens_too(gguf_dir, hf_models):
    """As in llama.cpp: a declared eot id, and FIM pad/repo/file-separator tokens found by their text."""
    names = {7: "<|file_sep|>", 8: "<|repo_name|>", 9: "<|eot_id|>", 10: "<|im_start|>"}
    vocab = rename_tokens(*demo_vocab(), {100 + k: v for k, v in names.items()})
    path = write_gguf(hf_models["llama"], gguf_dir / "eot.gguf", vocab=vocab, eos_id=0, eot_id=42)
    assert gguf_source.read_info(path).eos_ids == (0, 42, 107, 108, 109)  # not <|im_start|>


def _error(cfg: dict | None = None, overrides: dict | None = None) -> str:
    with pytest.raises(ConfigError) as exc:
        check_paths(build_config(cfg or {}, overrides=overrides))
    return str(exc.value)


def test_missing_and_non_gguf_files_fail_early_naming_key_and_value(tmp_path, hf_models):
    missing = tmp_path / "nope.gguf"
    msg = _error(overrides={"target.model": str(missing)})
    assert msg.startswith(f"--set: target.model = '{missing}'") and "GGUF file not found" in msg
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a gguf at all")
    yaml = tmp_path / "c.yaml"
    yaml.write_text(f"target:\n  model: {hf_models['llama']}\ndraft:\n  model: bad.gguf\n")
    with pytest.raises(ConfigError) as exc:
        check_paths(load_config(yaml))
    assert str(exc.value).startswith(f"{yaml}: draft.model = '{bad}'") and "not a GGUF file" in str(exc.value)
    weights = tmp_path / "model.safetensors"  # a plain file is taken for a GGUF, and said not to be one
    weights.write_bytes(b"\0" * 64)
    assert "not a GGUF file" in _error({"target": {"model": str(weights)}})


def test_unsupported_architectures_fail_before_loading(tmp_path, capsys, hf_models, ggufs):
    neox = write_gguf(hf_models["llama"], tmp_path / "neox.gguf", arch="gptneox")
    msg = _error({"target": {"model": str(neox)}, "draft": {"kind": "none"}})
    assert f"target.model = '{neox}'" in msg and "general.architecture 'gptneox'" in msg
    assert "transformers cannot convert" in msg and "qwen2" in msg  # and what it does convert
    mamba = write_gguf(hf_models["llama"], tmp_path / "mamba.gguf", arch="mamba")
    msg = _error({"target": {"model": str(ggufs["llama"])}, "draft": {"model": str(mamba)}})
    assert f"draft.model = '{mamba}'" in msg and "MambaForCausalLM" in msg and "does not export" in msg
    with pytest.raises(ConfigError, match="gptneox"):  # the engine's preflight, before any load
        Engine.from_config({"target": {"model": str(neox)}, "draft": {"kind": "none"}})
    assert main(["export", "--model", str(mamba), "--out", str(tmp_path / "out")]) == 2
    assert f"hetero-spec export: --model = '{mamba}'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
