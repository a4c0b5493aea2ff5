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
- clients share the pool fairly (Sandbox's docstring): one client's tasks hold at most all children but
  one at a time (six hostile grammars from one client held both grammar children, and another client's
  trivial schema waited 14.7-19.5 s), the others wait for their turn, cancelled with it, a client with
  nothing running gets a child of its own while the pool may grow, and a slow task yields its CPU.
  Children run at a lower CPU priority (nice 10) than the server and its workers.
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
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from serving.fleet.procs import die_with

log = logging.getLogger(__name__)
KINDS = ("template", "grammar")
START_TIMEOUT_S = 60.0  # a child's start (imports) may take this long: not counted in a task's time
POLL_S = 0.05  # how often a waiting task looks whether its caller gave up
MAX_COMPILED_CHARS = 16 << 20  # a compiled grammar's serialized length (it travels in a Submit)
CHILD_NICE = 10  # the children's CPU priority below the server's
SLOW_S, SLOW_NICE = 0.25, 19  # a task running longer yields its CPU to the others' (fair share)


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


def _child_main(conn, setup_json: bytes, owner: int) -> None:
    """A child: it ends with the server (owner: its pid; the fork server is its parent), takes its limits,
    then one task at a time from the pipe until it closes."""
    die_with(owner, "a sandbox child")
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
        self.proc = ctx.Process(target=_child_main, args=(theirs, setup_json, os.getpid()), daemon=True)
        self.proc.start()
        theirs.close()
        self.ready = False
        self._killed = threading.Lock()  # a task's thread and close() may both kill it: once

    def yield_cpu(self) -> bool:
        """Its task is slow: the others' tasks go first (nice 19); whether that took."""
        try:
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, SLOW_NICE)
            return True
        except OSError:  # gone already
            return False

    def resume_cpu(self) -> None:
        """Back to CHILD_NICE for its next task (raising a priority again needs root: then it stays)."""
        try:
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, CHILD_NICE)
        except OSError:
            pass

    def kill(self) -> None:
        if not self._killed.acquire(blocking=False):
            return
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class Sandbox:
    """A pool of children of one kind: up to `processes` kept, each started when a task first finds none
    idle (a server that never renders a chat or compiles a grammar starts none: a grammar child's start
    costs about a second of CPU), and up to `max_processes` while tasks of clients that run nothing wait.
    run() is for the event loop: it waits in the pool's own threads (the default executor stays free), and
    a caller that is cancelled kills its child.

    Fair share (as the workers' admission, engine/fair.py): a client runs at most processes - 1 tasks at
    once; a waiting task goes to a free child in the order of its client's tasks running (fewest first,
    then the earliest); a client running nothing gets a child of its own, started for it, while the pool
    has fewer than max_processes; and a task that has run past SLOW_S yields its CPU to the others (nice
    19). Six clients each holding a hostile grammar for its whole timeout kept another client's trivial
    one waiting 15 s behind them in a first-come queue."""

    def __init__(
        self,
        setup: Setup,
        processes: int = 2,
        ctx=None,
        max_processes: int | None = None,
        vocabulary: Callable[[], str] | None = None,
    ):
        """vocabulary: makes the grammar kind's tokenizer_info when the first child starts, not here
        (xgrammar's view of a 49k-token vocabulary cost the server 1-2 s of CPU at every start, for a
        grammar no client may ever ask for)."""
        if setup.kind not in KINDS:
            raise ValueError(f"sandbox kind must be one of {KINDS}, got {setup.kind!r}")
        if ctx is None:
            from serving.fleet.launcher import _fork_server

            ctx = _fork_server()
        self.setup, self._ctx, self._vocabulary = setup, ctx, vocabulary
        self._json = None if vocabulary else msgspec.json.encode(setup)
        self.processes = processes
        self.max_processes = max(processes, max_processes or 4 * processes)
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._executor = ThreadPoolExecutor(self.max_processes, thread_name_prefix=f"sandbox-{setup.kind}")
        self._children: set[_Child] = set()
        self._lock = threading.Lock()
        self.per_client = max(1, processes - 1)  # tasks of one client running at once: one child stays free
        self._running: Counter[str] = Counter()  # tasks running, by client
        self._waiting: list[tuple[str, asyncio.Future]] = []  # in arrival order
        self.killed = 0  # children killed past a deadline, on a cancel, or dead on their own
        self._closed = False

    def _may_run(self, client: str) -> bool:
        if self._running[client] >= self.per_client:
            return False
        busy = self._running.total()
        return busy < self.processes or (busy < self.max_processes and not self._running[client])

    def _next(self) -> None:
        """Start the waiting tasks that may run now, their clients' fewest running first."""
        while self._waiting:
            ready = [(self._running[c], i) for i, (c, f) in enumerate(self._waiting) if self._may_run(c)]
            if not ready:
                return
            client, turn = self._waiting.pop(min(ready)[1])
            if not turn.done():  # its caller may have given up meanwhile
                self._running[client] += 1
                turn.set_result(None)

    def _take(self) -> _Child:
        """An idle child, else a new one while the pool has fewer than max_processes, else wait for one
        (run() lets at most max_processes tasks in, so one is free or about to be). Once the pool is past
        `processes` and none is left idle, a spare starts beside it: the next client to arrive finds a
        started child instead of waiting out a start (about a second of CPU for grammars)."""
        try:
            child = self._idle.get_nowait()
        except queue.Empty:
            with self._lock:
                start = len(self._children) < self.max_processes
                if start:
                    child = _Child(self._ctx, self._setup_json())
                    self._children.add(child)
            if not start:
                return self._idle.get()
        with self._lock:
            spare = self._idle.empty() and self.processes <= len(self._children) < self.max_processes
            if spare:
                self._children.add(new := _Child(self._ctx, self._setup_json()))
        if spare:
            self._idle.put(new)
        return child

    def _setup_json(self) -> bytes:
        """What a child starts with (under self._lock); the vocabulary made for the first one."""
        if self._json is None:
            self.setup = msgspec.structs.replace(self.setup, tokenizer_info=self._vocabulary())
            self._json = msgspec.json.encode(self.setup)
        return self._json

    def _replace(self, child: _Child, killed: bool = True) -> None:
        """Kill a child (its next task starts a fresh one); killed: counted as killed (not retired)."""
        child.kill()
        with self._lock:
            self._children.discard(child)
            self.killed += killed

    async def run(self, task: Task, client: str = "?") -> str:
        """The task's output, or SandboxError (failed, too slow, too big, or its child died). client (who
        asks: the server's client_of) waits here, on the event loop, for its turn (the class's fair share)."""
        if self._may_run(client) and not self._waiting:
            self._running[client] += 1
        else:
            turn = asyncio.get_running_loop().create_future()
            self._waiting.append((client, turn))
            self._next()  # a client running nothing may start now, ahead of those waiting for a child
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():  # given its turn as it was cancelled
                    self._done(client)
                else:
                    self._waiting = [(c, f) for c, f in self._waiting if f is not turn]
                raise
        try:
            reply = await self._submit(task)
        finally:
            self._done(client)
        if reply.error is not None:
            raise SandboxError(reply.error)
        return reply.ok

    def _done(self, client: str) -> None:
        self._running[client] -= 1
        if self._running[client] <= 0:
            del self._running[client]
        self._next()

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
            started = time.monotonic()
            deadline, slow = started + task.timeout_s, False
            while not child.conn.poll(POLL_S):
                if not slow and time.monotonic() > started + SLOW_S:
                    slow = child.yield_cpu()
                if gave_up.is_set() or time.monotonic() > deadline:
                    self._replace(child)
                    why = "cancelled" if gave_up.is_set() else f"ran past {task.timeout_s} s"
                    return Reply(error=f"the {self._what} {why}")
            reply = msgspec.json.decode(child.conn.recv_bytes(), type=Reply)
        except (EOFError, OSError, msgspec.DecodeError):  # it died (SIGXCPU, the kernel's OOM) mid-task
            self._replace(child)
            return Reply(error=f"the {self._what} was stopped (over its time or memory)")
        with self._lock:  # past `processes`, one idle child is kept (the spare), no more
            keep = len(self._children) <= self.processes or self._idle.empty()
        if reply.spent or not child.proc.is_alive() or not keep:
            self._replace(child, killed=reply.spent or not child.proc.is_alive())
        else:
            if slow:
                child.resume_cpu()
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
