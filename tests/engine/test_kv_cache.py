import pytest

from engine.kv_cache import OutOfPages, PageAllocator


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
