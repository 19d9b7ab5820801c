"""Transparent huge pages for the memory a model's sessions hold.

A decode step reads every weight once. In 4 KiB pages that is a page-table walk every 4 KiB; in 2 MiB pages, 512
times fewer. Linux backs anonymous memory with huge pages only where the system's THP mode is `always`, or where
the process asks (`madvise`, the default of Debian and Ubuntu), and neither onnxruntime nor glibc's malloc asks. So
once the models are loaded, `collapse()` asks for the large anonymous mappings of this process (the prepacked
weights, the arena): MADV_HUGEPAGE, so that what faults in later comes in huge pages, and MADV_COLLAPSE (Linux
6.1+), which moves what is there into huge pages now. It is a hint: where the kernel lacks it or memory is too
fragmented, pages stay as they are and nothing else changes. It touches no file-backed mapping.

Measured in docs/benchmarks.md (against ONNX Runtime GenAI on the same graph). `runtime.huge_pages: false` turns it
off.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
MIN_REGION = 8 << 20  # smaller mappings are Python's arenas and small buffers; weights come in far larger ones

#: madvise(address, length, advice) -> 0 or an errno (the seam the tests replace)
Madvise = Callable[[int, int, int], int]


@dataclass
class CollapseResult:
    regions: int = 0  # anonymous mappings of at least MIN_REGION
    advised: int = 0  # bytes in whole huge pages asked for (MADV_HUGEPAGE)
    collapsed: int = 0  # of those, bytes the kernel moved into huge pages now (MADV_COLLAPSE)
    error: str | None = None  # why nothing was asked (not Linux, no THP)

    def __str__(self) -> str:
        if self.error:
            return f"huge pages: not used ({self.error})"
        return (f"huge pages: {self.collapsed >> 20} MB of {self.advised >> 20} MB in {self.regions} "
                "anonymous mappings moved into 2 MB pages")


def anonymous_regions(maps: str, min_bytes: int = MIN_REGION) -> list[tuple[int, int]]:
    """The 2 MiB-aligned (start, end) inside each private, writable, anonymous mapping of /proc/PID/maps text at
    least min_bytes long (the heap included); the unaligned ends stay out (MADV_COLLAPSE takes whole huge pages)."""
    out = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        span, perms, inode = fields[0], fields[1], fields[4]
        path = fields[5].strip() if len(fields) > 5 else ""
        if not perms.startswith("rw") or perms[3:4] != "p" or inode != "0" or path not in ("", "[heap]"):
            continue
        lo, hi = (int(x, 16) for x in span.split("-"))
        if hi - lo < min_bytes:
            continue
        start, end = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
        if end > start:
            out.append((start, end))
    return out


def _libc_madvise() -> Madvise | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int

    def madvise(address: int, length: int, advice: int) -> int:
        return 0 if libc.madvise(address, length, advice) == 0 else ctypes.get_errno()
    return madvise


def collapse(maps: str | None = None, madvise: Madvise | None = None, min_bytes: int = MIN_REGION) -> CollapseResult:
    """Ask for huge pages over this process's large anonymous mappings (the module's docstring). maps and madvise
    replace /proc/self/maps and libc's madvise (tests). Never raises: the result says what was done."""
    madvise = madvise or _libc_madvise()
    if madvise is None:
        return CollapseResult(error="not Linux")
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError as exc:
            return CollapseResult(error=f"cannot read /proc/self/maps: {exc}")
    result = CollapseResult()
    for start, end in anonymous_regions(maps, min_bytes):
        err = madvise(start, end - start, MADV_HUGEPAGE)
        if err == errno.EINVAL and result.regions == 0:  # a kernel without THP: nothing to gain anywhere
            return CollapseResult(error=f"MADV_HUGEPAGE: {os.strerror(err)}")
        result.regions += 1
        if err:  # this mapping cannot have them (it went away, or its kind): the next may
            continue
        result.advised += end - start
        # page by page: a call fails as a whole if one huge page cannot be had, and the rest still can; EINVAL: the
        # kernel has no MADV_COLLAPSE (before 6.1) or the mapping refuses it; khugepaged may still collapse it later
        for page in range(start, end, HUGE_PAGE):
            err = madvise(page, HUGE_PAGE, MADV_COLLAPSE)
            if err == 0:
                result.collapsed += HUGE_PAGE
            elif err == errno.EINVAL:
                break
    return result
