"""The command line: --json on a copy-draft config returns exactly the target-only greedy tokens."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from hetero_spec.cli import main
from tests.conftest import hf_greedy


@pytest.fixture()
def copy_config(tmp_path, llama_target, llama_copy_onnx):
    path = tmp_path / "copy.yaml"
    path.write_text(f"target: {{model: {llama_target}, device: cpu, dtype: float32}}\n"
                    f"draft: {{kind: onnx, model: {llama_copy_onnx}}}\n"
                    "speculation: {gamma: 4}\ngeneration: {max_new_tokens: 30}\n")
    return path


def test_generate_json_copy_draft_equals_target_only(copy_config, llama_target, capsys):
    assert main(["generate", "--config", str(copy_config), "--prompt", "def parse(text):", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(llama_target).encode("def parse(text):")
    assert out["token_ids"] == hf_greedy(llama_target, prompt, 30)
    assert out["stats"]["acceptance_rate"] >= 0.98
    assert set(out) >= {"text", "token_ids", "stats"}


def test_set_override_and_streaming_text(copy_config, capsys):
    assert main(["generate", "--config", str(copy_config), "--prompt", "for i in",
                 "--set", "speculation.gamma=2", "--set", "draft.kind=ngram", "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert "draft=ngram gamma=2" in captured.err


def test_bad_override_is_a_clear_error(copy_config, capsys):
    assert main(["generate", "--config", str(copy_config), "--prompt", "x", "--set", "speculation.gama=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetero-spec: error: --set: speculation.gama = 3: unknown key")
    for override, start in (("nosuch.gamma=3", "--set: nosuch.gamma = 3: unknown section 'nosuch'"),
                            ("draft.kind.x=3", "--set: draft.kind.x = 3: unknown key"),
                            ("draft.model=relative/dir", "--set: draft.model = '")):
        assert main(["generate", "--config", str(copy_config), "--prompt", "x", "--set", override]) == 2
        assert capsys.readouterr().err.startswith(f"hetero-spec: error: {start}")


def test_prompt_required_at_a_terminal(copy_config, capsys, monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Tty())
    assert main(["generate", "--config", str(copy_config)]) == 2
    assert "--prompt is required when standard input is a terminal" in capsys.readouterr().err


def test_help_explains_every_subcommand():
    for args in (["--help"], ["generate", "--help"], ["export", "--help"], ["export-draft", "--help"],
                 ["bench", "--help"]):
        proc = subprocess.run([sys.executable, "-m", "hetero_spec.cli", *args], capture_output=True, text=True)
        assert proc.returncode == 0 and "usage: hetero-spec" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "hetero_spec.cli", "generate", "--help"],
                          capture_output=True, text=True)
    for opt in ("--config", "--prompt", "--max-new-tokens", "--temperature", "--seed", "--set", "--json"):
        assert opt in proc.stdout


def test_log_level_is_accepted_before_and_after_the_command():
    from hetero_spec.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["generate", "--config", "x.yaml", "--log-level", "INFO"]).log_level == "INFO"
    assert parse(["--log-level", "DEBUG", "generate", "--config", "x.yaml"]).log_level == "DEBUG"
    assert parse(["generate", "--config", "x.yaml"]).log_level == "WARNING"
    for command in (["serve", "--config", "x.yaml"], ["export", "--model", "m", "--out", "o"],
                    ["bench", "--config", "x.yaml"]):
        assert parse([*command, "--log-level", "ERROR"]).log_level == "ERROR", command
    with pytest.raises(SystemExit):
        parse(["generate", "--config", "x.yaml", "--log-level", "LOUD"])


def test_acceptance_is_null_when_nothing_was_drafted(tmp_path, llama_target, capsys):
    from hetero_spec.metrics import Stats

    assert Stats().to_dict()["acceptance_rate"] is None
    path = tmp_path / "alone.yaml"
    path.write_text(f"target: {{model: {llama_target}, device: cpu, dtype: float32}}\ndraft: {{kind: none}}\n")
    assert main(["generate", "--config", str(path), "--prompt", "def f(", "--json", "--max-new-tokens", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["acceptance_rate"] is None
    assert main(["generate", "--config", str(path), "--prompt", "def f(", "--max-new-tokens", "4"]) == 0
    assert "acceptance n/a" in capsys.readouterr().err


@pytest.mark.parametrize("present", [(), ("server.key",), ("client.key_secret", "server.key")])
def test_draft_worker_with_an_incomplete_keys_folder_is_one_line(tmp_path, capsys, present):
    """No traceback: one line naming the file that is missing (or does not hold a key), exit status 2."""
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in present:
        (keys / name).write_text("not a key\n")
    model = tmp_path / "draft"
    model.mkdir()
    (model / "model.onnx").write_bytes(b"")
    assert main(["draft-worker", "--connect", "tcp://127.0.0.1:5555", "--keys", str(keys), "--model", str(model)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hetero-spec: error: --keys = {str(keys)!r}: "), err
    missing = next((n for n in ("client.key_secret", "server.key") if n not in present), None)
    assert (f"no {missing} in this directory" if missing else "No public key found") in err[0]


def test_serve_exits_0_after_a_sigterm_drain(tmp_path, llama_target):
    """uvicorn drains, then raises SIGTERM again for the handler it found: the drained server still exits 0."""
    import signal
    import socket
    import time

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"target: {{model: {llama_target}, dtype: float32, device: cpu}}\ndraft: {{kind: none}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "hetero_spec.cli", "serve", "--config", str(cfg), "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- no YAML: --model and --draft ------------------------------------------------------------------------------------
def test_version_is_the_package_version(capsys):
    from hetero_spec import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"hetero-spec {__version__}"


def test_model_and_draft_flags_become_the_config(llama_target, llama_copy_onnx, copy_config):
    from hetero_spec.cli import build_parser, overrides
    from hetero_spec.config import load_config

    parse = build_parser().parse_args
    args = parse(["generate", "--model", str(llama_target), "--draft", str(llama_copy_onnx)])
    config = load_config(None, overrides(args))
    assert (config.target.model, config.draft.kind, config.draft.model) == (llama_target, "onnx", llama_copy_onnx)
    assert (config.target.backend, config.speculation.gamma, config.runtime.mode, config.runtime.cpus) == \
        ("auto", "auto", "auto", "auto")  # chosen by measurement, as `auto` does
    assert load_config(None, overrides(parse(["serve", "--model", str(llama_target), "--draft", "none"]))).draft.kind \
        == "none"
    from hetero_spec.bench.cli import settings_from_args
    from hetero_spec.bench.harness import command_line
    bench = settings_from_args(parse(["bench", "--model", str(llama_target), "--draft", "ngram", "--quick"]))
    assert bench.config is None and bench.overrides == {"target.model": str(llama_target), "draft.kind": "ngram"}
    assert "--config" not in command_line(bench) and f"--set target.model={llama_target}" in command_line(bench)
    # with --config the flags override the file, and --set overrides the flags
    args = parse(["generate", "--config", str(copy_config), "--draft", "ngram", "--set", "speculation.gamma=3"])
    config = load_config(args.config, overrides(args))
    assert (config.draft.kind, config.speculation.gamma, config.target.model) == ("ngram", 3, llama_target)


@pytest.mark.parametrize("argv, start", [
    (["generate", "--prompt", "x"], "--model = None: required without --config"),
    (["generate", "--model", "/no/such/model", "--prompt", "x"], "--model = '/no/such/model': no such file"),
    (["serve", "--model", "{target}", "--draft", "ngarm"], "--draft = 'ngarm': no such file or directory, and not "
                                                           "ngram or none"),
])
def test_model_flags_errors_are_one_line(argv, start, llama_target, capsys):
    assert main([a.format(target=llama_target) for a in argv]) == 2
    assert capsys.readouterr().err.startswith(f"hetero-spec: error: {start}")


def test_generate_and_serve_without_a_config_equal_the_target_alone(llama_target, llama_copy_onnx, monkeypatch,
                                                                    capsys):
    import uvicorn

    from tests.test_serve import Server

    alone = ["--model", str(llama_target), "--draft", "none"]
    # gamma and layout fixed (still no config file): chosen by measurement they may rest the draft for the whole
    # request (a copy of the target drafts at the target's cost, which pays only in two processes, and there the
    # target of this size never waits long enough for a draft), and the acceptance below needs drafts
    spec = ["--model", str(llama_target), "--draft", str(llama_copy_onnx), "--set", "speculation.gamma=4",
            "--set", "runtime.mode=in_process"]
    outs = []
    for flags in (alone, spec):
        assert main(["generate", *flags, "--prompt", "def parse(text):", "--max-new-tokens", "24", "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and len(outs[0]["token_ids"]) == 24
    assert outs[1]["stats"]["acceptance_rate"] >= 0.98

    served = []

    def run(app, **options):  # uvicorn.run, here a test server that answers one completion and stops
        srv = Server(app)
        try:
            served.append(srv.client.completions.create(model=llama_target.name, prompt="def parse(text):",
                                                        max_tokens=24, temperature=0).choices[0].text)
        finally:
            srv.close()

    monkeypatch.setattr(uvicorn, "run", run)
    assert main(["serve", *spec, "--port", "8123"]) == 0
    assert served == [outs[0]["text"]]
