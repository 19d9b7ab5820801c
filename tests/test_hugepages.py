"""hugepages.collapse: which mappings it asks for and what it does when the kernel says no (a fake madvise); the
engine and the draft worker ask once their models are loaded, unless runtime.huge_pages is false."""

from __future__ import annotations

import errno

import pytest

from hetero_spec import hugepages
from hetero_spec.hugepages import HUGE_PAGE, MADV_COLLAPSE, MADV_HUGEPAGE, anonymous_regions, collapse

MiB = 1 << 20


def _line(lo: int, hi: int, perms: str = "rw-p", inode: str = "0", path: str = "") -> str:
    return f"{lo:x}-{hi:x} {perms} 00000000 00:00 {inode} {path}".rstrip()


BIG = (0x7f0000100000, 0x7f0000100000 + 40 * MiB)  # starts 1 MiB past a huge-page boundary
HEAP = (0x7f1000000000, 0x7f1000000000 + 16 * MiB)
MAPS = "\n".join([
    _line(*BIG),
    _line(*HEAP, path="[heap]"),
    _line(0x7f2000000000, 0x7f2000000000 + 4 * MiB),  # small: Python's arenas
    _line(0x7f3000000000, 0x7f3000000000 + 64 * MiB, perms="r--p"),  # read-only
    _line(0x7f4000000000, 0x7f4000000000 + 64 * MiB, inode="1234", path="/cache/model.onnx.data"),  # a file
    _line(0x7f5000000000, 0x7f5000000000 + 64 * MiB, perms="rw-s"),  # shared memory
    _line(0x7f6000000000, 0x7f6000000000 + 64 * MiB, path="[stack]"),
    "not a maps line",
])
REGIONS = [(BIG[0] + MiB, BIG[1] - MiB), HEAP]


def test_regions_are_large_private_writable_anonymous_and_cut_to_whole_huge_pages():
    assert anonymous_regions(MAPS) == REGIONS
    assert all(start % HUGE_PAGE == 0 and end % HUGE_PAGE == 0 for start, end in REGIONS)
    assert anonymous_regions(MAPS, min_bytes=20 * MiB) == REGIONS[:1]


class FakeKernel:
    """madvise: `hugepage` per region start (default 0), EAGAIN for the pages in `full`, `collapse_err` for every
    MADV_COLLAPSE when set."""

    def __init__(self, hugepage: dict[int, int] | None = None, full: frozenset[int] = frozenset(),
                 collapse_err: int = 0):
        self.calls: list[tuple[int, int, int]] = []
        self.hugepage, self.full, self.collapse_err = hugepage or {}, full, collapse_err

    def __call__(self, address: int, length: int, advice: int) -> int:
        self.calls.append((address, length, advice))
        if advice == MADV_HUGEPAGE:
            return self.hugepage.get(address, 0)
        return self.collapse_err or (errno.EAGAIN if address in self.full else 0)


def _pages(region: tuple[int, int]) -> int:
    return (region[1] - region[0]) // HUGE_PAGE


def test_collapse_advises_each_region_and_collapses_it_page_by_page():
    start, end = REGIONS[0]
    kernel = FakeKernel(full=frozenset({start + 3 * HUGE_PAGE}))  # one page the kernel finds no room for
    result = collapse(MAPS, kernel)
    total = sum(e - s for s, e in REGIONS)
    assert (result.regions, result.advised, result.collapsed, result.error) == (2, total, total - HUGE_PAGE, None)
    assert kernel.calls[0] == (start, end - start, MADV_HUGEPAGE)
    pages = [(a, n) for a, n, advice in kernel.calls if advice == MADV_COLLAPSE]
    assert pages[:_pages(REGIONS[0])] == [(a, HUGE_PAGE) for a in range(start, end, HUGE_PAGE)]
    assert len(pages) == sum(_pages(r) for r in REGIONS)
    assert "moved into 2 MB pages" in str(result)


def test_a_kernel_without_madv_collapse_gets_the_advice_only():
    kernel = FakeKernel(collapse_err=errno.EINVAL)
    result = collapse(MAPS, kernel)
    assert (result.regions, result.collapsed, result.error) == (2, 0, None)
    assert result.advised == sum(e - s for s, e in REGIONS)
    assert [advice for _, _, advice in kernel.calls].count(MADV_COLLAPSE) == 2  # one try per region


def test_a_kernel_without_thp_stops_at_the_first_region():
    kernel = FakeKernel(hugepage={REGIONS[0][0]: errno.EINVAL})
    result = collapse(MAPS, kernel)
    assert (result.advised, result.collapsed) == (0, 0)
    assert "MADV_HUGEPAGE" in result.error and "not used" in str(result)
    assert len(kernel.calls) == 1


def test_a_mapping_that_refuses_is_skipped_and_the_next_still_asked():
    kernel = FakeKernel(hugepage={REGIONS[1][0]: errno.ENOMEM})
    result = collapse(MAPS, kernel)
    assert (result.regions, result.advised, result.collapsed) == (2, REGIONS[0][1] - REGIONS[0][0],
                                                                  REGIONS[0][1] - REGIONS[0][0])


def test_not_linux_is_a_no_op(monkeypatch):
    monkeypatch.setattr(hugepages.sys, "platform", "darwin")
    assert collapse(MAPS).error == "not Linux"


def test_on_this_process_it_never_raises():
    result = collapse(min_bytes=1 << 50)  # no mapping that large: reads the real maps, asks nothing
    assert (result.regions, result.advised, result.collapsed, result.error) == (0, 0, 0, None)


@pytest.mark.parametrize("on", [True, False])
def test_the_engine_asks_once_its_models_are_loaded_unless_turned_off(monkeypatch, llama_target, on):
    from hetero_spec import Engine

    calls = []
    monkeypatch.setattr(hugepages, "collapse", lambda: calls.append(1) or hugepages.CollapseResult(regions=1))
    with Engine.from_config({"target": {"model": str(llama_target), "dtype": "float32"}, "draft": {"kind": "ngram"},
                             "runtime": {"huge_pages": on}}) as eng:
        assert calls == ([1] if on else [])
        assert (eng.huge_pages is not None) == on


@pytest.mark.parametrize("on", [True, False])
def test_the_draft_worker_is_told_when_huge_pages_are_off(monkeypatch, on):
    from hetero_spec.config import DraftConfig, RuntimeConfig
    from hetero_spec.runtime import supervisor as sup_mod

    seen = []

    class Launched(Exception):
        pass

    def popen(cmd, **_):
        seen.append(cmd)
        raise Launched

    monkeypatch.setattr(sup_mod.subprocess, "Popen", popen)
    spec = sup_mod.WorkerSpec(runtime=RuntimeConfig(huge_pages=on), draft=DraftConfig(), vocab_width=16)
    sup = sup_mod.DraftSupervisor(spec)
    try:
        with pytest.raises(Exception):  # noqa: B017 - the launch stops at Popen (Launched, or the start error it becomes)
            sup.launch(spec, 1)
    finally:
        sup.close()
    assert seen and ("--no-huge-pages" in seen[0]) == (not on)
