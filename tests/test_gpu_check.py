"""scripts/gpu_check: its rehearsal's quick form end to end (what CI can run of the GPU check), and the mechanisms
that keep a device call useful: a row printed and written at once, a failing section that does not stop the rest,
a time budget, and identity rows that cannot pass while proving nothing."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gc = sys.modules.setdefault("gpu_check", importlib.util.module_from_spec(spec))  # dataclasses look it up
spec.loader.exec_module(gc)


def test_rehearsal_quick_form_runs_every_non_cuda_section(tmp_path, demo_draft_int4):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    run = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--rehearse", "--quick", "--draft",
                          str(demo_draft_int4)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and not line.startswith("| section")]
    by_section: dict[str, list[str]] = {}
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        by_section.setdefault(cells[0], []).append(cells[2])
    assert set(by_section) == {s.name for s in gc.SECTIONS}
    for sec in gc.SECTIONS:
        if sec.cuda_only:
            assert by_section[sec.name] == ["skip"]
        else:
            assert gc.FAIL not in by_section[sec.name] and gc.PASS in by_section[sec.name], sec.name
    assert sum(r == gc.PASS for r in by_section["in process"]) == 1 + len(gc.SEEDS)  # greedy and each seed
    assert "gpu_check: PASSED" in run.stdout
    log = (tmp_path / "out" / "gpu_check.log").read_text()  # the whole log: every row, the verdict
    assert all(line in log for line in rows) and "gpu_check: PASSED" in log
    written = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [r["result"] for r in written["rows"]] == [r for s in by_section.values() for r in s]
    assert "PASSED" in written["header"][-1]
    assert (tmp_path / "out" / "gpu_check.md").read_text().count("\n| ") == len(rows) + 1


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _ctx(**kw) -> gc.Context:
    base = dict(target=ROOT / "models" / "target", draft=Path("draft-onnx"), device="cpu", rehearse=True, quick=True,
                tokens=8)
    return gc.Context(**{**base, **kw})


def test_each_row_is_printed_and_written_at_once_and_a_failure_does_not_stop_the_rest(tmp_path):
    clock, stream = Clock(), io.StringIO()
    table = gc.Table(tmp_path, budget_s=100, clock=clock, stream=stream)
    seen_on_disk = []

    def first(ctx, add):
        add("one", gc.PASS, "a")
        seen_on_disk.append((tmp_path / "gpu_check.md").read_text())  # written before the section goes on
        clock.t += 30
        raise ValueError("boom\nsecond line")

    def second(ctx, add):
        add("two", gc.PASS)

    gc.run_sections(table, _ctx(), [gc.Section("a", first), gc.Section("gpu", second, cuda_only=True),
                                    gc.Section("b", second, est_s=50), gc.Section("c", second, est_s=80)])
    assert "| a | one | PASS | a |" in seen_on_disk[0]
    got = [(r["section"], r["check"], r["result"]) for r in table.rows]
    assert got == [("a", "one", "PASS"), ("a", "raised", "FAIL"), ("gpu", "-", "skip"), ("b", "two", "PASS"),
                   ("c", "-", "FAIL")]
    assert table.rows[1]["detail"] == "ValueError: boom second line"
    assert "70 s left of the 100 s budget, it needs about 80 s" in table.rows[-1]["detail"]
    printed = [line for line in stream.getvalue().splitlines() if line.startswith("| ")]
    assert printed[1:] == [f"| {r['section']} | {r['check']} | {r['result']} | {r['detail']} |" for r in table.rows]
    assert [r["result"] for r in table.failed()] == ["FAIL", "FAIL"]


def test_identity_rows_cannot_pass_while_proving_nothing(monkeypatch):
    ctx = _ctx(prompt=[1, 2])
    assert gc.identity(ctx, [5, 6], [5, 6], drafted=0)[0] == gc.FAIL  # speculation never ran
    assert gc.identity(ctx, [5, 6], [5, 6], drafted=3) == (gc.PASS, "2 tokens identical")
    margins = iter([1e-5, 0.5])
    asked = []
    monkeypatch.setattr(gc, "top2_margin", lambda c, ids, **kw: (asked.append(ids), next(margins))[1])
    result, why = gc.identity(ctx, [5, 6, 9], [5, 6, 7], drafted=3)
    assert result == gc.TIE and "generated token 2: reference [7], checked [9]" in why and "1.00e-05" in why
    assert asked == [[1, 2, 5, 6]]  # the margin is the target's own, after the common part
    assert gc.identity(ctx, [5, 6, 9], [5, 6, 7], drafted=3)[0] == gc.FAIL  # a clear margin: a real difference
    assert gc.identity(ctx, [5, 9], [5, 7], drafted=3, greedy=False)[0] == gc.FAIL  # sampled: no tie excuse
    assert gc.identity(ctx, [5], [5, 7], drafted=3)[0] == gc.FAIL  # one stopped early


def test_without_cuda_and_without_rehearse_it_fails_loudly(tmp_path, capsys):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gc.main(["--out", str(tmp_path)]) == 1
    assert "torch sees no CUDA device; on a CPU machine use --rehearse" in capsys.readouterr().out
    assert "FAIL" in (tmp_path / "gpu_check.md").read_text()


# -- fail fast: what the call must carry is checked before any Python runs -----------------------------------------
def _fake_python(tmp_path: Path) -> tuple[Path, Path]:
    """An interpreter that only records that it was run."""
    ran = tmp_path / "python-ran"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {ran}\nexit 0\n")
    fake.chmod(0o755)
    return fake, ran


@pytest.mark.parametrize("carried", ["absent", "no-draft"])
def test_a_missing_carry_fails_at_once_with_one_line(tmp_path, carried):
    gpu = tmp_path / "gpu"
    if carried == "no-draft":
        (gpu / "whl").mkdir(parents=True)
        (gpu / "whl" / "pydantic-2.0-py3-none-any.whl").write_bytes(b"")
    fake, ran = _fake_python(tmp_path)
    env = {**os.environ, "PYTHON": str(fake), "GPU_CHECK_CARRIED": str(gpu), "OUT": str(tmp_path / "out")}
    run = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 3
    lines = (run.stdout + run.stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: FAILED: "), lines
    missing = f"{gpu}/whl" if carried == "absent" else f"{gpu}/draft-onnx-int4/model.onnx"
    assert missing in lines[0] and "scripts/gpu_wheels.sh" in lines[0]
    assert not ran.exists()  # no interpreter, no install: nothing of the device's time went on it
    assert (tmp_path / "out" / "gpu_check.failed").read_text().strip() == lines[0]
    assert (tmp_path / "out" / "gpu_check.log").read_text().strip() == lines[0]


def test_the_import_gate_stops_the_call_with_the_reason(tmp_path, demo_draft_int4):
    """The carried wheels install, but one import fails: one FAILED line naming it, and no section runs."""
    gpu = tmp_path / "gpu"
    (gpu / "whl").mkdir(parents=True)
    broken = tmp_path / "site"  # a zmq that does not import, first on the path as a carried wheel would be
    (broken / "zmq").mkdir(parents=True)
    (broken / "zmq" / "__init__.py").write_text("raise ImportError('carried pyzmq is broken')\n")
    wheel = gpu / "whl" / "nothing-1.0-py3-none-any.whl"
    import zipfile
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("nothing/__init__.py", "")
        zf.writestr("nothing-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: nothing\nVersion: 1.0\n")
        zf.writestr("nothing-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("nothing-1.0.dist-info/RECORD", "")
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_CARRIED": str(gpu), "PYTHONPATH": str(broken)}
    run = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--device-stack", "--draft", str(demo_draft_int4)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stdout + run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last == "gpu_check: FAILED: the import gate: ImportError: carried pyzmq is broken"
    assert "| section |" not in run.stdout


# -- rows that cannot pass vacuously: each fails on a faked wrong result --------------------------------------------
class FakeOut:
    def __init__(self, ids, drafted=5):
        self.token_ids = list(ids)
        self.stats = {"drafted": drafted, "acceptance_rate": 0.5, "tokens_per_s": 1.0, "rounds": 2,
                      "time_draft_s": 0.0, "time_wait_s": 0.0, "time_verify_s": 0.0, "time_prefill_s": 0.0}


class FakeStaging:
    def __init__(self, pinned=True, copies=3):
        self.pinned, self.copies = pinned, copies


class FakeEngine:
    """Engine.from_config(cfg) -> an engine whose generate answers `answer(cfg, prompt, kw)`."""

    answer = None
    staging = FakeStaging()
    configs: list = []

    def __init__(self, cfg):
        self.cfg = cfg
        self.target = type("T", (), {"staging": FakeEngine.staging})()
        self.lock = __import__("threading").Lock()

    @classmethod
    def from_config(cls, cfg):
        cls.configs.append(cfg)
        return cls(cfg)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def generate(self, prompt, **kw):
        return FakeEngine.answer(self.cfg, prompt, kw)

    def batch_sizes(self):
        return [4]


@pytest.fixture
def fake_engine(monkeypatch):
    import hetero_spec

    FakeEngine.staging, FakeEngine.configs = FakeStaging(), []
    monkeypatch.setattr(hetero_spec, "Engine", FakeEngine, raising=False)
    return FakeEngine


def _rows(section, ctx) -> list[tuple[str, str, str]]:
    rows = []
    section(ctx, lambda check, result, detail="": rows.append((check, result, detail)))
    return rows


REF = [3, 4, 5, 6]


def test_cpu_reference_row_fails_when_the_device_differs_from_the_cpu(fake_engine, monkeypatch):
    ctx = _ctx(device="cuda", prompt=[1, 2], ref=REF)
    fake_engine.answer = lambda cfg, prompt, kw: FakeOut([3, 4, 9, 9] if cfg["target"]["device"] == "cpu" else REF)
    monkeypatch.setattr(gc, "top2_margin", lambda c, ids, **kw: 0.5)
    [(check, result, detail)] = _rows(gc.cpu_reference, ctx)
    assert result == gc.FAIL and "generated token 2: reference [9], checked [5]" in detail
    assert fake_engine.configs[0]["target"]["device"] == "cpu"
    fake_engine.answer = lambda cfg, prompt, kw: FakeOut(REF)
    assert _rows(gc.cpu_reference, ctx)[0][1] == gc.PASS


@pytest.mark.parametrize("margin, expected", [(1e-5, gc.TIE), (0.5, gc.FAIL)])
def test_batched_rows_take_the_near_tie_rule(fake_engine, monkeypatch, margin, expected):
    ctx = _ctx(prompt=list(range(12)), tokens=4)
    fake_engine.answer = lambda cfg, prompt, kw: FakeOut(REF)  # the solo runs
    monkeypatch.setattr(gc, "together", lambda eng, prompts, n: [REF, REF, [3, 4, 7, 7], REF])
    asked = []
    monkeypatch.setattr(gc, "top2_margin", lambda c, ids, **kw: (asked.append(ids), margin)[1])
    rows = _rows(gc.batched, ctx)
    assert rows[1][1] == expected and "request 2" in rows[1][2] and "request 0" not in rows[1][2]
    assert asked == [ctx.prompt[5:] + [3, 4]]  # the margin after that request's own prompt


@pytest.mark.parametrize("margin, expected", [(1e-5, gc.TIE), (0.5, gc.FAIL)])
def test_kv_cache_rows_take_the_near_tie_rule_with_their_own_cache(fake_engine, monkeypatch, margin, expected):
    ctx = _ctx(prompt=[1, 2], tokens=4)  # quick: int8 only
    fake_engine.answer = lambda cfg, prompt, kw: FakeOut(REF if cfg["draft"]["kind"] == "none" else [3, 8, 8, 8])
    asked = []
    monkeypatch.setattr(gc, "top2_margin", lambda c, ids, **kw: (asked.append((ids, kw["kv"])), margin)[1])
    [(check, result, detail)] = _rows(gc.kv_caches, ctx)
    assert check.startswith("KV cache int8") and result == expected
    assert asked == [([1, 2, 3], "int8")]


def test_bf16_row_requires_drafts(fake_engine):
    ctx = _ctx(device="cuda", prompt=[1, 2])
    fake_engine.answer = lambda cfg, prompt, kw: FakeOut(REF, drafted=0)
    assert _rows(gc.bf16, ctx)[0][1] == gc.FAIL
    fake_engine.answer = lambda cfg, prompt, kw: FakeOut(REF)
    assert _rows(gc.bf16, ctx)[0][1] == gc.PASS


@pytest.mark.parametrize("staging, expected", [(FakeStaging(pinned=False), gc.FAIL), (FakeStaging(copies=0), gc.FAIL),
                                               (FakeStaging(), gc.PASS)])
def test_the_engines_own_staging_must_be_pinned_and_used(fake_engine, staging, expected):
    ctx = _ctx(device="cuda", prompt=[1, 2], ref=REF, ref_sampled=[REF] * len(gc.SEEDS))
    fake_engine.staging = staging
    fake_engine.answer = lambda cfg, prompt, kw: FakeOut(REF)
    rows = {check: result for check, result, _ in _rows(gc.in_process, ctx)}
    assert rows["the engine's staging: pinned, and used"] == expected
    assert rows["greedy: identical to the target alone"] == gc.PASS


def test_the_non_blocking_row_judges_staging_tokens():
    assert gc.judge_async(0.05, 40.0, ids_ok=True)[0] == gc.PASS
    assert gc.judge_async(30.0, 40.0, ids_ok=True)[0] == gc.FAIL  # the call waited for the GPU: not asynchronous
    assert gc.judge_async(0.05, 40.0, ids_ok=False)[0] == gc.FAIL  # fast, but staged the wrong ids
    assert gc.judge_pinned(False, None)[0] == gc.FAIL and gc.judge_pinned(True, None)[0] == gc.PASS
    import inspect
    src = inspect.getsource(gc.staging)
    assert "st.tokens(list(range(8)))" in src and "non_blocking=True)" not in src.split("judge_async")[0]
