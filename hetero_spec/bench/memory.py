"""Peak memory: the bench process's RSS high-water mark (getrusage: every system in it), and each child
process's own (VmHWM in /proc/PID/status, sampled while it runs: the draft worker, llama.cpp's tools).
RUSAGE_CHILDREN is not used: a forked child keeps the parent's size at fork as its ru_maxrss. MB = 10^6 bytes."""

from __future__ import annotations

import os
import resource
import sys
import threading
from pathlib import Path
from typing import Any

PROC = Path("/proc")


def status_mb(pid: int, key: str = "VmHWM") -> float | None:
    """A field of /proc/PID/status in MB (VmHWM: peak RSS, VmRSS: RSS now), or None (gone, or no /proc)."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return round(int(line.split()[1]) * 1024 / 1e6, 2)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _descendants(root: int) -> dict[int, str]:
    """pid -> program name (argv[0]'s file name) of every live descendant of root."""
    parent: dict[int, int] = {}
    for d in PROC.glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            parent[int(d.name)] = int(stat[stat.rfind(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out: dict[int, str] = {}
    frontier = [root]
    while frontier:
        p = frontier.pop()
        for pid in [pid for pid, pp in parent.items() if pp == p and pid not in out]:
            try:
                out[pid] = Path((PROC / str(pid) / "cmdline").read_bytes().split(b"\0", 1)[0].decode()).name or "?"
            except (OSError, UnicodeDecodeError):
                out[pid] = "?"
            frontier.append(pid)
    return out


class ChildPeaks:
    """Samples the VmHWM of this process's descendants every `interval` seconds in a daemon thread; `stop()`
    returns the largest per program name. A no-op without /proc."""

    def __init__(self, interval: float = 0.25):
        self.interval, self.peaks, self._stop = interval, {}, threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ChildPeaks:
        if (PROC / "self" / "status").is_file():
            self._thread = threading.Thread(target=self._loop, name="bench-child-memory", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            for pid, name in _descendants(os.getpid()).items():
                if (mb := status_mb(pid)) is not None:
                    self.peaks[name] = max(self.peaks.get(name, 0.0), mb)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return dict(sorted(self.peaks.items()))


def memory_report(children: dict[str, float] | None) -> dict[str, Any]:
    """bench.json's memory entry."""
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e6, 1),
            "children": children or {}, "note": "bench process: getrusage ru_maxrss; children: each one's own "
                                               "VmHWM by program name, sampled while it ran; MB = 10^6 bytes"}
