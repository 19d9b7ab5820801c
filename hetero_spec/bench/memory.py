"""Peak memory: the bench process's RSS high-water mark (getrusage: every system in it), and each child
process's own (VmHWM, sampled while it runs: the draft worker, llama.cpp's tools). RUSAGE_CHILDREN is not used:
a forked child keeps the parent's size at fork as its ru_maxrss. MB = 10^6 bytes."""

import contextlib
import os
import resource
import sys
import threading
from pathlib import Path
from typing import Any

PROC = Path("/proc")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:  # the process is gone, or there is no /proc
        return ""


def status_mb(pid: int, key: str = "VmHWM") -> float | None:
    """A field of /proc/PID/status in MB (VmHWM: peak RSS, VmRSS: RSS now), or None."""
    line = next((ln for ln in _read(PROC / str(pid) / "status").splitlines() if ln.startswith(f"{key}:")), None)
    return round(int(line.split()[1]) * 1024 / 1e6, 2) if line else None


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid (/proc/PID/task/*/children); a process that ends meanwhile has none."""
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:  # it ended between its parent's listing and this one
        return []
    kids = [int(c) for task in tasks for c in _read(task / "children").split()]
    return kids + [d for k in kids for d in descendants(k)]


@contextlib.contextmanager
def child_peaks(interval: float = 0.25):
    """Yields a dict that a daemon thread fills, every `interval` seconds until the block ends, with the largest
    VmHWM of this process's descendants per program name (argv[0]'s file name)."""
    peaks, stop = {}, threading.Event()

    def loop() -> None:
        while not stop.wait(interval):
            for pid in descendants(os.getpid()):
                name = Path(_read(PROC / str(pid) / "cmdline").split("\0")[0]).name
                if name and (peak := status_mb(pid)) is not None:
                    peaks[name] = max(peaks.get(name, 0.0), peak)

    thread = threading.Thread(target=loop, name="bench-child-memory", daemon=True)
    thread.start()
    try:
        yield peaks
    finally:
        stop.set()
        thread.join(timeout=5)


def memory_report(children: dict[str, float] | None) -> dict[str, Any]:
    """bench.json's memory entry."""
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e6, 1),
            "children": dict(sorted((children or {}).items()))}
