"""KV below device memory: the host pool, then files, under the prefix cache (engine/kv/cache.py).

Saving: a named device page is copied into a host slot when the allocator evicts it (policy "on_evict")
or as soon as it is named ("write_through"); every page that reaches the host pool is written behind it
into the disk tier, so that dropping a host slot never waits for the disk. Loading: the scheduler asks
`find` which of a new request's next page names sit below device memory, takes device pages for them
and starts a `Load`; the request waits out of the batch while one I/O thread reads files into host
slots, checks them and copies them into its pages, and the other requests keep stepping. A load that
fails a check or passes its deadline stops there: the pages it did load count, the rest are computed.

The shared pool (engine/kv/pool.py) sits below both: a prefill or colocated engine puts each page it
names there (staged through a host slot; while none is free the put waits, in order, for one), and
`find` looks there for what host and disk lack.

Threads: the engine's thread owns every index (host, disk) and the busy counts; the I/O thread only
moves bytes and hands its results back through `poll`, which the scheduler calls every step. Loads go
before writes in the I/O thread's queue.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass

from torch import Tensor

from engine.config import KVTiersConfig
from engine.kv.disk import DiskTier
from engine.kv.pages import HEADER_BYTES, HostPool, PageFormat
from engine.kv.pool import PoolTier

log = logging.getLogger(__name__)
TIERS = ("host", "disk", "pool")
_LOAD, _WRITE = 0, 1  # I/O queue priorities
COPY_BATCH = 64  # pages per batched copy into device pages (an abort waits for at most one)
UNPUT_PER_SLOT = 4  # pool puts that may wait for a host slot, per slot (past that the oldest is dropped)
REMOVE_RETRY_S = 1.0  # a rejected pool object under a read's lease (Mooncake's: 10 s): removed again after
UNSEALED = "its seal did not open (AES-GCM under the deployment's secret): forged, moved or garbage"
# a page's load time until a tier has loaded one (seconds; make bench-tiers measured 2.0 / 3.1 / 6.2 ms on
# 2 cores of an AMD EPYC, the I/O thread's queue included)
PRIOR_PAGE_S = {"host": 0.002, "disk": 0.003, "pool": 0.006}


@dataclass
class TierStats:
    hit_tokens: int = 0  # prompt tokens loaded from this tier instead of computed
    bytes_in: int = 0  # bytes loaded from it into device pages
    bytes_out: int = 0  # bytes saved into it
    loads: int = 0  # load jobs that took pages from it
    load_s: float = 0.0  # their time on the I/O thread, its queue included (shared by its tiers' pages)
    load_max_s: float = 0.0
    evictions: int = 0  # names it dropped for room (the pool's own evictions are not seen)
    dropped: int = 0  # pages that failed a check (size, namespace, MAC) or a read, recomputed instead
    # pages not saved into it: every host slot was busy (the step never waits for one), or the put failed;
    # a page missing from the pool also hides the pages after it from every lookup (a leading run)
    skipped: int = 0


class Load:
    """One request's pages coming up from below device memory. `ok` leading pages are loaded; after
    `cancel` no more are written into device pages (so they may be freed or computed at once)."""

    def __init__(self, plan: list[tuple[str, bytes, int, int | None]], pages: list[int], deadline: float):
        self.plan, self.pages, self.deadline = plan, pages, deadline  # plan: (tier, name, host, disk slot)
        self.lock = threading.Lock()
        self.ok, self.cancelled, self.finished = 0, False, False
        self.started, self.began = time.monotonic(), time.perf_counter()
        self.ended = self.started  # when the I/O thread finished it

    @property
    def due(self) -> bool:
        return self.finished or time.monotonic() > self.deadline

    def cancel(self) -> int:
        with self.lock:
            self.cancelled = True
            return self.ok


class KVTiers:
    def __init__(self, config: KVTiersConfig, caches: list[Tensor], space: bytes, page_size: int):
        """caches: every tensor [layers, pages, ...] a page has a part in (each TP rank's device cache in
        rank order, an e4m3 cache's scales after them: LLM.page_tensors); space: pages.namespace(...)."""
        self.config, self.page_size = config, page_size
        self.fmt = PageFormat(caches, space, config.secret.encode())
        slot = self.fmt.slot_bytes
        if config.host_bytes < slot:
            raise ValueError(
                f"kv_tiers.host_bytes={config.host_bytes} holds no page: one takes {slot} bytes here"
            )
        self.host = HostPool(config.host_bytes // slot, slot, pin=caches[0].is_cuda)
        self.disk: DiskTier | None = None
        if config.disk_bytes:
            if config.disk_bytes < slot:
                raise ValueError(
                    f"kv_tiers.disk_bytes={config.disk_bytes} holds no page: one takes {slot} bytes here"
                )
            try:
                self.disk = DiskTier(
                    config.disk_dir, config.disk_bytes // slot, slot, space, self.host.memory
                )
            except OSError as e:  # a full or missing disk: the engine serves without this tier
                log.warning("kv_tiers: no disk tier in %s: %s", config.disk_dir, e)
        self.pool: PoolTier | None = None
        self.share = True  # put the pages it computes into the pool (not a decode worker's: set_role)
        # named pages whose pool put waits for a free host slot (name -> device page), oldest first
        self._unput: OrderedDict[bytes, int] = OrderedDict()
        if config.store == "mooncake":
            try:
                self.pool = PoolTier(
                    config.store_master,
                    config.store_metadata,
                    space,
                    self.fmt.secret,
                    HEADER_BYTES + self.fmt.payload,
                    config.store_deadline_s,
                    config.store_lookup_s,
                )
            except Exception as e:  # a store that is not there: the engine serves without the pool
                log.warning("kv_tiers: no shared pool at %s: %s", config.store_master, e)
        self.stats = {tier: TierStats() for tier in TIERS}
        self._results: queue.SimpleQueue = queue.SimpleQueue()  # callbacks for the engine's thread
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._landed = threading.Event()  # a load finished (wait() sleeps on it)
        self._loads: list[tuple[float, float, str, int]] = []  # (start, end, main tier, pages): take_loads
        # (tier, stored?, name) as names come and go below device memory, for a router (record_events)
        self.events: list[tuple[str, bool, bytes]] | None = None
        self.host.notify = lambda stored, name: self._event("host", stored, name)
        if self.disk is not None:
            self.disk.notify = lambda stored, name: self._event("disk", stored, name)
        # the thread holds the queue, not this object: one dropped without close() (with the KV caches
        # it references) is still collected, and its finalizer ends the thread
        self._io = threading.Thread(target=_serve, args=(self._jobs,), name="kv-tiers-io", daemon=True)
        self._io.start()
        self._stop_io = weakref.finalize(self, self._jobs.put, (-1, 0, None))  # close(), or when collected

    # ---- the engine's thread -------------------------------------------------------------------------

    def find(self, names: list[bytes]) -> list[str]:
        """The tiers of the leading names found below device memory (stops at the first miss)."""
        found = []
        for name in names:
            if name in self.host:
                found.append("host")
            elif self.disk is not None and name in self.disk:
                found.append("disk")
            else:
                break
        if self.pool is not None and len(found) < len(names):
            found += ["pool"] * self.pool.find(names[len(found) :])
        return found

    def page_s(self, tier: str) -> float:
        """A page's expected load time from tier: its loads' seconds over their pages, else the prior."""
        s = self.stats[tier]
        pages = s.hit_tokens // self.page_size
        return s.load_s / pages if pages else PRIOR_PAGE_S[tier]

    def plan(self, names: list[bytes], tiers: list[str]) -> Load:
        """A load of names (found in tiers by find), their host slots taken and busy from now: the device
        pages the caller takes next for them may evict other pages into the host pool, and those must not
        push these out (a load that did evicted the very pages it came for). start() runs it."""
        plan = []
        for name, tier in zip(names, tiers, strict=True):
            if tier == "host":
                slot, disk_slot = self.host.get(name), None
                if slot is None:
                    break
            else:  # staged through a host slot; one load takes at most half of them
                disk_slot = self.disk.get(name) if tier == "disk" else None
                full = len(plan) >= self.host.num_slots // 2
                taken = None if full or (tier == "disk" and disk_slot is None) else self._take_host()
                if taken is None:
                    break
                slot, _ = taken
                if disk_slot is not None:
                    self.disk.busy[disk_slot] += 1
            self.host.busy[slot] += 1
            plan.append((tier, name, slot, disk_slot))
        return Load(plan, [], time.monotonic() + self.config.store_deadline_s)

    def start(self, job: Load, pages: list[int]) -> None:
        """Load the planned pages into these device pages (owned by the caller), on the I/O thread."""
        job.pages = pages[: len(job.plan)]
        self._submit(_LOAD, lambda: self._run_load(job))

    def evicted(self, page: int, name: bytes) -> None:
        """The allocator is about to reuse a named page whose KV still holds (policy on_evict); a pool put
        still waiting for a host slot is made now or never."""
        if self.config.policy == "on_evict" and self.save(page, name) is None:
            self.stats["host"].skipped += 1
        if self.pool is not None:  # its page leaves: a bad object it was to replace stays (a put of it
            self.pool.rejected.pop(name, None)  # now finds the key held), a missing one is put below
        if self._unput.pop(name, None) is not None and not (self._sharing() and self._stage_put(page, name)):
            self.stats["pool"].skipped += 1

    def named(self, page: int, name: bytes) -> None:
        """A page was just computed and named: write-through saves it, and the pool gets a copy. When no
        host slot is free to stage the copy (each holds a write still running), the put waits, in order,
        until one is (checked at the next pages named), or until its page is evicted: a page missing from
        the pool would hide every later page of its sequence from other workers' lookups."""
        if self.config.policy == "write_through" and self.save(page, name) is None:
            self.stats["host"].skipped += 1
        if not self._sharing():
            return
        if not self._flush_unput() or not self._stage_put(page, name):
            self._unput[name] = page
            if len(self._unput) > UNPUT_PER_SLOT * self.host.num_slots:
                self._unput.popitem(last=False)
                self.stats["pool"].skipped += 1

    def _sharing(self) -> bool:
        return self.pool is not None and self.share and self.pool.client.up

    def _stage_put(self, page: int, name: bytes) -> bool:
        """Stage name's device page in a host slot and put it into the pool; False when no slot is free."""
        if self.pool.holds(name):
            return True
        slot = self.save(page, name)
        if slot is None:
            return False
        self._put_pool(name, slot, page)
        return True

    def _flush_unput(self) -> bool:
        """Stage the waiting puts, oldest first, while host slots are free; whether every one that is due
        went (a put replacing a rejected object waits out the lease of the read that rejected it)."""
        now = time.monotonic()
        for name, page in list(self._unput.items()):
            if self.pool.rejected.get(name, 0.0) > now:
                continue
            if not self._stage_put(page, name):
                return False
            del self._unput[name]
        return True

    def save(self, page: int, name: bytes) -> int | None:
        """Device page (holding name's KV) into the host pool, and behind it into the disk tier; its host
        slot (None: every slot was busy, and a cache may skip a page)."""
        slot = self.host.get(name)
        if slot is not None:
            return slot
        taken = self._take_host()
        if taken is None:
            return None
        slot, _ = taken
        self.fmt.save(page, self.host.view(slot))
        self.host.put(name, slot)
        self.stats["host"].bytes_out += self.fmt.payload
        if self.disk is not None and name not in self.disk:
            self._write_disk(name, slot)
        return slot

    def _take_host(self) -> tuple[int, bytes | None] | None:
        """A host slot to fill, or None when every one is busy (a write behind it or a load through it
        still runs; what the I/O thread finished is applied first). Never waits: the engine's thread
        stepping on time matters more than one page kept (a prefill worker that stalled here went silent
        to its decode workers)."""
        taken = self.host.take()
        if taken is None:
            self.poll()
            taken = self.host.take()
        return taken

    def poll(self) -> None:
        """Apply what the I/O thread finished (indexes, busy counts, stats)."""
        while True:
            try:
                done = self._results.get_nowait()
            except queue.Empty:
                return
            done()

    def tend(self) -> None:
        """Between steps, now and then (a worker's loop, busy or idle): apply what the I/O thread finished
        and stage the pool puts that wait for a host slot, which otherwise go only when more pages are
        named or evicted: a worker that went idle kept them from the pool."""
        self.poll()
        if self._sharing():
            self._flush_unput()

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every I/O job queued so far has run, then apply the results; False on timeout."""
        done = threading.Event()
        self._submit(_WRITE, done.set)
        finished = done.wait(timeout)
        self.poll()
        return finished

    def wait(self, timeout: float) -> None:
        """Sleep until a load finishes or timeout passes (an engine with nothing else to step)."""
        self._landed.wait(timeout)
        self._landed.clear()

    MAX_EVENTS = 50_000  # kept between take_events() calls; the oldest go first

    def record_events(self) -> None:
        """From now on keep (tier, stored?, name) for each name a tier gains or drops (the pool's: the
        pages this worker put, or found there when it went to put them)."""
        self.events = [("host", True, name) for name in self.host]
        self.events += [("disk", True, name) for name in self.disk or ()]

    def take_events(self) -> list[tuple[str, bool, bytes]]:
        out, self.events = self.events or [], [] if self.events is not None else None
        return out

    def _event(self, tier: str, stored: bool, name: bytes) -> None:
        if self.events is not None:
            self.events.append((tier, stored, name))
            if len(self.events) > self.MAX_EVENTS:
                del self.events[: len(self.events) - self.MAX_EVENTS]

    def take_loads(self) -> list[tuple[float, float, str, int]]:
        """Loads that ended since the last call: perf_counter start and end, the tier most of its pages
        came from, pages loaded (the timeline draws them beside the steps)."""
        out, self._loads = self._loads, []
        return out

    def summary(self) -> dict[str, dict]:
        out = {}
        held = {"host": len(self.host), "disk": len(self.disk or ()), "pool": self.pool and self.pool.puts}
        self.stats["host"].evictions = self.host.num_evicted
        if self.disk is not None:
            self.stats["disk"].evictions = self.disk.num_evicted
        for tier, s in self.stats.items():
            if (tier == "disk" and self.disk is None) or (tier == "pool" and self.pool is None):
                continue
            out[tier] = {**asdict(s), "pages": held[tier]}  # the pool's: pages this worker put
        return out

    def clear(self) -> int:
        """Forget every idle page of the host and disk tiers; returns how many names were dropped."""
        return self.host.clear() + (self.disk.clear() if self.disk is not None else 0)

    def close(self) -> None:
        """Finish the writes in flight (so that the files hold them), then stop the I/O thread."""
        self.drain(timeout=2 * self.config.store_deadline_s)
        self._stop_io()  # once: the finalizer does nothing more
        self._io.join(timeout=5)
        if self.disk is not None:
            self.disk.close()
        if self.pool is not None:
            self.pool.close()

    def _write_disk(self, name: bytes, slot: int) -> None:
        taken = self.disk.take()
        if taken is None:
            return
        disk_slot, _ = taken
        self.host.busy[slot] += 1
        self.disk.busy[disk_slot] += 1
        size = self.fmt.slot_bytes

        def write():
            self.fmt.stamp(self.host.view(slot), name, self.disk.key)
            deadline = time.monotonic() + self.config.store_deadline_s
            state = self.disk.move("WRITE", [(slot * size, disk_slot)], size, deadline)
            self._results.put(lambda: self._disk_written(name, slot, disk_slot, state))

        self._submit(_WRITE, write)

    def _put_pool(self, name: bytes, slot: int, page: int) -> None:
        self.host.busy[slot] += 1
        self.pool.stored(name)  # so that no other step puts it again meanwhile

        def put():
            state = self.pool.offer(name, self.host.view(slot), self.fmt.stamp)
            self._results.put(lambda: self._pool_put(name, slot, state, page))

        self._submit(_WRITE, put)

    def _pool_put(self, name: bytes, slot: int, state: str, page: int) -> None:
        self.host.busy[slot] -= 1  # a put past its deadline holds a sealed copy, not the slot
        if state == "leased":  # tried again once the lease may have passed, while its page holds
            self.pool.forget(name)
            if name in self.pool.rejected:
                self.pool.rejected[name] = time.monotonic() + REMOVE_RETRY_S
                self._unput[name] = page
            return
        if state == "ok":
            self.stats["pool"].bytes_out += self.fmt.payload
            self.pool.puts += 1
        elif state != "held":
            self.stats["pool"].skipped += 1
            self.pool.forget(name)
            return
        self._event("pool", True, name)

    def _disk_written(self, name: bytes, slot: int, disk_slot: int, state: str) -> None:
        self.disk.busy[disk_slot] -= 1
        if state != "STUCK":
            self.host.busy[slot] -= 1
        self.disk.written(name, disk_slot, state == "DONE")
        if state == "DONE":
            self.stats["disk"].bytes_out += self.fmt.payload

    def _loaded(self, job: Load, read: str) -> None:
        took = job.ended - job.started  # on the I/O thread, queueing behind a write included
        for i, (tier, name, slot, disk_slot) in enumerate(job.plan):
            if tier == "disk":
                self.disk.busy[disk_slot] -= 1
                if read == "STUCK":
                    continue  # the read may still land in its host slot: that slot stays busy
            self.host.busy[slot] -= 1
            if tier != "host":
                if i < job.ok:
                    self.host.put(name, slot)  # it is a host page now too
                else:
                    self.host.give_back(slot)
        tiers = [t for t, *_ in job.plan[: job.ok]]
        if tiers and len(self._loads) < 10_000:
            main = max(set(tiers), key=tiers.count)
            self._loads.append((job.began, job.began + took, main, len(tiers)))
        for tier in TIERS:
            loaded = tiers.count(tier)
            if loaded:  # a load's time is shared among its tiers by their pages
                s = self.stats[tier]
                s.hit_tokens += loaded * self.page_size
                s.bytes_in += loaded * self.fmt.payload
                s.loads += 1
                s.load_s += took * loaded / len(tiers)
                s.load_max_s = max(s.load_max_s, took)

    # ---- the I/O thread --------------------------------------------------------------------------

    def _submit(self, priority: int, fn) -> None:
        self._jobs.put((priority, next(self._order), fn))

    def _run_load(self, job: Load) -> None:
        size, read = self.fmt.slot_bytes, "DONE"
        disk = [(slot * size, d) for tier, _, slot, d in job.plan if tier == "disk"]
        try:
            if disk:
                read = self.disk.move("READ", disk, size, job.deadline)
            ready: list[int] = []  # checked slots, copied into their pages a batch at a time
            for tier, name, slot, _ in job.plan:
                view = self.host.view(slot)
                if tier == "disk":
                    why = f"the read {read}" if read != "DONE" else self.fmt.check(view, name, self.disk.key)
                    if why is not None:
                        self._results.put(lambda name=name, why=why: self._bad("disk", name, why))
                        break
                elif tier == "pool":
                    if job.cancelled or time.monotonic() > job.deadline:
                        break
                    got = self.pool.get(name, view)
                    why = UNSEALED if got == "unsealed" else f"the get {got}" if got != "ok" else None
                    why = why or self.fmt.check(view, name)
                    if why is not None:
                        self._results.put(lambda name=name, why=why: self._bad("pool", name, why))
                        break
                ready.append(slot)
                if len(ready) == COPY_BATCH and not self._copy(job, ready):
                    break
            self._copy(job, ready)
        finally:
            job.ended, job.finished = time.monotonic(), True
            self._results.put(lambda: self._loaded(job, read))
            self._landed.set()

    def _copy(self, job: Load, slots: list[int]) -> bool:
        """Copy checked slots into the job's next pages (one batched copy: a page at a time, the I/O
        thread would wait for the GIL once per page behind the engine's steps); False once cancelled."""
        with job.lock:
            if job.cancelled:
                return False
            if slots:
                self.fmt.load_many(self.host.memory, slots, job.pages[job.ok : job.ok + len(slots)])
                job.ok += len(slots)
        slots.clear()
        return True

    def _bad(self, tier: str, name: bytes, why: str) -> None:
        """A page that failed its check is dropped from its tier and computed instead."""
        self.stats[tier].dropped += 1
        if tier == "disk" and self.disk is not None:
            self.disk.drop(name)
        if tier == "pool":
            if "get failed" in why:  # the store is down: nothing is known of the object
                self.pool.forget(name)
                return
            self.pool.reject(name)  # bad, short, or evicted meanwhile: the next put replaces it
            if "get miss" in why:
                return
        log.warning("kv_tiers: a %s page was dropped and will be recomputed: %s", tier, why)


def _serve(jobs: queue.PriorityQueue) -> None:
    """The I/O thread: each job in priority order until a None one."""
    while True:
        _, _, fn = jobs.get()
        if fn is None:
            return
        try:
            fn()
        except Exception:  # a bug here must not stop the thread: the job's pages become misses
            log.exception("kv_tiers: an I/O job failed")
        fn = None  # the job's closure holds its KVTiers: not while this thread waits for the next
