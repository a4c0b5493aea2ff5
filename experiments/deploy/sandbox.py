"""Untrusted work the HTTP server must be able to stop: a model folder's chat template, and a client's
structured-output spec (JSON-schema conversion and the grammar's compile against the vocabulary).

Each kind runs in a small pool of child processes (forked from the launcher's fork server, which has
torch imported), never on the event loop or a worker's step loop:
- a child's address space is capped (RLIMIT_AS: its size when it started plus the kind's max_bytes), and
  each task's CPU time (RLIMIT_CPU: the child's CPU time so far plus the task's timeout; SIGXCPU ends it);
- the caller waits on the child's pipe for the task's timeout; past it, or when the caller gives up (its
  client went away), the child is killed and a fresh one started. A C-level operation that holds the
  GIL for a minute (`10 ** 30000000` in a template) or a schema whose conversion grows without bound
  costs one child, not the server;
- what crosses the pipe is msgspec JSON, never a pickle;
- one client's tasks hold at most all children but one at a time (run(task, client)): six hostile
  grammars from one client held both grammar children, and another client's trivial schema waited
  14.7-19.5 s; the others wait for their client's turn, cancelled with it. Children run at a lower
  CPU priority (nice 10) than the server and its workers.
A grammar compiled here reaches the worker serialized (Submit.grammar) and is only loaded there.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec

log = logging.getLogger(__name__)
KINDS = ("template", "grammar")
START_TIMEOUT_S = 60.0  # a child's start (imports) may take this long: not counted in a task's time
POLL_S = 0.05  # how often a waiting task looks whether its caller gave up
MAX_COMPILED_CHARS = 16 << 20  # a compiled grammar's serialized length (it travels in a Submit)
CHILD_NICE = 10  # the children's CPU priority below the server's


class Setup(msgspec.Struct, frozen=True):
    """What a child of one kind needs: the chat template and BOS token, or the vocabulary (xgrammar's
    TokenizerInfo JSON); its address-space allowance; the longest output it may return."""

    kind: str
    max_bytes: int
    max_output: int
    chat_template: str | None = None
    bos_token: str | None = None
    tokenizer_info: str | None = None


class Task(msgspec.Struct, frozen=True):
    timeout_s: float
    messages: list[dict[str, str]] = []  # template
    spec: tuple[str, str] | None = None  # grammar: StructuredOutputs.wire()


class Reply(msgspec.Struct, frozen=True):
    ok: str | None = None
    error: str | None = None
    spent: bool = False  # the child ran out of memory and leaves: a fresh one takes its place


class SandboxError(ValueError):
    """The task failed, ran past its time or memory, or its child died: the request's fault."""


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _child_main(conn, setup_json: bytes) -> None:
    """A child: its limits, then one task at a time from the pipe until it closes."""
    setup = msgspec.json.decode(setup_json, type=Setup)
    os.nice(CHILD_NICE)  # a compile's CPU yields to the event loop and the workers' steps
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + setup.max_bytes, hard))
    work = _template_work(setup) if setup.kind == "template" else _grammar_work(setup)
    conn.send_bytes(b"ready")
    while True:
        try:
            task = msgspec.json.decode(conn.recv_bytes(), type=Task)
        except EOFError:
            return
        _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
        resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(_cpu_s() + task.timeout_s) + 1, cpu_hard))
        try:
            out = work(task)
            too_long = len(out) > setup.max_output
            reply = Reply(error=_too_long(setup, len(out))) if too_long else Reply(ok=out)
        except MemoryError:  # over the address-space cap: this child's heap may be in pieces, so it goes
            reply = Reply(error=f"ran out of its memory ({setup.max_bytes} bytes)", spent=True)
        except Exception as e:  # ValueError naming the field, or anything the model file's code raised
            reply = Reply(error=str(e) or type(e).__name__)
        conn.send_bytes(msgspec.json.encode(reply))
        if reply.spent:
            return


def _too_long(setup: Setup, n: int) -> str:
    what = "the rendered chat" if setup.kind == "template" else "the compiled grammar"
    return f"{what} is {n} characters; at most {setup.max_output} are taken"


def _template_work(setup: Setup):
    from engine.tokenizer import compile_template, render_template

    template = None

    def render(task: Task) -> str:
        nonlocal template
        if not setup.chat_template:
            raise ValueError("this model has no chat template; pass plain prompts")
        template = template or compile_template(setup.chat_template)
        return render_template(template, task.messages, setup.bos_token)

    return render


def _grammar_work(setup: Setup):
    from engine.structured import Compiler

    compiler = Compiler(setup.tokenizer_info)  # before "ready": a task's time is its compile's own

    def compile_(task: Task) -> str:
        return compiler.compile_json(*task.spec)

    return compile_


class _Child:
    def __init__(self, ctx, setup_json: bytes):
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(theirs, setup_json), daemon=True)
        self.proc.start()
        theirs.close()
        self.ready = False
        self._killed = threading.Lock()  # a task's thread and close() may both kill it: once

    def kill(self) -> None:
        if not self._killed.acquire(blocking=False):
            return
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class Sandbox:
    """A pool of up to `processes` children of one kind, each started when a task first finds none idle
    (a server that never renders a chat or compiles a grammar starts none: a grammar child's start costs
    about a second of CPU). run() is for the event loop: it waits in the pool's own threads (the default
    executor stays free), and a caller that is cancelled kills its child."""

    def __init__(self, setup: Setup, processes: int = 2, ctx=None):
        if setup.kind not in KINDS:
            raise ValueError(f"sandbox kind must be one of {KINDS}, got {setup.kind!r}")
        if ctx is None:
            from experiments.deploy.launcher import _fork_server

            ctx = _fork_server()
        self.setup, self._ctx, self._json = setup, ctx, msgspec.json.encode(setup)
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._executor = ThreadPoolExecutor(processes, thread_name_prefix=f"sandbox-{setup.kind}")
        self._children: set[_Child] = set()
        self._lock = threading.Lock()
        self.processes = processes
        self.per_client = max(1, processes - 1)  # tasks of one client running at once: one child stays free
        self._clients: dict[str, tuple[asyncio.Semaphore, int]] = {}  # client -> (its turns, tasks of it)
        self.killed = 0  # children killed past a deadline, on a cancel, or dead on their own
        self._closed = False

    def _take(self) -> _Child:
        """An idle child; a new one while the pool has fewer than `processes`; else wait for one (a
        task runs in one of the pool's `processes` threads, so a child is free or about to be)."""
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            start = len(self._children) < self.processes
            if start:
                child = _Child(self._ctx, self._json)
                self._children.add(child)
        return child if start else self._idle.get()

    def _replace(self, child: _Child) -> None:
        """Kill a child (its next task starts a fresh one)."""
        child.kill()
        with self._lock:
            self._children.discard(child)
            self.killed += 1

    async def run(self, task: Task, client: str = "?") -> str:
        """The task's output, or SandboxError (failed, too slow, too big, or its child died). A client
        (its address) runs at most per_client tasks at once; its others wait here (on the event loop)."""
        turns, waiting = self._clients.get(client) or (asyncio.Semaphore(self.per_client), 0)
        self._clients[client] = (turns, waiting + 1)
        try:
            async with turns:
                reply = await self._submit(task)
        finally:
            turns, waiting = self._clients[client]
            if waiting == 1:
                del self._clients[client]
            else:
                self._clients[client] = (turns, waiting - 1)
        if reply.error is not None:
            raise SandboxError(reply.error)
        return reply.ok

    async def _submit(self, task: Task) -> Reply:
        gave_up = threading.Event()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self._run, task, gave_up)
        except asyncio.CancelledError:
            gave_up.set()  # the thread kills the child at its next look
            raise

    def _run(self, task: Task, gave_up: threading.Event) -> Reply:
        if gave_up.is_set():
            return Reply(error="cancelled")
        child = self._take()
        if not child.ready:
            try:
                started = child.conn.poll(START_TIMEOUT_S) and child.conn.recv_bytes() == b"ready"
            except (EOFError, OSError):  # it died starting (its memory cap below what it imports)
                started = False
            if not started:
                self._replace(child)
                log.error(
                    "a %s sandbox process did not start (exit code %s)", self.setup.kind, child.proc.exitcode
                )
                return Reply(error=f"the {self.setup.kind} sandbox did not start")
            child.ready = True
        try:
            child.conn.send_bytes(msgspec.json.encode(task))
            deadline = time.monotonic() + task.timeout_s
            while not child.conn.poll(POLL_S):
                if gave_up.is_set() or time.monotonic() > deadline:
                    self._replace(child)
                    why = "cancelled" if gave_up.is_set() else f"ran past {task.timeout_s} s"
                    return Reply(error=f"the {self._what} {why}")
            reply = msgspec.json.decode(child.conn.recv_bytes(), type=Reply)
        except (EOFError, OSError, msgspec.DecodeError):  # it died (SIGXCPU, the kernel's OOM) mid-task
            self._replace(child)
            return Reply(error=f"the {self._what} was stopped (over its time or memory)")
        if reply.spent or not child.proc.is_alive():
            self._replace(child)
        else:
            self._idle.put(child)
        return reply

    @property
    def _what(self) -> str:
        return "chat template" if self.setup.kind == "template" else "grammar compile"

    def close(self) -> None:
        self._closed = True
        with self._lock:
            children = list(self._children)
        for child in children:
            child.kill()
        self._executor.shutdown(wait=False, cancel_futures=True)
