"""The processes below a worker, from /proc: found, waited for and killed, so nothing of a stopped
deployment outlives it (a worker's TP ranks too); and die_with(), which ends a process with the job
that started it, however that job ends."""

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


def exit_waiter(pid: int, poll_s: float = 1.0):
    """A call that returns once process pid has ended, however it ends (it blocks on a pidfd, Linux 5.3+;
    elsewhere it polls every poll_s), or None when pid has ended already."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):  # no pidfd here: poll

        def poll() -> None:
            while (fields := _stat(pid)) is not None and fields[0] != "Z":
                time.sleep(poll_s)

        return poll
    return lambda: select.select([fd], [], [])


def die_with(owner: int, what: str = "this process") -> None:
    """End this process, and every process below it, when process `owner` ends, however it ends (a
    SIGKILL runs no cleanup of its own): a daemon thread waits on a pidfd of owner (Linux 5.3+; elsewhere
    it polls owner once a second), then SIGKILLs what runs below this process and this process.
    For what the local launcher starts (the fork server, each worker and grammar or template child),
    whose parent is not the job that needs them: PR_SET_PDEATHSIG follows the parent, and the thread
    that made it. An owner already gone ends this process at once."""
    import signal
    import threading

    def end() -> None:
        log.info("%s: its owner (pid %d) is gone: stopping", what, owner)
        for pid, _ in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    wait = exit_waiter(owner)
    if wait is None:
        end()

    def watch() -> None:
        wait()
        end()

    threading.Thread(target=watch, name=f"die-with-{owner}", daemon=True).start()
