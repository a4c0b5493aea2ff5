"""Processes started from multiprocessing's fork server: an interpreter that imported what they need
once (torch alone is 3.4 s of CPU on an AVX2 EPYC), each then forked from it in a fraction of a second.
The engine's TP ranks and DP groups start so (engine/tp.py, engine/dp.py), and so do the local launcher's
workers (serving/fleet/launcher.py, with a preload of its own). A process has one fork server: whichever
caller starts it first sets what it preloads, and the others' children import the rest themselves.

Without torch: the job's front starts the launcher's fork server and must not import it."""

from __future__ import annotations

import multiprocessing as mp
import tempfile

FORK_SERVER_TEMP_MAX = 60  # a longer TMPDIR would put the fork server's socket past AF_UNIX's 107 bytes


def fork_context(preload: list[str]):
    """multiprocessing's fork server context, preloading these modules if it is not running yet. Its
    socket lives in multiprocessing's private temp dir (made once per process, removed at exit): under a
    deep TMPDIR it is made in /tmp. The server itself never touches a GPU, so a CUDA process forked from
    it starts clean."""
    if mp.get_start_method(allow_none=True) not in (None, "spawn", "fork", "forkserver"):
        # inside a joblib (loky) sweep job: children would look for a 'loky' context and fail
        mp.set_start_method("spawn", force=True)
    if len(tempfile.gettempdir()) > FORK_SERVER_TEMP_MAX:
        from multiprocessing import util

        deep, tempfile.tempdir = tempfile.tempdir, "/tmp"
        try:
            util.get_temp_dir()  # made now, under /tmp, and kept for this process
        finally:
            tempfile.tempdir = deep
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)  # no effect once the server runs
    return ctx
