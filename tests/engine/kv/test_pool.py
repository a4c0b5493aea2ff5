"""The shared KV pool (engine/kv/pool.py over Mooncake Store, transfer/backends/mooncake.py): an engine
loads what another one computed, with the same greedy text as no cache; a page of another secret, salt,
size or namespace is never used; a store that dies or hangs turns into misses within the deadline."""

import logging
import os
import random
import signal
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv.cache import page_hashes
from engine.kv.pages import HEADER_BYTES
from tests import needs
from tests.tiers import all_busy, release
from transfer.backends.mooncake import StoreClient, StoreProcesses, link_libraries

needs.nixl()
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SMALL = {"model": "tiny-random", "page_size": 4, "num_pages": 48, "max_num_seqs": 2}


def _prompts(n=3, seed=0, length=120):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(length)] for _ in range(n)]


def _one_by_one(llm, prompts, params=GREEDY):
    return [llm.generate([p], params)[0] for p in prompts]


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in _one_by_one(LLM(enable_prefix_caching=False, **SMALL), _prompts())]


@pytest.fixture
def store(tmp_path):
    processes = StoreProcesses("127.0.0.1", 64 << 20, str(tmp_path / "logs"))
    yield processes
    processes.stop()
    assert not processes.procs


def _tiers(store, **more):
    """The tiers over the test's store; its calls' deadlines generous (only a broken store reaches them:
    a first existence check past the default 0.5 s under a loaded machine made a pool a miss mid-test),
    but where a test sets its own."""
    return {
        "host_bytes": 1 << 20,
        "store": "mooncake",
        "store_master": store.master,
        "store_metadata": store.metadata,
        "secret": "deployment secret",
        "store_deadline_s": 30.0,
        "store_lookup_s": 30.0,
        **more,
    }


def test_the_libraries_mooncake_needs_are_linked_once():
    assert link_libraries() == []  # make did it; a second time links nothing


def test_an_engine_loads_what_another_computed(store, reference):
    first = LLM(**SMALL, kv_tiers=_tiers(store))
    _one_by_one(first, _prompts())
    assert first.tiers.drain()
    assert first.kv_tier_stats["pool"]["pages"] == 3 * 31  # every full page it computed, outputs too
    second = LLM(**SMALL, kv_tiers=_tiers(store))  # another worker, or this one restarted: warm
    outs = _one_by_one(second, _prompts())
    assert [o.token_ids for o in outs] == reference
    assert [o.num_cached_tokens for o in outs] == [116] * 3  # all but the page of the last token
    pool = second.kv_tier_stats["pool"]
    assert pool["hit_tokens"] == 3 * 116 and pool["bytes_in"] == 3 * 29 * second.tiers.fmt.payload
    assert pool["dropped"] == 0 and pool["pages"] == 0  # the pool held every page it computed
    assert second.tiers.drain() and second.allocator.num_free == second.allocator.num_pages


def test_a_host_pool_smaller_than_a_step_says_the_pool_puts_will_lag(store, caplog):
    """Every page put into the pool is staged in a host slot until the engine's next step: a host pool
    holding fewer pages than a step names (max_num_batched_tokens / page_size) cannot keep up, and says
    so, with the size that does; a decode worker (it puts nothing) and a large enough pool do not."""
    step = {"max_num_batched_tokens": 256}  # 64 pages of 4 tokens
    with caplog.at_level(logging.WARNING, logger="engine.llm"):
        small = LLM(**SMALL, **step, kv_tiers=_tiers(store, host_bytes=16 * 8192))
        assert small.tiers.host.num_slots == 16
        assert "kv_tiers.host_bytes=131072 holds 16 pages, fewer than one step names (64)" in caplog.text
        assert "524288 bytes or more" in caplog.text
        caplog.clear()
        LLM(**SMALL, **step, kv_tiers=_tiers(store, host_bytes=64 * 8192))
        LLM(**SMALL, **step, role="decode", kv_tiers=_tiers(store, host_bytes=16 * 8192))
    assert "host_bytes" not in caplog.text


def test_a_put_that_finds_no_free_host_slot_waits_for_one(store, reference):
    """A page named while every host slot is busy is not skipped: its put waits, in order, and goes once a
    slot frees (at the next pages named), so the pool holds every page and another engine finds each
    prompt's whole run."""
    first = LLM(**SMALL, kv_tiers=_tiers(store))
    held = all_busy(first)
    _one_by_one(first, _prompts()[:1])
    assert len(first.tiers._unput) == 31 and first.kv_tier_stats["pool"]["pages"] == 0
    release(first, held)
    _one_by_one(first, _prompts()[1:])
    assert first.tiers.drain() and not first.tiers._unput
    assert first.kv_tier_stats["pool"]["pages"] == 3 * 31 and first.kv_tier_stats["pool"]["skipped"] == 0
    second = LLM(**SMALL, kv_tiers=_tiers(store))
    outs = _one_by_one(second, _prompts())
    assert [o.token_ids for o in outs] == reference
    assert [o.num_cached_tokens for o in outs] == [116] * 3


def test_puts_waiting_for_a_host_slot_go_when_an_idle_worker_tends_its_tiers(store):
    """Nothing more is named after a burst whose puts waited for slots: tend() (a worker's loop calls it
    now and then) stages them once slots are free, instead of never."""
    llm = LLM(**SMALL, kv_tiers=_tiers(store))
    held = all_busy(llm)
    _one_by_one(llm, _prompts()[:1])
    assert len(llm.tiers._unput) == 31
    llm.tiers.tend()  # every slot still busy: they keep waiting
    assert len(llm.tiers._unput) == 31
    release(llm, held)
    llm.tiers.tend()
    assert not llm.tiers._unput and llm.tiers.drain()
    assert llm.kv_tier_stats["pool"]["pages"] == 31 and llm.kv_tier_stats["pool"]["skipped"] == 0


def test_a_waiting_put_whose_page_is_evicted_first_is_skipped_and_counted(store, reference):
    """The put waits only while its device page holds the KV: evicted before a host slot frees, the page
    is counted as skipped (nothing stale ever reaches the pool)."""
    llm = LLM(**SMALL, kv_tiers=_tiers(store))
    held = all_busy(llm)
    outs = _one_by_one(llm, _prompts())  # each prompt evicts the one before it from 48 device pages
    assert [o.token_ids for o in outs] == reference
    stats = llm.kv_tier_stats
    assert stats["pool"]["skipped"] > 0 and stats["pool"]["pages"] == 0
    assert stats["host"]["skipped"] > 0  # on_evict found no slot either
    assert len(llm.tiers._unput) + stats["pool"]["skipped"] <= 3 * 31
    release(llm, held)
    assert llm.tiers.drain()


def test_pages_of_another_secret_or_salt_are_never_found(store, reference):
    """A page's key is an HMAC of its name under the secret: another secret or salt looks up other keys
    and finds nothing (an attacker without the secret cannot tell which prompts are cached)."""
    writer = LLM(**SMALL, kv_tiers=_tiers(store))
    _one_by_one(writer, _prompts())
    assert writer.tiers.drain()
    firsts = [page_hashes(p, 4, writer.scheduler.salt, [])[0] for p in _prompts()]
    client = StoreClient(store.master, store.metadata, torch.zeros(8, dtype=torch.uint8), 2.0)
    stored = sum(client.exists([writer.tiers.pool.key(name) for name in firsts]))
    client.close()
    assert stored >= 1  # a put can fail under load (Mooncake's -800)
    other = LLM(**SMALL, kv_tiers=_tiers(store, secret="someone else's"))
    assert all(other.tiers.pool.key(n) != writer.tiers.pool.key(n) != n.hex() for n in firsts)
    outs = _one_by_one(other, _prompts())
    assert [o.token_ids for o in outs] == reference
    assert all(o.num_cached_tokens == 0 for o in outs) and other.kv_tier_stats["pool"]["dropped"] == 0
    salted = LLM(**SMALL, kv_tiers=_tiers(store))
    mallory = SamplingParams(max_tokens=6, ignore_eos=True, cache_salt="mallory")
    assert all(o.num_cached_tokens == 0 for o in _one_by_one(salted, _prompts(), mallory))
    assert salted.kv_tier_stats["pool"]["dropped"] == 0  # other names: nothing to check, nothing found


def test_a_local_process_reading_the_pool_learns_nothing_and_cannot_move_a_page(store, reference, caplog):
    """Any local process can read the pool's objects whole (Mooncake authenticates no one).
    They are sealed (AES-GCM): no header, name or KV byte of the slot appears in one, and a valid object
    copied under another page's key does not open there: dropped and computed, the text unchanged."""
    writer = LLM(**SMALL, kv_tiers=_tiers(store))
    _one_by_one(writer, _prompts()[:2])
    assert writer.tiers.drain()
    firsts = [page_hashes(p, 4, writer.scheduler.salt, [])[0] for p in _prompts()[:2]]
    pool = writer.tiers.pool
    memory = torch.zeros(pool.sealed_bytes, dtype=torch.uint8)
    intruder = StoreClient(store.master, store.metadata, memory, 2.0)
    try:
        assert intruder.get(pool.key(firsts[0]), 0, pool.sealed_bytes) == "ok"
        sealed = memory.numpy().tobytes()
        plain = writer.tiers.host.view(writer.tiers.host.get(firsts[0])).numpy().tobytes()
        assert plain[:4] == b"PDKV" and b"PDKV" not in sealed and firsts[0] not in sealed
        payload = plain[HEADER_BYTES : HEADER_BYTES + writer.tiers.fmt.payload]
        assert all(payload[i : i + 16] not in sealed for i in range(0, len(payload), 256))
        assert intruder.remove(pool.key(firsts[1])) == "ok"
        assert intruder.put(pool.key(firsts[1]), 0, pool.sealed_bytes) == "ok"  # the first page's, moved
    finally:
        intruder.close()
    reader = LLM(**SMALL, kv_tiers=_tiers(store))
    with caplog.at_level(logging.WARNING, logger="engine.kv.tiers"):
        outs = _one_by_one(reader, _prompts()[1:2])
    assert [o.token_ids for o in outs] == reference[1:2] and outs[0].num_cached_tokens == 0
    assert reader.kv_tier_stats["pool"]["dropped"] == 1 and "seal did not open" in caplog.text


def _plant_junk(store) -> None:
    """Under the first prompt's first page's key an object too short, under the second's garbage of the
    right size (the names as an engine names them)."""
    writer = LLM(**SMALL, kv_tiers=_tiers(store))
    firsts = [page_hashes(p, 4, writer.scheduler.salt, [])[0] for p in _prompts()]
    pool = writer.tiers.pool
    junk = torch.randint(0, 255, (pool.sealed_bytes,), dtype=torch.uint8)
    client = StoreClient(store.master, store.metadata, junk, 2.0)
    assert client.put(pool.key(firsts[0]), 0, 100) == "ok"  # too short
    assert client.put(pool.key(firsts[1]), 0, junk.numel()) == "ok"  # garbage
    client.close()


def test_an_object_of_the_wrong_size_or_bytes_is_a_miss(store, reference):
    _plant_junk(store)
    reader = LLM(**SMALL, kv_tiers=_tiers(store))
    outs = _one_by_one(reader, _prompts()[:2])
    assert [o.token_ids for o in outs] == reference[:2]
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert reader.kv_tier_stats["pool"]["dropped"] == 2


def test_a_rejected_object_is_replaced_by_the_next_good_put(store, reference):
    """Garbage (or a short object) under a page's key was rejected, and since workers skip
    keys the pool holds, that prefix stayed uncached for good. The worker that rejected it puts its own
    page in its place: the next engine loads it."""
    _plant_junk(store)
    reader = LLM(**SMALL, kv_tiers=_tiers(store))
    assert [o.token_ids for o in _one_by_one(reader, _prompts()[:2])] == reference[:2]
    assert reader.kv_tier_stats["pool"]["dropped"] == 2
    give_up = time.monotonic() + 60  # the objects it read are leased (Mooncake: 10 s), then replaced
    while reader.tiers.pool.rejected and time.monotonic() < give_up:
        reader.tiers.tend()  # as a worker's loop does every 0.5 s, idle or not
        assert reader.tiers.drain()
        time.sleep(0.1)
    assert not reader.tiers.pool.rejected  # both replaced
    later = LLM(**SMALL, kv_tiers=_tiers(store))
    outs = _one_by_one(later, _prompts()[:2])
    assert [o.token_ids for o in outs] == reference[:2]
    assert all(o.num_cached_tokens > 0 for o in outs) and later.kv_tier_stats["pool"]["dropped"] == 0


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_store_that_dies_or_hangs_mid_run_is_a_miss_within_the_deadline(store, reference, fault, caplog):
    first = LLM(**SMALL, kv_tiers=_tiers(store, store_deadline_s=0.5))
    _one_by_one(first, _prompts())
    assert first.tiers.drain()
    second = LLM(**SMALL, kv_tiers=_tiers(store, store_deadline_s=0.5))  # up while the store is
    master = store.procs[0]
    if fault == "killed":
        master.kill()
        master.wait()
    else:
        os.kill(master.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="transfer.backends.mooncake"):
            outs = _one_by_one(second, _prompts())
        assert [o.token_ids for o in outs] == reference
        if fault == "killed":
            assert all(o.num_cached_tokens == 0 for o in outs)  # recomputed: the pool was a miss
        else:  # a stopped master: once in a full suite's run a lookup and some gets still came back (what
            # Mooncake's client knew of it; their pages sealed and checked), until one missed its deadline:
            # from then on the pool is down, and the later prompts are computed whole
            assert outs[-1].num_cached_tokens == 0
        assert second.tiers.pool.client.outages >= 1 and "the pool is a miss" in caplog.text
        assert second.tiers.drain() and second.allocator.num_free == second.allocator.num_pages
    finally:
        if fault == "hung":
            os.kill(master.pid, signal.SIGCONT)


def test_an_outage_doubles_while_calls_keep_failing_and_is_short_again_after_one_that_works():
    """A failed or late call makes the pool a miss for 0.5 s, then 1, 2, 4, 5, 5 s while the calls
    that follow fail too (a store that stays down is asked once every 5 s); one call done well makes the
    next outage short again (one transient failure cost a short run the pool's first 5 s before)."""
    import threading

    from transfer.backends import mooncake

    client = object.__new__(StoreClient)  # the outage bookkeeping alone: no store behind it
    client.down_until, client.down_for, client.outages = 0.0, mooncake.FIRST_DOWN_S, 0
    client._lock = threading.Lock()
    lengths = []
    for _ in range(6):
        client.down_until = 0.0  # the last outage is over: the next call is made, and fails
        before = time.monotonic()
        client._failed("put_from", -800)
        lengths.append(round(client.down_until - before, 1))
        assert not client.up
    assert lengths == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0] and client.outages == 6
    client._done()
    client.down_until = 0.0
    before = time.monotonic()
    client._failed("put_from", -800)
    assert round(client.down_until - before, 1) == 0.5
