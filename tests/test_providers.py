"""Execution providers of the ONNX draft and target (onnx_decoder.resolve_providers): names or entries with
options, plugin EPs, `fallback: cpu`, and the errors of a provider that is unknown, not available here or given an
option it does not take, each one line before any model loads. The draft on OpenVINO runs where an OpenVINO EP
offers this machine's CPU (`onnxruntime-openvino`, or the plugin on an Intel CPU; scripts/openvino_check.sh)."""

from __future__ import annotations

import importlib.util
import logging

import onnxruntime as ort
import pytest

from hetero_spec import Engine
from hetero_spec import onnx_decoder
from hetero_spec.config import ProviderEntry, build_config
from hetero_spec.errors import ConfigError

PROMPT = "def read_lines(filename):"
OPENVINO = "OpenVINOExecutionProvider"


def _cfg(target, draft, providers, **runtime):
    return {"target": {"model": str(target), "device": "cpu", "dtype": "float32"},
            "draft": {"kind": "onnx", "model": str(draft), "providers": providers},
            "speculation": {"gamma": 4}, "runtime": {"mode": "in_process", **runtime}}


def _error(target, draft, providers, monkeypatch) -> ConfigError:
    """The ConfigError of a config with these draft providers, checking that no ONNX model was loaded first."""
    loaded = []
    monkeypatch.setattr(onnx_decoder.OnnxDecoder, "_load", staticmethod(lambda *a: loaded.append(a)))
    with pytest.raises(ConfigError) as err:
        Engine.from_config(_cfg(target, draft, providers))
    assert loaded == [], "a model was loaded before the providers were checked"
    return err.value


def test_names_and_entries_parse_and_keep_their_form():
    cfg = build_config({"draft": {"providers": ["CPUExecutionProvider",
                                                {"name": OPENVINO, "device": "npu", "options": {"precision": "FP16"},
                                                 "fallback": "cpu"}]}})
    assert cfg.draft.providers == ["CPUExecutionProvider", ProviderEntry(name=OPENVINO, device="npu",
                                                                         options={"precision": "FP16"},
                                                                         fallback="cpu")]
    assert build_config({}).draft.providers == ["CPUExecutionProvider"]  # a plain name stays a name
    for bad, key, problem in (([{"name": "X", "options": {"a": {"b": 1}}}], "draft.providers[0].options.a",
                               "must be a string, a number or true/false"),
                              ([{"nam": "X"}], "draft.providers[0].name", "Field required"),
                              ([1], "draft.providers[0]", "valid string"),
                              ([{"name": "X", "fallback": "gpu"}], "draft.providers[0].fallback", "'cpu'")):
        with pytest.raises(ConfigError) as err:
            build_config({"draft": {"providers": bad}}, source="x.yaml")
        assert (err.value.source, err.value.key_path) == ("x.yaml", key) and problem in err.value.problem


def test_unknown_unavailable_and_bad_options_are_one_line_before_loading(llama_target, llama_copy_onnx,
                                                                          monkeypatch):
    err = _error(llama_target, llama_copy_onnx, ["OpenVinoExecutionProvider"], monkeypatch)  # a typo
    assert err.key_path == "draft.providers[0]" and err.problem.startswith("unknown execution provider")
    assert OPENVINO in err.problem and "\n" not in str(err)
    err = _error(llama_target, llama_copy_onnx, ["CUDAExecutionProvider"], monkeypatch)  # known, not built in here
    assert err.key_path == "draft.providers[0]" and "not available" in err.problem
    assert "available: " in err.problem and "CPUExecutionProvider" in err.problem and "fallback: cpu" in err.problem
    err = _error(llama_target, llama_copy_onnx, [{"name": "CPUExecutionProvider", "options": {"arena": 1}}],
                 monkeypatch)
    assert (err.key_path, err.value) == ("draft.providers[0].options", "arena")
    assert "not an option of CPUExecutionProvider" in err.problem
    err = _error(llama_target, llama_copy_onnx, [{"name": "CPUExecutionProvider", "device": "npu"}], monkeypatch)
    assert err.key_path == "draft.providers[0].device" and "plugin" in err.problem


@pytest.mark.parametrize("mode", ["in_process", "two_process"])
def test_fallback_cpu_runs_on_the_cpu_and_says_so(llama_target, llama_copy_onnx, caplog, mode):
    providers = [{"name": "CUDAExecutionProvider", "fallback": "cpu"}]
    extra = {"pin_cpus": False} if mode == "two_process" else {}
    with caplog.at_level(logging.WARNING, logger="hetero_spec.onnx_decoder"):
        eng = Engine.from_config(_cfg(llama_target, llama_copy_onnx, providers, mode=mode, **extra))
    with eng, Engine.from_config({**_cfg(llama_target, llama_copy_onnx, []), "draft": {"kind": "none"}}) as alone:
        out = eng.generate(PROMPT, max_new_tokens=24, temperature=0.0)
        assert out.token_ids == alone.generate(PROMPT, max_new_tokens=24, temperature=0.0).token_ids
        assert out.stats["accepted"] > 0
        (note,) = out.stats["extra"]["draft_fallback"]
        assert note.startswith("CUDAExecutionProvider not available") and "CPUExecutionProvider" in note
        health = eng.health(5.0)
        assert health["draft_provider"] == "CPUExecutionProvider" and health["draft_fallback"] == [note]
    assert any(r.getMessage() == note for r in caplog.records)  # the target's preflight; a worker logs its own


def test_a_plugin_ep_is_registered_from_its_package():
    """onnxruntime-ep-openvino (a dev dependency) registers through register_execution_provider_library; on a
    machine whose CPU its plugin does not take (it offers Intel devices only) the entry is a clear error."""
    if importlib.util.find_spec("onnxruntime_ep_openvino") is None or OPENVINO in ort.get_available_providers():
        pytest.skip("the OpenVINO plugin package is not installed, or OpenVINO is built into this onnxruntime")
    devices, why = onnx_decoder._plugin_devices(OPENVINO)
    assert (devices == []) == bool(why)
    if devices:
        resolved = onnx_decoder.resolve_providers([{"name": OPENVINO, "device": "cpu"}])
        assert resolved.expected == OPENVINO and resolved.devices and not resolved.classic
    else:
        with pytest.raises(ConfigError, match="its plugin offers no device on this machine"):
            onnx_decoder.resolve_providers([ProviderEntry(name=OPENVINO)], "x.yaml")


def _openvino_cpu() -> list:
    """The draft's providers for OpenVINO's CPU device here, or skip where no OpenVINO EP offers it."""
    if OPENVINO in ort.get_available_providers():
        return [{"name": OPENVINO, "options": {"device_type": "CPU"}}]
    if importlib.util.find_spec("onnxruntime_ep_openvino") and onnx_decoder._plugin_devices(OPENVINO)[0]:
        return [{"name": OPENVINO, "device": "cpu"}]
    pytest.skip("no OpenVINO EP offers this machine's CPU (scripts/openvino_check.sh runs this with "
                "onnxruntime-openvino)")


@pytest.mark.parametrize("mode", ["in_process", "two_process"])
def test_the_draft_on_openvino_equals_the_target_alone(llama_target, llama_copy_onnx, mode):
    providers = _openvino_cpu()
    extra = {"pin_cpus": False} if mode == "two_process" else {}
    with Engine.from_config(_cfg(llama_target, llama_copy_onnx, providers, mode=mode, **extra)) as eng, \
            Engine.from_config({**_cfg(llama_target, llama_copy_onnx, []), "draft": {"kind": "none"}}) as alone:
        out = eng.generate(PROMPT, max_new_tokens=32, temperature=0.0)
        assert out.token_ids == alone.generate(PROMPT, max_new_tokens=32, temperature=0.0).token_ids
        assert out.stats["accepted"] > 0
        assert eng.health(10.0)["draft_provider"] == OPENVINO  # really on OpenVINO, not a silent CPU fallback
