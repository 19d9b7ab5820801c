"""Bad input gives a clear error (naming the source, the key or argument, and the value) and loses nothing:
prompts that are not UTF-8, per-request arguments, eager stream validation, preflight checks before the
target loads, draft kind inference, and the export command's progress and log."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetero_spec import Engine
from hetero_spec.cli import main
from hetero_spec.config import build_config, load_config
from hetero_spec.errors import ConfigError, RequestError, VocabMismatchError


@pytest.fixture(scope="module")
def engine(llama_target):
    eng = Engine.from_config({"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
                              "draft": {"kind": "ngram"}})
    yield eng
    eng.close()


@pytest.fixture()
def ngram_yaml(tmp_path, llama_target):
    def write(generation: str = "{max_new_tokens: 4}") -> Path:
        path = tmp_path / "ngram.yaml"
        path.write_text(f"target: {{model: {llama_target}, device: cpu, dtype: float32}}\n"
                        f"draft: {{kind: ngram}}\ngeneration: {generation}\n")
        return path
    return write


@pytest.fixture()
def no_target_load(monkeypatch):
    """Preflight errors must come before the (slow) target model loads."""
    from hetero_spec.target import verifier

    def refuse(*args, **kwargs):
        raise AssertionError("the target model was loaded before the error was found")

    monkeypatch.setattr(verifier.TargetModel, "__init__", refuse)


# -- 1. prompts that are not UTF-8 ----------------------------------------------------------------------
def test_non_utf8_prompt_argument_names_the_byte_offset(ngram_yaml, capsys, no_target_load):
    # Python hands undecodable argv bytes over as lone surrogates (surrogateescape): b"\xff" -> "\udcff"
    assert main(["generate", "--config", str(ngram_yaml()), "--prompt", "def f(\udcff\udcfe):"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("hetero-spec: error: --prompt: not valid UTF-8")
    assert "byte 0xff at byte offset 6" in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_non_utf8_prompt_bytes_in_argv_subprocess(ngram_yaml):
    proc = subprocess.run([sys.executable, "-m", "hetero_spec.cli", "generate", "--config", str(ngram_yaml()),
                           "--prompt", b"def f(\xff\xfe):"], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "hetero-spec: error: --prompt: not valid UTF-8: byte 0xff at byte offset 6" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_non_utf8_stdin_names_the_byte_offset(ngram_yaml, capsys, monkeypatch, no_target_load):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("héllo ".encode() + b"\xc3(")))
    assert main(["generate", "--config", str(ngram_yaml())]) == 2
    err = capsys.readouterr().err
    assert "standard input: not valid UTF-8: byte 0xc3 at byte offset 7" in err


def test_utf8_stdin_is_read_whole_and_echoed(ngram_yaml, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("def parse(text):\r\n    é".encode())))
    assert main(["generate", "--config", str(ngram_yaml())]) == 0
    assert capsys.readouterr().out.startswith("def parse(text):\r\n    é")


def test_api_prompt_with_lone_surrogates_is_a_request_error(engine):
    with pytest.raises(RequestError, match=r"byte 0xff at byte offset 6"):
        engine.generate("def f(\udcff):", max_new_tokens=2)
    with pytest.raises(RequestError, match=r"lone surrogate U\+D800 at character 1 \(byte offset 1\)"):
        engine.generate("x\ud800", max_new_tokens=2)
    with pytest.raises(RequestError, match="no tokens"):
        engine.generate("", max_new_tokens=2)
    with pytest.raises(RequestError, match="list of int token ids"):
        engine.generate([1, 2.5], max_new_tokens=2)


# -- 2. per-request arguments: the config's bounds --------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": float("nan")}, "temperature = nan: must be a finite number"),
    ({"temperature": float("inf")}, "temperature = inf: must be a finite number"),
    ({"temperature": -0.5}, "temperature = -0.5: must be >= 0"),
    ({"top_k": -3}, "top_k = -3: must be >= 0"),
    ({"top_p": 0.0}, "top_p = 0.0: must be > 0"),
    ({"top_p": 1.5}, "top_p = 1.5: must be <= 1"),
    ({"gamma": -2}, "gamma = -2: must be an integer in 1..64 or 'auto'"),
    ({"gamma": 0}, "gamma = 0: must be an integer in 1..64 or 'auto'"),
    ({"gamma": 500}, "gamma = 500: must be an integer in 1..64 or 'auto'"),
    ({"max_new_tokens": 0}, "max_new_tokens = 0: must be >= 1"),
    ({"seed": -1}, "seed = -1: must be >= 0"),
    ({"seed": 2**64}, f"seed = {2**64}: must be < 2**64"),
    ({"stop_token_ids": [3, 99999]}, "stop_token_ids = [3, 99999]: [99999] outside the target's vocabulary"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0] = -1: must be >= 0"),
])
def test_request_arguments_are_validated_like_the_config(engine, kwargs, message):
    with pytest.raises(RequestError) as err:
        engine.generate("def parse(", **kwargs)
    assert message in str(err.value)


def test_boundary_arguments_are_accepted(engine):
    out = engine.generate("def parse(", max_new_tokens=3, temperature=0.7, top_k=5, top_p=1.0,
                          seed=2**64 - 1, gamma=64, stop_token_ids=[383])
    assert 1 <= len(out.token_ids) <= 3
    assert engine.generate("def parse(", max_new_tokens=2, seed=0).token_ids


def test_only_none_means_from_config(engine):
    stats = engine.generate("def parse(", max_new_tokens=3, gamma=None).stats
    assert stats["gamma"] == engine.config.speculation.gamma


@pytest.mark.parametrize("text, key_path", [
    ("generation: {temperature: .nan}\n", "generation.temperature"),
    ("generation: {temperature: .inf}\n", "generation.temperature"),
    ("generation: {top_p: .nan}\n", "generation.top_p"),
    ("generation: {seed: -1}\n", "generation.seed"),
    (f"generation: {{seed: {2**64}}}\n", "generation.seed"),
    ("generation: {stop_token_ids: [1, -4]}\n", "generation.stop_token_ids[1]"),
])
def test_config_file_rejects_the_same_values(tmp_path, text, key_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.source == str(path) and err.value.key_path == key_path


def test_config_stop_ids_outside_the_vocabulary_name_the_file(tmp_path, llama_target):
    cfg = build_config({"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
                        "generation": {"stop_token_ids": [99999]}}, source="x.yaml")
    with Engine(cfg) as eng, pytest.raises(ConfigError) as err:
        eng.generate("def parse(", max_new_tokens=2)
    assert err.value.source == "x.yaml" and err.value.key_path == "generation.stop_token_ids"


def test_cli_bad_arguments_fail_before_the_models_load(ngram_yaml, capsys, no_target_load):
    for args, message in ((["--temperature", "nan"], "--temperature = nan: must be a finite number"),
                          (["--top-k", "-3"], "--top-k = -3: must be >= 0"),
                          (["--seed", str(2**64)], "--seed = 18446744073709551616: must be < 2**64"),
                          (["--max-new-tokens", "0"], "--max-new-tokens = 0: must be >= 1")):
        assert main(["generate", "--config", str(ngram_yaml()), "--prompt", "x", *args]) == 2
        assert f"hetero-spec: error: {message}" in capsys.readouterr().err


# -- 3. streaming validates before any output ------------------------------------------------------------
def test_stream_validates_when_called_not_at_first_next(engine):
    with pytest.raises(RequestError, match="gamma = 0"):
        engine.stream("def parse(", gamma=0)  # no next(): the error comes from the call itself
    pieces = engine.stream("def parse(", max_new_tokens=3)
    assert "".join(pieces) == engine.generate("def parse(", max_new_tokens=3).text


def test_cli_stream_error_comes_before_the_prompt_echo(ngram_yaml, capsys):
    path = ngram_yaml("{max_new_tokens: 4, stop_token_ids: [99999]}")
    assert main(["generate", "--config", str(path), "--prompt", "PROMPT-TEXT"]) == 2
    captured = capsys.readouterr()
    assert "PROMPT-TEXT" not in captured.out
    assert f"{path}: generation.stop_token_ids = [99999]" in captured.err


# -- 5. preflight: host and vocabulary before the target loads ------------------------------------------
def test_non_loopback_host_fails_before_loading(tmp_path, llama_target, llama_copy_onnx, no_target_load):
    path = tmp_path / "tcp.yaml"
    path.write_text(f"target: {{model: {llama_target}}}\ndraft: {{kind: onnx, model: {llama_copy_onnx}}}\n"
                    "runtime: {mode: two_process, transport: tcp, host: 0.0.0.0}\n")
    with pytest.raises(ConfigError) as err:
        Engine.from_config(path)
    e = err.value
    assert e.source == str(path) and e.key_path == "runtime.host" and e.value == "0.0.0.0"
    assert "loopback" in e.problem


def _draft_with_tokenizer(tmp_path: Path, target: Path, edit) -> Path:
    """A draft directory (model.onnx placeholder) whose tokenizer.json is the target's, edited."""
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "model.onnx").write_bytes(b"")
    tok = json.loads((target / "tokenizer.json").read_text())
    edit(tok["model"]["vocab"])
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    return draft


def test_vocabulary_mismatch_names_config_keys_and_tokens(tmp_path, llama_target, no_target_load):
    def swap(vocab):
        vocab["!"], vocab['"'] = vocab['"'], vocab["!"]

    draft = _draft_with_tokenizer(tmp_path, llama_target, swap)
    path = tmp_path / "cfg.yaml"
    path.write_text(f"target: {{model: {llama_target}}}\ndraft: {{kind: onnx, model: {draft}}}\n")
    with pytest.raises(VocabMismatchError) as err:
        Engine.from_config(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: draft.model = '{draft}'") and "target.model" in msg
    assert "token '!' is id 1 in the target's tokenizer but id 2 in the draft's" in msg
    assert "2 tokens differ" in msg


def test_vocabulary_size_mismatch_says_both_sizes(tmp_path, llama_target, no_target_load):
    draft = _draft_with_tokenizer(tmp_path, llama_target, lambda vocab: vocab.update({"zzqq": len(vocab)}))
    cfg = {"target": {"model": str(llama_target)}, "draft": {"kind": "onnx", "model": str(draft)}}
    with pytest.raises(VocabMismatchError) as err:
        Engine.from_config(cfg)
    msg = str(err.value)
    assert "the target's has 384 tokens, the draft's 385" in msg
    assert "token 'zzqq' is id 384 in the draft's tokenizer but missing from the target's" in msg


# -- 6. draft.kind inferred from draft.model ------------------------------------------------------------
def test_draft_kind_is_inferred_from_the_model_directory(tmp_path, llama_target, llama_copy_onnx):
    assert build_config({"draft": {"model": str(llama_copy_onnx)}}).draft.kind == "onnx"
    assert build_config({"draft": {}}).draft.kind == "ngram"
    assert build_config({"draft": {"kind": "ngram", "model": str(llama_target)}}).draft.kind == "ngram"
    path = tmp_path / "cfg.yaml"
    path.write_text(f"draft: {{model: {llama_target}}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    e = err.value
    assert e.source == str(path) and e.key_path == "draft.kind" and "no model.onnx" in e.problem
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "cfg.yaml", overrides={"draft.model": str(tmp_path / "nowhere")})
    assert err.value.source == "--set" and "does not exist" in err.value.problem


# -- 7. export: progress lines, the builder's log in a file -------------------------------------------
def test_export_shows_stages_and_keeps_the_builder_log(tmp_path, llama_target, capsys):
    out = tmp_path / "draft-onnx"
    assert main(["export", "--model", str(llama_target), "--out", str(out), "--precision", "int4"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 2  # nothing of the builder's own output on stdout: where it went, and what it reads
    assert lines[0].endswith(f"builder log: {out / 'export.log'}")
    assert lines[1].startswith("weights ") and "a generated token reads about" in lines[1]
    stages = [line for line in captured.err.splitlines() if line.startswith("export [")]
    assert len(stages) >= 4 and stages[-1].endswith("done") and "quantizing" in captured.err
    assert "Reading layer 0" not in captured.err
    log = (out / "export.log").read_text()
    assert "Reading layer 0" in log and "onnxruntime_genai.models.builder" in log
    assert (out / "model.onnx").is_file()


def test_export_failure_names_the_log(tmp_path, llama_target, capsys, monkeypatch):
    # A stand-in for the builder (it would fail the same way, only after ~10 s of imports).
    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\necho 'Loading weights: 100%'\necho 'NotImplementedError: BogusForCausalLM' >&2\n"
                    "exit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    out = tmp_path / "out"
    assert main(["export-draft", "--model", str(llama_target), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "loading the checkpoint's weights" in err and "the builder failed (exit code 3)" in err
    assert f"exit code 3); full log: {out / 'export.log'}" in err
    assert "NotImplementedError: BogusForCausalLM" in err  # the log's last lines are in the error too
    assert "NotImplementedError: BogusForCausalLM" in (out / "export.log").read_text()
