"""The processes below a worker, from /proc: found, waited for and killed, so nothing of a stopped
deployment outlives it (a worker's TP ranks too)."""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)


def descendants(pid: int | None) -> list[tuple[int, str]]:
    """(pid, start time) of every process below pid on this host, from /proc ([] elsewhere, or for a
    process that is not local: a Ray actor's pid lives on its node)."""
    if not isinstance(pid, int) or not os.path.isdir("/proc"):
        return []
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        fields = _stat(entry) if entry.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def _stat(pid) -> list[str] | None:
    """/proc/<pid>/stat's fields after "(comm)": state, ppid, ..., starttime at [19]; None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def reap(procs: list[tuple[int, str]], timeout_s: float) -> None:
    """Wait up to timeout_s for these processes (pid, start time) to exit, then SIGKILL the rest (a pid
    reused since, with another start time, is left alone)."""
    import signal

    def alive(pid: int, start: str) -> bool:
        fields = _stat(pid)
        return fields is not None and fields[19] == start and fields[0] != "Z"

    give_up = time.monotonic() + timeout_s
    while any(alive(*p) for p in procs) and time.monotonic() < give_up:
        time.sleep(0.05)
    for pid, start in procs:
        if alive(pid, start):
            log.warning("process %d of a stopped worker was still running: killed", pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
