"""The llama.cpp systems of `hetero-spec bench` (bench/peers.py), against fake llama.cpp binaries.

The fakes are small Python scripts named llama-completion and llama-speculative-simple. They check their
arguments against the flags the real tools take (common/arg.cpp of the vendored llama.cpp), log them, and
print llama.cpp's real output: the timing lines in the exact printf formats of common/sampling.cpp
(common_perf_print) and examples/speculative-simple/speculative-simple.cpp (LOG_INF), with the log prefix the
real tools print, and the text on stdout the way each tool prints it. Their clock is fake and depends on the
draft length only (not the threads), so the calibrated setting is known in advance: no wall-clock outcome is
asserted.
"""

from __future__ import annotations

import hashlib
import json
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hetero_spec.bench import BenchSettings, run_bench
from hetero_spec.bench import peers as lc
from hetero_spec.bench.harness import cores
from tests.test_bench import copy_config  # noqa: F401 - the same tiny copy-draft config (a fixture)

PROMPTS = [[5, 17, 33, 40, 41, 99, 100, 7], [200, 201, 202, 5, 6, 7, 8, 9, 10, 11]]
GENERATED = "for i in range(10):\n    print(i * i)\n" * 4  # text the tiny tokenizer knows: many tokens
BEST_K = 3  # the fake speculative tool is fastest at this draft length

# the formats, copied from the vendored sources (common/sampling.cpp, speculative-simple.cpp)
FAKE = r'''#!@PYTHON@
import json, os, sys

TOOL = os.path.basename(sys.argv[0])
FLAGS = {  # flag -> takes a value; what each real tool accepts among the flags the bench passes
    "llama-completion": {"-m": 1, "-f": 1, "-n": 1, "-t": 1, "-tb": 1, "-c": 1, "--temp": 1, "--top-k": 1,
                         "-s": 1, "-no-cnv": 0, "--no-display-prompt": 0},
    "llama-speculative-simple": {"-m": 1, "-md": 1, "--spec-type": 1, "--spec-draft-n-max": 1, "-f": 1, "-n": 1,
                                 "-t": 1, "-tb": 1, "-td": 1, "-tbd": 1, "-c": 1, "--temp": 1, "--top-k": 1,
                                 "-s": 1},
}[TOOL]
args, i = {}, 1
while i < len(sys.argv):
    flag = sys.argv[i]
    if flag not in FLAGS:
        print(f"error: invalid argument: {flag}", file=sys.stderr)
        sys.exit(1)
    args[flag] = sys.argv[i + 1] if FLAGS[flag] else True
    i += 1 + FLAGS[flag]
prompt = open(args["-f"], encoding="utf-8", newline="").read()  # bytes as they are, as llama.cpp reads them
if prompt.endswith("\n"):
    prompt = prompt[:-1]  # as llama.cpp's -f does
with open(os.environ["FAKE_LLAMA_LOG"], "a") as log:
    log.write(json.dumps({"tool": TOOL, "args": args, "prompt": prompt}) + "\n")
n = int(args["-n"])
p = len(prompt.split()) + 1
gen = @GENERATED@
if TOOL == "llama-completion":
    sys.stdout.write(gen + "\n\n")
    for line in ("common_perf_print:        load time = %10.2f ms" % 136.72,
                 "common_perf_print: prompt eval time = %10.2f ms / %5d tokens (%8.2f ms per token, %8.2f tokens per second)"
                 % (2.0 * p, p, 2.0, 500.0),
                 "common_perf_print:        eval time = %10.2f ms / %5d runs   (%8.2f ms per token, %8.2f tokens per second)"
                 % (10.0 * (n - 1), n - 1, 10.0, 100.0),
                 "common_perf_print:       total time = %10.2f ms / %5d tokens" % (2.0 * p + 10.0 * (n - 1), p + n - 1)):
        sys.stderr.write("0.00.768.240 I " + line + "\n")
    sys.exit(0)
assert args["--spec-type"] == "draft-simple"
k = int(args["--spec-draft-n-max"])
decoded = n + 5  # it decodes past -n
dec_s = 0.01 * decoded * (1 + abs(k - @BEST_K@))
sys.stdout.write("\n\n" + prompt + gen + "\n\n" + "\n\n")
for line in ("encoded %4d tokens in %8.3f seconds, speed: %8.3f t/s" % (p, 0.002 * p, 500.0),
             "decoded %4d tokens in %8.3f seconds, speed: %8.3f t/s" % (decoded, dec_s, decoded / dec_s),
             "", "n_draft   = %d" % k, "n_predict = %d" % decoded, "n_drafted = %d" % (4 * decoded // 5),
             "n_accept  = %d" % (3 * decoded // 5), "accept    = %.3f%%" % 75.0, "", "draft:", "", "target:", "",
             "common_perf_print: prompt eval time = %10.2f ms / %5d tokens (%8.2f ms per token, %8.2f tokens per second)"
             % (999.0, 56, 20.0, 50.0),
             "common_perf_print:        eval time = %10.2f ms / %5d runs   (%8.2f ms per token, %8.2f tokens per second)"
             % (0.0, 1, 0.0, 0.0)):
    sys.stderr.write("0.02.424.071 I " + line + "\n")
'''


@pytest.fixture()
def fake_bin(tmp_path, monkeypatch) -> Path:
    """A folder with the two fake tools; their argument log is FAKE_LLAMA_LOG (one JSON object per call)."""
    bin_dir = tmp_path / "llama-bin"
    bin_dir.mkdir()
    text = FAKE.replace("@PYTHON@", sys.executable).replace("@GENERATED@", repr(GENERATED)).replace(
        "@BEST_K@", str(BEST_K))
    for tool in (lc.COMPLETION, lc.SPECULATIVE):
        path = bin_dir / tool
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(tmp_path / "calls.jsonl"))
    return bin_dir


def calls(tmp_path: Path) -> list[dict]:
    log = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


@pytest.fixture()
def ggufs(tmp_path) -> tuple[Path, Path]:
    """Stand-ins for the GGUF files (the fake tools never read them)."""
    t, d = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    t.write_bytes(b"GGUF")
    d.write_bytes(b"GGUF")
    return t, d


def _entry(report: dict, name: str) -> dict:
    return next(e for e in report["systems"] if e["name"] == name)


# -- parsing -------------------------------------------------------------------------------------------
COMPLETION_ERR = """\
0.00.768.240 I common_perf_print:    sampling time =       3.56 ms
0.00.768.240 I common_perf_print:        load time =     136.72 ms
0.00.768.242 I common_perf_print: prompt eval time =     120.83 ms /    18 tokens (    6.71 ms per token,   148.97 tokens per second)
0.00.768.244 I common_perf_print:        eval time =     352.85 ms /    31 runs   (   11.38 ms per token,    87.86 tokens per second)
0.00.768.245 I common_perf_print:       total time =     490.12 ms /    49 tokens
"""
SPEC_ERR = """\
encoded   18 tokens in    0.350 seconds, speed:   51.393 t/s
decoded   37 tokens in    1.243 seconds, speed:   29.765 t/s

n_draft   = 4
n_predict = 37
n_drafted = 29
n_accept  = 22
accept    = 75.862%

target:

common_perf_print: prompt eval time =    1131.89 ms /    56 tokens (   20.21 ms per token,    49.47 tokens per second)
common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""


def test_timing_lines_parse_into_the_fields():
    t = lc.parse_timings(COMPLETION_ERR, speculative=False)
    assert (t.prompt_tokens, t.decoded_tokens) == (18, 31)
    assert t.prefill_s == pytest.approx(0.12083) and t.decode_s == pytest.approx(0.35285)
    s = lc.parse_timings(SPEC_ERR, speculative=True)  # the target's perf lines after the summary do not count
    assert (s.prompt_tokens, s.decoded_tokens, s.n_max, s.drafted, s.accepted) == (18, 37, 4, 29, 22)
    assert s.prefill_s == pytest.approx(0.35) and s.decode_s == pytest.approx(1.243)
    with pytest.raises(ValueError, match="decoded N tokens"):
        lc.parse_timings("encoded   18 tokens in    0.350 seconds, speed:   51.393 t/s\n", speculative=True)
    with pytest.raises(ValueError, match="prompt eval time"):
        lc.parse_timings("nothing here\n", speculative=False)


def test_generated_text_from_stdout():
    assert lc.generated_text("abc def\n\n", None) == ("abc def", False)
    assert lc.generated_text("abc [end of text]\n\n\n", None) == ("abc", True)
    # "\n\n" + the prompt + "    return x\n" + "\n\n" + "\n\n"
    assert lc.generated_text("\n\ndef f(x):\n    return x\n\n\n\n\n", "def f(x):\n") == ("    return x\n", False)
    with pytest.raises(ValueError, match="echo"):
        lc.generated_text("\n\nsomething else\n\n\n\n", "def f(x):")


def test_command_lines(tmp_path):
    b, m, d, f = tmp_path / "bin", Path("t.gguf"), Path("d.gguf"), Path("p.txt")
    args = lc.llama_args(b, m, f, 64, 1, 256)
    assert args[0] == str(b / "llama-completion")
    pairs = dict(zip(args[1::2], args[2::2]))
    assert (pairs["-m"], pairs["-f"], pairs["-n"], pairs["-t"], pairs["-tb"], pairs["-c"]) == \
        ("t.gguf", "p.txt", "64", "1", "1", "256")
    assert "-no-cnv" in args and "--no-display-prompt" in args
    assert args[args.index("--temp") + 1] == "0" and args[args.index("--top-k") + 1] == "1"
    assert "--ignore-eos" not in args and "--ignore-eos" in lc.llama_args(b, m, f, 64, 1, 256, ignore_eos=True)
    spec = lc.llama_args(b, m, f, 64, 2, 300, d, 5)
    assert spec[0] == str(b / "llama-speculative-simple")
    assert spec[spec.index("--spec-type") + 1] == "draft-simple"  # without it, it does not speculate
    assert spec[spec.index("--spec-draft-n-max") + 1] == "5" and spec[spec.index("-md") + 1] == "d.gguf"
    for flag in ("-t", "-tb", "-td", "-tbd"):
        assert spec[spec.index(flag) + 1] == "2", flag


def test_gguf_of(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert lc.gguf_of(f) == f and lc.gguf_of(None) is None and lc.gguf_of(tmp_path / "missing.gguf") is None
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "x.gguf").write_bytes(b"GGUF")
    assert lc.gguf_of(tmp_path / "one") == tmp_path / "one" / "x.gguf"
    (tmp_path / "one" / "y.gguf").write_bytes(b"GGUF")
    assert lc.gguf_of(tmp_path / "one") is None and lc.gguf_of(tmp_path / "one" / "y.gguf").name == "y.gguf"


# -- in the bench ---------------------------------------------------------------------------------------
def test_without_llama_cpp_the_systems_are_skipped_in_one_line(tmp_path, copy_config, capsys):
    names = ["llama_cpp_target_only", "llama_cpp_spec"]
    out = tmp_path / "b"
    report = run_bench(BenchSettings(config=copy_config, out=out, prompts=1, max_new_tokens=4, systems=names),
                       prompt_ids=PROMPTS)
    reasons = {_entry(report, n)["status"] + ": " + _entry(report, n)["reason"] for n in names}
    (reason,) = reasons
    assert reason.startswith("skipped: no --llama-cpp BIN_DIR")
    err = [line for line in capsys.readouterr().err.splitlines() if "skipping" in line]
    assert err == [f"bench: skipping {', '.join(names)}: {reason[len('skipped: '):]}"]
    assert f"- skipped {', '.join(names)}: no --llama-cpp" in (out / "bench.md").read_text()


def test_unavailable_reasons(tmp_path, copy_config, fake_bin, ggufs):
    from hetero_spec.config import load_config

    ctx = SimpleNamespace(config=load_config(copy_config), llama_cpp=tmp_path, llama_cpp_target=ggufs[0],
                          llama_cpp_draft=None)
    assert "llama-completion not found" in lc.LlamaCppTargetOnly.unavailable(ctx)
    ctx.llama_cpp = fake_bin
    assert lc.LlamaCppTargetOnly.unavailable(ctx) is None
    assert "no GGUF of the draft" in lc.LlamaCppSpec.unavailable(ctx)  # the config's draft is an ONNX export
    ctx.llama_cpp_draft = tmp_path / "missing.gguf"
    assert "missing.gguf does not exist" in lc.LlamaCppSpec.unavailable(ctx)
    ctx.llama_cpp_target = None
    assert "--llama-cpp-target" in lc.LlamaCppTargetOnly.unavailable(ctx)


def test_bench_runs_the_fake_tools(tmp_path, copy_config, fake_bin, ggufs, llama_target):
    """A whole bench with the fake tools: arguments, prompt text, calibration, own clock, cut outputs."""
    from transformers import AutoTokenizer

    names, max_new = ["llama_cpp_target_only", "llama_cpp_spec"], 8
    report = run_bench(BenchSettings(config=copy_config, out=tmp_path / "b", prompts=2, max_new_tokens=max_new,
                                     systems=["target_only", *names], gammas=(2, 3, 4), llama_cpp=fake_bin,
                                     llama_cpp_target=ggufs[0], llama_cpp_draft=ggufs[1]),
                       prompt_ids=PROMPTS)
    tok = AutoTokenizer.from_pretrained(llama_target)
    digest = hashlib.sha1(str(tok.encode(GENERATED, add_special_tokens=False)[:max_new]).encode()).hexdigest()[:12]
    threads = dict.fromkeys((1, cores()))  # one thread, every core
    for n in names:
        e = _entry(report, n)
        assert e["status"] == "ok", (n, e["reason"])
        assert e["extra"]["backend"] == "llama.cpp" and e["extra"]["target_gguf"] == str(ggufs[0])
        assert e["extra"]["target_threads"] == 1  # the fake's clock ignores threads: the first one wins the tie
        assert [p["new_tokens"] for p in e["per_prompt"]] == [max_new, max_new] and e["speedup_vs_target_only"]
        # the outputs are the fake's text, encoded again with the target's tokenizer and cut at max_new
        assert all(p["token_ids_hash"] == digest for p in e["per_prompt"])
    spec = _entry(report, "llama_cpp_spec")
    assert spec["extra"]["gamma"] == BEST_K and set(spec["extra"]["calibration_s"]) == \
        {f"{t} {k}" for t in threads for k in (2, 3, 4)}
    assert spec["identical_to_llama_cpp_target_only"] == 2 and spec["extra"]["draft_gguf"] == str(ggufs[1])
    assert spec["acceptance_rate"] == pytest.approx((3 * 13 // 5) / (4 * 13 // 5))  # n_accept / n_drafted
    for p in spec["per_prompt"]:
        s = p["stats"]
        assert s["decoded_tokens"] == max_new + 5 and s["counted_tokens"] == max_new
        # the fake's own clock, decode scaled to the max_new tokens compared: not the process's wall time
        assert p["wall_s"] == pytest.approx(round(s["prefill_s"] + 0.01 * max_new, 6), abs=1e-6)
    p0 = _entry(report, "llama_cpp_target_only")["per_prompt"][0]
    assert p0["wall_s"] == pytest.approx((2.0 * p0["stats"]["prompt_tokens"] + 10.0 * (max_new - 1)) / 1e3)
    run = calls(tmp_path)
    spec_calls = [c for c in run if c["tool"] == "llama-speculative-simple"]
    assert {(c["args"]["-td"], c["args"]["--spec-draft-n-max"]) for c in spec_calls} == \
        {(str(t), str(k)) for t in threads for k in (2, 3, 4)}  # calibration, then the best
    assert all(c["args"]["-md"] == str(ggufs[1]) for c in spec_calls)
    assert {c["prompt"] for c in run} == {tok.decode(p, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                                         for p in PROMPTS}  # the bench's ids, as text, through -f
    assert all(int(c["args"]["-c"]) >= max(map(len, PROMPTS)) + max_new for c in run)
    assert "| llama_cpp_spec | llama.cpp |" in (tmp_path / "b" / "bench.md").read_text()
