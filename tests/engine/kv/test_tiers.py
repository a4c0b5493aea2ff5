"""KV below device memory (engine/kv/tiers.py, pages.py, disk.py): pages evicted from a small device
cache come back from the host pool or from files (NIXL POSIX) instead of being computed; greedy text is the
same as with no cache at all; a page that fails a check, a disk that fails, a load that is aborted or
passes its deadline all fall back to computing, and every page is accounted for."""

import gc
import logging
import os
import random
import weakref

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import KVTiersConfig
from engine.kv.pages import HEADER_BYTES, PageFormat, namespace
from engine.sequence import Status
from tests import needs
from tests.tiers import all_busy, release, stalled

needs.nixl()  # the disk tier moves its files through NIXL POSIX
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SMALL = {"page_size": 4, "num_pages": 48, "max_num_seqs": 2}  # one 120-token prompt evicts the last


def _prompts(n=4, seed=0, length=120):
    rng = random.Random(seed)
    firsts = [[rng.randrange(3, 49000) for _ in range(length)] for _ in range(n)]
    return firsts + [p + [11, 12, 13] for p in firsts]  # each comes back after the others evicted it


def _one_by_one(llm, prompts, params=GREEDY):
    return [llm.generate([p], params)[0] for p in prompts]


@pytest.fixture(scope="module")
def reference():
    """The prompts' greedy outputs with no prefix cache at all."""
    return [
        o.token_ids for o in _one_by_one(LLM("tiny-random", enable_prefix_caching=False, **SMALL), _prompts())
    ]


def _all_free(llm):
    assert llm.tiers.drain()
    assert llm.allocator.num_free == llm.allocator.num_pages
    assert not any(llm.tiers.host.busy.values())


def test_without_tiers_a_small_cache_recomputes_every_prompt(reference):
    outs = _one_by_one(LLM("tiny-random", **SMALL), _prompts())
    assert [o.token_ids for o in outs] == reference
    assert all(o.num_cached_tokens == 0 for o in outs)


def test_the_host_pool_brings_evicted_pages_back(reference):
    llm = LLM("tiny-random", **SMALL, kv_tiers={"host_bytes": 4 << 20})
    outs = _one_by_one(llm, _prompts())
    assert [o.token_ids for o in outs] == reference
    assert [o.num_cached_tokens for o in outs[4:]] == [120] * 4  # all of the first prompt's full pages
    host = llm.kv_tier_stats["host"]
    assert host["hit_tokens"] == 480 and host["bytes_in"] == 120 * llm.tiers.fmt.payload  # 120 pages
    assert llm.prefix_cache_stats["hits"] == 480
    _all_free(llm)


def test_loads_run_beside_other_requests_stepping(reference):
    """All eight at once, two in a step: a request loading its pages waits out of the batch."""
    llm = LLM("tiny-random", **SMALL, kv_tiers={"host_bytes": 4 << 20})
    prompts = _prompts()
    _one_by_one(llm, prompts[:4])
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.kv_tier_stats["host"]["hit_tokens"] > 0
    _all_free(llm)


@pytest.mark.parametrize("policy", ["on_evict", "write_through"])
def test_files_hold_what_the_host_pool_cannot(reference, tmp_path, policy):
    tiers = {"host_bytes": 256 << 10, "disk_bytes": 8 << 20, "disk_dir": str(tmp_path), "policy": policy}
    llm = LLM("tiny-random", **SMALL, kv_tiers=tiers)
    outs = []
    for prompt in _prompts():  # each prompt's lookups after the files queued so far are written: a page
        outs += _one_by_one(llm, [prompt])  # whose write is still queued is a miss (computed), and under a
        assert llm.tiers.drain()  # loaded suite the writer thread fell behind every lookup once
    assert [o.token_ids for o in outs] == reference
    stats = llm.kv_tier_stats
    assert stats["disk"]["hit_tokens"] > 0 and stats["disk"]["bytes_out"] > 0
    assert all(o.num_cached_tokens > 0 for o in outs[4:])
    _all_free(llm)
    llm.close()
    # a restarted engine on the same folder starts warm
    again = LLM("tiny-random", **SMALL, kv_tiers=tiers)
    outs = _one_by_one(again, _prompts()[4:])
    assert [o.token_ids for o in outs] == reference[4:]
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert again.kv_tier_stats["disk"]["hit_tokens"] == sum(o.num_cached_tokens for o in outs)


def test_full_tiers_evict_their_least_recently_used_pages_and_count_them(reference, tmp_path):
    slot = 8192  # one tiny-random page with its header, in whole 4 KiB blocks
    tiers = {"host_bytes": 16 * slot, "disk_bytes": 40 * slot, "disk_dir": str(tmp_path)}
    llm = LLM("tiny-random", **SMALL, kv_tiers=tiers)
    assert llm.tiers.fmt.slot_bytes == slot
    outs = _one_by_one(llm, _prompts())
    assert [o.token_ids for o in outs] == reference
    _all_free(llm)
    stats = llm.kv_tier_stats
    assert stats["host"]["pages"] == 16 and stats["host"]["evictions"] > 0
    assert stats["disk"]["pages"] == 40 and stats["disk"]["evictions"] > 0


def test_a_load_keeps_its_host_pages_while_taking_device_pages_evicts_others_into_the_pool():
    """A host pool of 16 pages behind a 12-page cache: when a prompt comes back, its pages are the oldest
    in the pool, and the device pages its load takes evict others into the pool. Its slots are taken
    first, so those evictions push out other pages, never these (they did, and it found nothing)."""
    prompts = _prompts()
    small = {"dtype": "float32", "page_size": 16, "num_pages": 12, "max_num_seqs": 2}
    llm = LLM("tiny-random", **small, kv_tiers={"host_bytes": 16 * 20480})
    assert llm.tiers.fmt.slot_bytes == 20480
    _one_by_one(llm, prompts[:4])
    back = _one_by_one(llm, prompts[4:5])[0]
    assert back.num_cached_tokens == 96  # 6 of its 7 full pages were still in the pool: all of them
    assert llm.kv_tier_stats["host"]["hit_tokens"] == 96
    _all_free(llm)


def test_a_load_whose_device_pages_cannot_be_had_gives_its_host_slots_back(monkeypatch):
    """Its slots are taken before its device pages: if those cannot be had, the load runs as cancelled
    (copying nothing) and every slot it took is idle again."""
    from engine.kv.cache import OutOfPages

    llm = LLM("tiny-random", **SMALL, kv_tiers={"host_bytes": 4 << 20})
    prompts = _prompts()
    _one_by_one(llm, prompts[:4])  # the first prompt's pages are in the host pool now
    seq = llm.front.make_sequence(prompts[4], GREEDY)
    assert llm.scheduler.lookup(seq) == []
    below = llm.scheduler._below(seq, 0)
    assert below == ["host"] * 30

    def short(request_id, num_tokens):
        raise OutOfPages(f"{request_id}: no pages")

    monkeypatch.setattr(llm.allocator, "grow", short)
    with pytest.raises(OutOfPages):
        llm.scheduler._load(seq, below)
    assert llm.tiers.drain() and not any(llm.tiers.host.busy.values())
    assert seq.load is None and seq.request_id not in llm.scheduler.aside


def test_a_page_that_finds_every_host_slot_busy_is_skipped_and_counted(reference):
    """The step never waits for a host slot: while every one is busy (I/O behind each), an evicted page is
    not saved and the summary counts it (`skipped`); the text is unchanged and nothing stays busy."""
    llm = LLM("tiny-random", **SMALL, kv_tiers={"host_bytes": 16 * 8192})
    held = all_busy(llm)  # every slot, each with a write behind it
    outs = _one_by_one(llm, _prompts())
    stats = llm.kv_tier_stats["host"]
    assert stats["skipped"] > 0 and stats["pages"] == 0 and stats["hit_tokens"] == 0
    release(llm, held)
    assert [o.token_ids for o in outs] == reference
    outs = _one_by_one(llm, _prompts(seed=1))  # slots free again: pages are saved, none skipped since
    assert llm.kv_tier_stats["host"]["skipped"] == stats["skipped"] and llm.kv_tier_stats["host"]["pages"]
    _all_free(llm)


def test_a_corrupted_file_is_dropped_and_recomputed(reference, tmp_path, caplog):
    tiers = {"host_bytes": 256 << 10, "disk_bytes": 8 << 20, "disk_dir": str(tmp_path)}
    llm = LLM("tiny-random", **SMALL, kv_tiers=tiers)
    _one_by_one(llm, _prompts()[:4])
    llm.close()
    with open(tmp_path / "pages", "r+b") as f:  # flip one byte of every slot's payload
        size = os.path.getsize(tmp_path / "pages")
        slot = PageFormat([torch.zeros(2, 1)], b"", b"").slot_bytes  # one page is one 4 KiB block here
        for at in range(HEADER_BYTES + 3, size, slot):
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]) if byte else b"")
    again = LLM("tiny-random", **SMALL, kv_tiers=tiers)
    with caplog.at_level(logging.WARNING, logger="engine.kv.tiers"):
        outs = _one_by_one(again, _prompts()[4:])
    assert [o.token_ids for o in outs] == reference[4:]
    assert again.kv_tier_stats["disk"]["dropped"] > 0 and "MAC" in caplog.text
    _all_free(again)


def test_a_slot_is_used_only_if_size_namespace_name_and_mac_match():
    cache = torch.randn(3, 8, 2, 2, 4, 16)  # [layers, pages, planes, heads, page, dim]
    space = namespace("m", cache, "float32", "HND", 1)
    fmt = PageFormat([cache], space, b"secret")
    slot = torch.zeros(fmt.slot_bytes, dtype=torch.uint8)
    name = bytes(range(32))
    fmt.save(5, slot)
    fmt.stamp(slot, name)
    assert fmt.check(slot, name) is None
    fmt.load(slot, 1)
    assert torch.equal(cache[:, 1], cache[:, 5])  # a loaded page is exactly the page saved
    assert "name" in fmt.check(slot, bytes(32))
    other = namespace("m", cache, "bfloat16", "HND", 1)
    assert "namespace" in PageFormat([cache], other, b"secret").check(slot, name)
    assert "MAC" in PageFormat([cache], space, b"another secret").check(slot, name)
    assert "payload" in PageFormat([cache[:, :, :1]], space, b"secret").check(slot, name)
    slot[HEADER_BYTES + 7] ^= 1
    assert "MAC" in fmt.check(slot, name)
    assert "magic" in fmt.check(torch.zeros_like(slot), name)


def test_another_tenants_cache_salt_finds_nothing_below(reference):
    llm = LLM("tiny-random", **SMALL, kv_tiers={"host_bytes": 4 << 20})
    prompts = _prompts()
    alice, mallory = (
        SamplingParams(max_tokens=6, ignore_eos=True, cache_salt=s) for s in ("alice", "mallory")
    )
    _one_by_one(llm, prompts[:4], alice)
    assert all(o.num_cached_tokens == 0 for o in _one_by_one(llm, prompts[4:], mallory))
    assert all(o.num_cached_tokens == 0 for o in _one_by_one(llm, prompts[4:], GREEDY))
    outs = _one_by_one(llm, prompts[:4], alice)
    assert sum(o.num_cached_tokens for o in outs) > 0


def test_an_abort_while_its_pages_load_frees_them(reference):
    llm = LLM("tiny-random", **SMALL, kv_tiers={"host_bytes": 4 << 20})
    prompts = _prompts()
    _one_by_one(llm, prompts[:4])
    go = stalled(llm)
    llm.add_request(prompts[4], GREEDY, request_id="r")
    llm.step()
    assert llm.scheduler.aside["r"].status is Status.LOADING
    llm.abort("r")  # no page of it is written after this
    assert not llm.scheduler.aside and llm.allocator.num_free == llm.allocator.num_pages
    go.set()
    while llm.has_unfinished():
        llm.step()
    _all_free(llm)
    assert [o.token_ids for o in _one_by_one(llm, prompts[4:])] == reference[4:]


def test_a_load_past_its_deadline_is_computed_instead(reference):
    tiers = {"host_bytes": 4 << 20, "store_deadline_s": 0.05}
    llm = LLM("tiny-random", **SMALL, kv_tiers=tiers)
    prompts = _prompts()
    _one_by_one(llm, prompts[:4])
    go = stalled(llm)
    try:
        out = llm.generate([prompts[4]], GREEDY)[0]  # the load never writes a page before its deadline
    finally:
        go.set()
    assert out.token_ids == reference[4] and out.num_cached_tokens == 0
    _all_free(llm)


def test_a_disk_that_fails_turns_its_tier_off_and_requests_compute(reference, tmp_path, caplog):
    from transfer.backends.base import TransferError

    tiers = {"host_bytes": 256 << 10, "disk_bytes": 8 << 20, "disk_dir": str(tmp_path)}
    llm = LLM("tiny-random", **SMALL, kv_tiers=tiers)

    def gone(*args):
        raise TransferError("the disk went away")

    llm.tiers.disk.files.start = gone
    with caplog.at_level(logging.WARNING, logger="engine.kv.disk"):
        outs = _one_by_one(llm, _prompts())
    assert [o.token_ids for o in outs] == reference
    assert caplog.text.count("is off from now on") == 1 and not llm.tiers.disk.alive
    _all_free(llm)


def test_a_full_disk_serves_without_the_tier_and_says_so_once(tmp_path, caplog):
    tiers = {"host_bytes": 1 << 20, "disk_bytes": 1 << 60, "disk_dir": str(tmp_path)}
    with caplog.at_level(logging.WARNING, logger="engine.kv.tiers"):
        llm = LLM("tiny-random", **SMALL, kv_tiers=tiers)
    assert llm.tiers.disk is None and caplog.text.count("no disk tier") == 1
    assert "disk" not in llm.kv_tier_stats
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids


def test_two_engines_cannot_share_a_disk_folder(tmp_path):
    tiers = {"host_bytes": 1 << 20, "disk_bytes": 1 << 20, "disk_dir": str(tmp_path)}
    first = LLM("tiny-random", **SMALL, kv_tiers=tiers)
    with pytest.raises(ValueError, match="kv_tiers.disk_dir=.* is in use by another engine"):
        LLM("tiny-random", **SMALL, kv_tiers=tiers)
    first.close()
    LLM("tiny-random", **SMALL, kv_tiers=tiers).close()  # free again once the first one closed


@pytest.mark.parametrize(
    "tiers, match",
    [
        ({"host_bytes": -1}, r"kv_tiers.host_bytes must be an integer >= 0"),
        (
            {"host_bytes": 1 << 20, "policy": "lru"},
            r"kv_tiers.policy must be one of \('on_evict', 'write_through'\)",
        ),
        (
            {"host_bytes": 1 << 20, "disk_bytes": 1 << 20},
            r"kv_tiers.disk_bytes=1048576 needs kv_tiers.disk_dir",
        ),
        ({"disk_bytes": 1 << 20, "disk_dir": "/tmp/x"}, r"stage pages through the host pool"),
        ({"host_bytes": 1 << 20, "store": "redis"}, r"kv_tiers.store must be one of \('none', 'mooncake'\)"),
        ({"host_bytes": 1 << 20, "store_deadline_s": 0}, r"kv_tiers.store_deadline_s must be in \(0, 60\]"),
        ({"host_bytes": 1 << 20, "store_lookup_s": 61}, r"kv_tiers.store_lookup_s must be in \(0, 60\]"),
    ],
)
def test_bad_tier_settings_name_the_field_and_the_allowed_values(tiers, match):
    with pytest.raises(ValueError, match=match):
        KVTiersConfig(**tiers)


def test_tiers_need_the_prefix_cache_and_room_for_a_page():
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        LLM("tiny-random", **SMALL, enable_prefix_caching=False, kv_tiers={"host_bytes": 1 << 20})
    with pytest.raises(ValueError, match=r"kv_tiers.host_bytes=100 holds no page: one takes \d+ bytes"):
        LLM("tiny-random", **SMALL, kv_tiers={"host_bytes": 100})


def test_an_engine_dropped_without_close_frees_its_kv_and_its_io_thread():
    """Its I/O thread holds the job queue, not the tiers: the engine, its KV cache and the host pool go
    when the last reference does (a test process that made dozens of engines held them all: 5 GB)."""
    llm = LLM("tiny-random", **SMALL, kv_tiers={"host_bytes": 4 << 20})
    llm.generate([_prompts(1)[0]], GREEDY)
    kv, io = weakref.ref(llm.kv_cache), llm.tiers._io
    del llm
    gc.collect()
    assert kv() is None
    io.join(timeout=60)  # the finalizer's stop, already queued: the join returns at once
    assert not io.is_alive()
