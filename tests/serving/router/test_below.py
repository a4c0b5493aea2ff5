"""The router's view below device memory (serving/router/below.py): cache_aware prices a page by
where it is, from the workers' tier events and the load times they measured."""

from serving.messages import Load, TierCounters
from serving.router.policy import Router


def _names(conversation: str, pages: int) -> list:
    return [(conversation, i) for i in range(pages)]


def _load(name, tier_events=(), kv_tiers=None, prefill_tokens=0, prefill_s=0.0):
    return Load(name, 0, 0, 0, tier_events=list(tier_events), kv_tiers=kv_tiers or {},
                prefill_tokens=prefill_tokens, prefill_s=prefill_s)  # fmt: skip


def test_a_history_below_device_memory_beats_one_computed_from_scratch():
    r = Router(["a", "b"], page_size=16)
    r.route("busy", [("other", 0)], 16, ["a"])  # a has one page in flight: b wins a tie
    r.observe_load("a", _load("a", [("host", True, n) for n in _names("c1", 10)]))
    # on a: 10 pages in its host pool at 0.05 each + 2 computed + 1 in flight; on b: 12 computed
    assert r.compute_pages("a", _names("c1", 12), 12) == 0.05 * 10 + 2
    assert r.route("c1-t1", _names("c1", 12), 192, ["a", "b"]) == "a"
    assert r.overlap_pages == 0  # its device held none of them


def test_device_pages_first_then_below_then_nothing_as_the_engine_looks_up():
    r = Router(["a"], page_size=16)
    names = _names("c", 6)
    r.observe("a", [(True, names[0]), (True, names[1]), (True, names[3])])  # device: 0, 1 and 3
    r.observe_load("a", _load("a", [("disk", True, names[2]), ("host", True, names[5])]))
    # 0, 1 on the device; 2 on disk (0.2); 3 not on the device once 2 was not: nowhere below, stop
    assert r.compute_pages("a", names, 6) == 0.2 + 3


def test_the_shared_pool_is_every_worker_s_and_a_dropped_name_is_gone():
    r = Router(["a", "b"], page_size=16)
    r.observe_load("b", _load("b", [("pool", True, n) for n in _names("c", 4)]))  # b put them
    assert r.compute_pages("a", _names("c", 4), 4) == r.compute_pages("b", _names("c", 4), 4) == 0.2 * 4
    r.observe_load("a", _load("a", [("host", True, ("c", 0)), ("host", False, ("c", 0))]))
    assert r.below.price_of("a", ("c", 0)) == 0.2  # only the pool's copy left


def test_prices_follow_the_load_times_the_workers_measured():
    r = Router(["a"], page_size=16)
    counters = {"host": TierCounters(hit_tokens=160, loads=1, load_s=0.01)}  # 10 pages in 10 ms
    r.observe_load("a", _load("a", kv_tiers=counters, prefill_tokens=1600, prefill_s=1.0))  # 10 ms a page
    assert 0.05 < r.below.price["host"] < 0.05 * 0.7 + 0.3 * 0.1 + 1e-9  # halfway to 1 ms / 10 ms
    r.observe_load("a", _load("a", kv_tiers=counters, prefill_tokens=3200, prefill_s=2.0))  # no new load
    assert abs(r.below.price["host"] - (0.05 * 0.7 + 0.03)) < 1e-9


def test_a_dead_worker_s_host_pool_is_forgotten_but_its_files_are_not():
    r = Router(["a"], page_size=16)
    r.observe_load("a", _load("a", [("host", True, ("x", 0)), ("disk", True, ("x", 1))]))
    r.forget("a")
    assert r.below.price_of("a", ("x", 0)) is None and r.below.price_of("a", ("x", 1)) == 0.2
