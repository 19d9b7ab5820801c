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
    base = dict(target=ROOT / "models" / "target", draft=None, device="cpu", rehearse=True, quick=True, tokens=8)
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
    monkeypatch.setattr(gc, "top2_margin", lambda c, ids: (asked.append(ids), next(margins))[1])
    result, why = gc.identity(ctx, [5, 6, 9], [5, 6, 7], drafted=3)
    assert result == gc.TIE and "generated token 2: target alone [7], speculative [9]" in why and "1.00e-05" in why
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
