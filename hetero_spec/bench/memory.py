"""Peak memory of a bench run: the bench process and the processes it starts.

- The bench process: getrusage(RUSAGE_SELF).ru_maxrss, its RSS high-water mark (every system that runs inside
  it, their models loaded together).
- Its child processes (the two-process engine's draft worker, llama.cpp's tools): each one's own high-water mark,
  VmHWM in /proc/PID/status, sampled by a watcher thread while it runs (Linux). getrusage(RUSAGE_CHILDREN) is
  not used: on Linux a child started with fork or vfork and exec keeps the parent's RSS at that moment as its
  ru_maxrss, so it reads at least the bench's own size, whatever the child uses.
MB are 10^6 bytes.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
from pathlib import Path
from typing import Any

PROC = Path("/proc")


def self_peak_mb() -> float:
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e6, 1)


def vm_hwm_mb(pid: int) -> float | None:
    """A live process's RSS high-water mark (VmHWM), or None (gone, a zombie, or no /proc)."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) * 1024 / 1e6, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _name(pid: int, comm: str) -> str:
    """The program's file name (argv[0]; /proc's comm is cut at 15 characters)."""
    try:
        argv0 = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0", 1)[0].decode("utf-8", "replace")
    except OSError:
        return comm
    return Path(argv0).name or comm


def _descendants(root: int) -> dict[int, str]:
    """pid -> program name of every live descendant of root, from /proc/*/stat."""
    parent: dict[int, tuple[int, str]] = {}
    for d in PROC.glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2:].split()
        parent[int(d.name)] = (int(fields[1]), name)
    out: dict[int, str] = {}
    frontier = [root]
    while frontier:
        p = frontier.pop()
        for pid, (ppid, name) in parent.items():
            if ppid == p and pid not in out:
                out[pid] = _name(pid, name)
                frontier.append(pid)
    return out


class ChildPeaks:
    """Samples the VmHWM of this process's descendants every `interval` seconds in a daemon thread; `stop()`
    returns the largest per command name. A no-op where there is no /proc."""

    def __init__(self, interval: float = 0.25):
        self.interval, self.peaks = interval, {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ChildPeaks:
        if (PROC / "self" / "status").is_file():
            self._thread = threading.Thread(target=self._loop, name="bench-child-memory", daemon=True)
            self._thread.start()
        return self

    def note(self, name: str, mb: float | None) -> None:
        """A child's peak measured elsewhere (llama.cpp's tools poll their own, more often)."""
        if mb is not None:
            self.peaks[name] = max(self.peaks.get(name, 0.0), mb)

    def _loop(self) -> None:
        me = os.getpid()
        while not self._stop.wait(self.interval):
            for pid, name in _descendants(me).items():
                self.note(name, vm_hwm_mb(pid))

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return dict(sorted(self.peaks.items()))


def report(children: dict[str, float] | None) -> dict[str, Any]:
    """bench.json's memory entry."""
    children = children or {}
    return {"peak_rss_mb": self_peak_mb(),
            "children_peak_rss_mb": max(children.values()) if children else None,
            "children": children,
            "note": "bench process: getrusage ru_maxrss (every system inside it, models loaded together); children: "
                    "each child process's own VmHWM by command name, sampled while it ran (the largest over its "
                    "runs); MB = 10^6 bytes"}
