from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, multiple, rule

from engine.kv.cache import OutOfPages, PageAllocator, page_hashes


def test_grow_free_and_count():
    alloc = PageAllocator(num_pages=10, page_size=4)
    assert alloc.grow("a", 5) == alloc.pages("a") and len(alloc.pages("a")) == 2
    alloc.grow("a", 8)  # still two pages
    assert len(alloc.pages("a")) == 2 and alloc.num_free == 8
    alloc.grow("b", 17)
    assert alloc.num_free == 3 and not set(alloc.pages("a")) & set(alloc.pages("b"))
    alloc.free("a")
    alloc.free("b")
    assert alloc.num_free == 10 and alloc.pages("a") == []


def test_out_of_pages_takes_nothing():
    alloc = PageAllocator(num_pages=3, page_size=4)
    alloc.grow("a", 8)
    assert not alloc.can_grow("b", 8)
    with pytest.raises(OutOfPages):
        alloc.grow("b", 8)
    assert alloc.num_free == 1 and alloc.pages("b") == []


def test_pinned_pages_cannot_be_freed_until_unpinned():
    alloc = PageAllocator(num_pages=4, page_size=4)
    alloc.grow("a", 4)
    alloc.pin("a")
    with pytest.raises(RuntimeError, match="pinned"):
        alloc.free("a")
    assert alloc.num_free == 3
    alloc.unpin("a")
    alloc.free("a")
    assert alloc.num_free == 4


# ---- the prefix cache ---------------------------------------------------------------------------------

SALT = b"tiny|float32|4"


def test_pages_set_aside_under_another_owner_keep_their_pin_and_free_the_request_id():
    a = PageAllocator(8, 4)
    pages = list(a.grow("r", 10))
    a.pin("r")
    a.rename("r", ("fenced", "r", 1))
    assert not a.pages("r") and a.pages(("fenced", "r", 1)) == pages and a.num_free == 5
    assert a.is_pinned(("fenced", "r", 1)) and not a.is_pinned("r")
    a.grow("r", 4)  # the id serves another request meanwhile
    with pytest.raises(ValueError, match="already owns pages"):
        a.rename("r", ("fenced", "r", 1))
    a.unpin(("fenced", "r", 1))
    a.free(("fenced", "r", 1))
    assert a.num_free == 7


def test_page_names_chain_and_differ_by_one_token():
    a = page_hashes(list(range(12)), 4, SALT, [])
    assert len(a) == 3 and len(set(a)) == 3
    b = page_hashes([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11], 4, SALT, [])
    assert b[0] == a[0] and b[1] != a[1] and b[2] != a[2]  # a changed page changes every later name
    assert page_hashes(list(range(12)), 4, b"other-model", [])[0] != a[0]  # the salt is in the name
    assert page_hashes(list(range(13)), 4, SALT, a[:1]) == a  # extends what it is given


def test_cached_pages_are_shared_then_evicted_least_recently_released_first():
    alloc = PageAllocator(num_pages=4, page_size=4)
    names = page_hashes(list(range(8)), 4, SALT, [])
    alloc.grow("a", 8)
    assert alloc.name("a", names) == 2 and alloc.num_cached == 2
    hit = alloc.lookup(names + [b"x" * 32])
    assert hit == alloc.pages("a")
    alloc.share("b", hit)
    alloc.free("a")
    assert alloc.num_free == 2  # b still holds both
    alloc.free("b")
    assert alloc.num_free == 4 and alloc.num_cached == 2  # evictable, still cached
    alloc.grow("c", 12)  # two free pages, then the first page released last ... evicted
    assert alloc.num_evicted == 1 and alloc.lookup(names) == [hit[0]]  # the tail went first
    assert not alloc.can_grow("d", 8) and alloc.can_grow("d", 4)


def test_cache_events_say_what_was_named_and_what_was_dropped_in_order():
    alloc = PageAllocator(num_pages=3, page_size=4)
    n = page_hashes(list(range(8)), 4, SALT, [])
    h = page_hashes(list(range(100, 108)), 4, SALT, [])
    alloc.grow("a", 8)
    alloc.name("a", n)  # pages 0, 1
    assert alloc.take_events() == []  # not recording: nothing kept
    alloc.record_events()
    alloc.free("a")  # tail first: page 1, then page 0, become evictable
    alloc.grow("b", 8)  # the free page 2, then page 1 evicted
    alloc.name("b", h)
    alloc.free("b")
    alloc.grow("c", 4)  # page 0 evicted
    alloc.grow("d", 8)  # pages 1 and 2: b released its tail (page 1) first
    assert alloc.take_events() == [(False, n[1]), (True, h[0]), (True, h[1]), (False, n[0]), (False, h[1]),
                                   (False, h[0])]  # fmt: skip
    assert alloc.take_events() == []
    alloc.name("d", n)
    alloc.reset_cache()
    assert alloc.take_events() == [(True, n[0]), (True, n[1]), (False, n[0]), (False, n[1])]
    alloc.events = [(True, b"x")] * PageAllocator.MAX_EVENTS
    alloc._event(False, b"y")  # kept to the bound, the oldest dropped
    assert len(alloc.events) == PageAllocator.MAX_EVENTS and alloc.events[-1] == (False, b"y")


def test_a_name_already_cached_stays_with_its_page():
    alloc = PageAllocator(num_pages=4, page_size=4)
    names = page_hashes(list(range(4)), 4, SALT, [])
    alloc.grow("a", 4), alloc.grow("b", 4)  # both computed the same prompt at once
    alloc.name("a", names), alloc.name("b", names)
    assert alloc.lookup(names) == alloc.pages("a")
    alloc.free("b")  # unnamed: free at once
    assert alloc.num_cached == 1 and alloc.num_free == 3
    assert alloc.reset_cache() == 1 and alloc.lookup(names) == []
    alloc.free("a")
    assert alloc.num_free == 4 and alloc.num_cached == 0


def test_share_takes_only_cached_pages_and_only_first():
    alloc = PageAllocator(num_pages=4, page_size=4)
    alloc.grow("a", 4)
    with pytest.raises(RuntimeError, match="not cached"):
        alloc.share("b", alloc.pages("a"))
    with pytest.raises(RuntimeError, match="already holds"):
        alloc.share("a", [])


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests over a 3-token alphabet (so prompts share prefixes) start, compute, shrink, pin, preempt
    and end in any order against a small allocator; a model of what each page holds is checked at every
    step."""

    P = 2

    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(num_pages=12, page_size=self.P)
        self.tokens: dict[str, list[int]] = {}  # request -> its tokens
        self.held: dict[str, list[int]] = {}  # request -> its pages, as this model tracks them
        self.content: dict[int, tuple[int, ...]] = {}  # named page -> the tokens up to its end
        self.ids = 0

    requests = Bundle("requests")

    @rule(target=requests, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def start(self, tokens):
        rid = f"r{self.ids}"
        self.ids += 1
        names = page_hashes(tokens, self.P, SALT, [])
        hit = self.alloc.lookup(names[: (len(tokens) - 1) // self.P])
        for i, page in enumerate(hit):  # a name answers only for its own tokens
            assert self.content[page] == tuple(tokens[: (i + 1) * self.P])
        if self.alloc.pages_for(len(tokens)) - len(hit) > self.alloc.num_free - self.alloc.num_unused(hit):
            return multiple()
        others = {p for pages in self.held.values() for p in pages}
        self.alloc.share(rid, hit)
        new = self.alloc.grow(rid, len(tokens))[len(hit) :]
        assert not set(new) & others  # a page in use is never handed out again
        for page in new:
            self.content.pop(page, None)  # a fresh page's old KV is gone
        self.tokens[rid], self.held[rid] = tokens, list(self.alloc.pages(rid))
        return rid

    @rule(rid=requests)
    def compute(self, rid):
        if rid not in self.held:
            return
        tokens = self.tokens[rid]
        names = page_hashes(tokens, self.P, SALT, [])
        self.alloc.name(rid, names)
        for i, page in enumerate(self.held[rid][: len(names)]):
            if self.alloc.lookup(names[: i + 1])[-1:] == [page]:
                self.content.setdefault(page, tuple(tokens[: (i + 1) * self.P]))

    @rule(rid=requests, keep=st.integers(1, 9))
    def shrink(self, rid, keep):
        if rid in self.held and keep < len(self.tokens[rid]):
            self.tokens[rid] = self.tokens[rid][:keep]
            self.alloc.shrink(rid, keep)
            self.held[rid] = list(self.alloc.pages(rid))

    @rule(rid=requests, pin=st.booleans())
    def end(self, rid, pin):
        if rid not in self.held:
            return
        if pin:
            self.alloc.pin(rid)
            with pytest.raises(RuntimeError, match="pinned"):
                self.alloc.free(rid)
            self.alloc.unpin(rid)
        self.alloc.free(rid)
        del self.held[rid], self.tokens[rid]

    @rule(tokens=st.lists(st.integers(0, 2), min_size=2, max_size=9))
    def lookup(self, tokens):
        names = page_hashes(tokens, self.P, SALT, [])
        for i, page in enumerate(self.alloc.lookup(names)):  # a name answers only for its own tokens
            assert self.content[page] == tuple(tokens[: (i + 1) * self.P])

    @rule()
    def reset(self):
        self.alloc.reset_cache()
        self.content.clear()

    @invariant()
    def pages_are_accounted_for(self):
        a = self.alloc
        refs = Counter(p for pages in self.held.values() for p in pages)
        assert all(r >= 0 for r in a._refs)
        assert all(a._refs[p] == refs.get(p, 0) for p in range(a.num_pages))
        unused = set(a._free) | set(a._evictable)
        assert not unused & set(refs) and len(unused) == a.num_free == a.num_pages - len(refs)
        assert set(a._evictable) <= set(a._name) and not set(a._free) & set(a._name)
        assert {p: h for h, p in a._page.items()} == a._name
        assert all(self.content.get(page) is not None for page in a._name)
        if not self.held:
            assert a.num_free == a.num_pages


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
