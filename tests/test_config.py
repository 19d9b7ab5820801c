"""Bad config and bad input give clear errors naming the file, the key path and the value."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_spec import Engine
from hetero_spec.config import build_config, load_config, parse_override
from hetero_spec.errors import ConfigError, ModelLoadError, VocabMismatchError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_defaults_and_relative_paths(tmp_path):
    (tmp_path / "m").mkdir()
    cfg = load_config(_write(tmp_path, "target: {model: m}\n"))
    assert cfg.target.model == (tmp_path / "m").resolve()
    assert cfg.speculation.gamma == 4 and cfg.generation.temperature == 0.0
    assert cfg.draft.providers == ["CPUExecutionProvider"]


@pytest.mark.parametrize("text, key_path, value, problem", [
    ("target: {model: m, dtyp: float32}\n", "target.dtyp", "float32", "unknown key"),
    ("speculation: {gamma: four}\n", "speculation.gamma", "four", "an integer in 1..64 or 'auto'"),
    ("speculation: {gamma: 0}\n", "speculation.gamma", 0, "an integer in 1..64 or 'auto'"),
    ("target: {dtype: flot32}\n", "target.dtype", "flot32", "float32"),
    ("generation: {temperature: -1}\n", "generation.temperature", -1, "greater than or equal"),
    ("draft: {kind: magic}\n", "draft.kind", "magic", "onnx"),
    ("draft: {providers: [1]}\n", "draft.providers[0]", 1, "valid string"),
    ("draft: {prompt_window: 0}\n", "draft.prompt_window", 0, "an integer >= 1, 'auto' or null"),
    ("target: {prefill_threads: 0}\n", "target.prefill_threads", 0, "an integer >= 1 or 'auto'"),
    ("bogus: {}\n", "bogus", {}, "unknown key"),
    ("source: x.yaml\n", "source", "x.yaml", "unknown key; the top level has: target"),  # Config's own, not a key
    ("target: {device: tpu}\n", "target.device", "tpu", "cuda"),
])
def test_bad_values_name_file_key_and_value(tmp_path, text, key_path, value, problem):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    e = err.value
    assert e.source == str(path) and e.key_path == key_path and e.value == value
    assert problem in e.problem
    assert str(path) in str(e) and key_path in str(e) and repr(value) in str(e)


def test_bad_yaml_names_file_and_line(tmp_path):
    path = _write(tmp_path, "target:\n  model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        load_config(path)
    assert str(path) in str(err.value) and "line" in str(err.value)
    path = _write(tmp_path, "target:\n  model: x\nbad\n  : [\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"{path}: line 4, column 3: not valid YAML: could not find expected ':' "
                              "(while scanning a simple key)")  # one line: file, line, column, what


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_overrides_go_through_the_same_validator(tmp_path):
    path = _write(tmp_path, "speculation: {gamma: 4}\n")
    assert load_config(path, overrides={"speculation.gamma": 7}).speculation.gamma == 7
    assert parse_override("speculation.gamma=6") == ("speculation.gamma", 6)
    assert parse_override("draft.providers=[A, B]") == ("draft.providers", ["A", "B"])
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides={"speculation.gama": 7})
    assert err.value.key_path == "speculation.gama" and err.value.source == "--set"
    with pytest.raises(ConfigError, match="unknown section"):
        load_config(path, overrides={"nosuch.key": 1})
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides={"speculation.gamma": "x"})
    assert err.value.key_path == "speculation.gamma" and err.value.value == "x"
    with pytest.raises(ConfigError, match="KEY.PATH=VALUE"):
        parse_override("novalue")


def test_missing_model_directories(tmp_path, llama_target):
    path = _write(tmp_path, "target: {model: does/not/exist}\n")
    with pytest.raises(ConfigError) as err:
        Engine.from_config(path)
    assert err.value.key_path == "target.model" and "does/not/exist" in str(err.value)
    path = _write(tmp_path, f"target: {{model: {llama_target}}}\ndraft: {{kind: onnx, model: nowhere}}\n")
    with pytest.raises(ConfigError) as err:
        Engine.from_config(path)
    assert err.value.key_path == "draft.model" and "nowhere" in str(err.value)
    with pytest.raises(ConfigError, match="target model directory is required"):
        Engine.from_config({})


def test_unavailable_execution_provider_lists_available(tmp_path, llama_target, llama_copy_onnx):
    path = _write(tmp_path, f"target: {{model: {llama_target}}}\n"
                            f"draft: {{kind: onnx, model: {llama_copy_onnx}, "
                            f"providers: [QNNExecutionProvider]}}\n")
    with pytest.raises(ConfigError) as err:
        Engine.from_config(path)
    e = err.value
    assert e.key_path == "draft.providers[0]" and e.value == "QNNExecutionProvider"
    assert str(path) in str(e) and "CPUExecutionProvider" in str(e)


def test_draft_vocabulary_mismatch_names_both_sizes(tmp_path, llama_target):
    from hetero_spec.draft.export import export_draft
    from tests.fixtures.tiny_models import build_model

    other = build_model("llama_gqa", tmp_path / "small-vocab", seed=2, vocab_size=320)
    onnx_dir = export_draft(other, tmp_path / "small-vocab-onnx", quiet=True)
    cfg = {"target": {"model": str(llama_target)}, "draft": {"kind": "onnx", "model": str(onnx_dir)}}
    with pytest.raises(VocabMismatchError) as err:
        Engine.from_config(cfg)
    assert "320" in str(err.value) and "384" in str(err.value)


def test_unloadable_target_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError, match="broken"):
        Engine.from_config(build_config({"target": {"model": str(bad)}}))


@pytest.mark.parametrize("override, key_path, value, problem", [
    ({"speculation.gama": 3}, "speculation.gama", 3, "unknown key; speculation has: gamma"),
    ({"specul.gamma": 3}, "specul.gamma", 3, "unknown section 'specul'"),
    ({"draft.ngram.max_nn": 3}, "draft.ngram.max_nn", 3, "unknown key; draft.ngram has: max_n, min_n"),
    ({"draft.ngram.max_n.x": 3}, "draft.ngram.max_n.x", 3, "draft.ngram.max_n is a value, not a section"),
    ({"draft.ngram.max_n": 0}, "draft.ngram.max_n", 0, "greater than or equal to 1"),
    ({"draft": {"kind": "ngram", "bogus": 1}}, "draft.bogus", 1, "unknown key"),
    ({"generation.stop_token_ids": [1, "x"]}, "generation.stop_token_ids[1]", "x", "valid integer"),
])
def test_override_errors_blame_set_not_the_file(tmp_path, override, key_path, value, problem):
    path = _write(tmp_path, "speculation: {gamma: 4}\ndraft: {kind: ngram}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides=override)
    e = err.value
    assert (e.source, e.key_path, e.value) == ("--set", key_path, value)
    assert problem in e.problem and str(e).startswith(f"--set: {key_path} = {value!r}: ")


def test_file_errors_still_blame_the_file_when_overrides_are_given(tmp_path):
    path = _write(tmp_path, "speculation: {gama: 4}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides={"speculation.gamma": 5})
    assert err.value.source == str(path) and err.value.key_path == "speculation.gama"
    # ... and an override may repair a bad value of the file
    path = _write(tmp_path, "speculation: {gamma: 100}\n")
    assert load_config(path, overrides={"speculation.gamma": 5}).speculation.gamma == 5


def test_override_paths_resolve_against_the_current_directory(tmp_path, monkeypatch, llama_target):
    (tmp_path / "cfgdir").mkdir()
    (tmp_path / "work").mkdir()
    path = tmp_path / "cfgdir" / "cfg.yaml"
    path.write_text("target: {model: m}\ndraft: {kind: ngram, model: d}\n")
    monkeypatch.chdir(tmp_path / "work")
    cfg = load_config(path)
    assert cfg.target.model == (tmp_path / "cfgdir" / "m").resolve()
    assert cfg.draft.model == (tmp_path / "cfgdir" / "d").resolve()
    cfg = load_config(path, overrides={"draft.model": "models/x", "target": {"model": "t"}})
    assert cfg.draft.model == (tmp_path / "work" / "models" / "x").resolve()
    assert cfg.target.model == (tmp_path / "work" / "t").resolve()
    # a missing directory given with --set is blamed on --set, with the path it resolved to
    with pytest.raises(ConfigError) as err:
        Engine.from_config(path, overrides={"target.model": "nowhere"})
    assert err.value.source == "--set" and err.value.value == str(tmp_path / "work" / "nowhere")


def test_measured_defaults_are_settings_that_reach_their_users(llama_target):
    """draft.catchup_skip, serving.plain_hold and the Ray workers' niceness and ready timeout are config keys (with
    the measured defaults), and each reaches the code that uses it."""
    from hetero_spec import Engine
    from hetero_spec.config import build_config
    from hetero_spec.serve.ray_serve import local_env

    cfg = build_config({"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
                        "draft": {"kind": "ngram", "candidates": ["ngram"], "catchup_skip": 3},
                        "runtime": {"mode": "in_process"},
                        "serving": {"plain_hold": 5, "ray": {"worker_niceness": 7, "ingress_ready_timeout_s": 90}}})
    env = local_env(cfg)
    assert env["RAY_worker_niceness"] == "7" and env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "90"
    with Engine.from_config(cfg) as eng:
        assert eng.controller.plain_hold == 5
    defaults = build_config({})
    assert (defaults.draft.catchup_skip, defaults.serving.plain_hold, defaults.serving.ray.worker_niceness) == (4, 16, 0)
    with pytest.raises(ConfigError, match="serving.ray.worker_niceness"):
        build_config({"serving": {"ray": {"worker_niceness": 25}}})
