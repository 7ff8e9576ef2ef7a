"""The page allocator: exact free count, contiguous runs preferred, double frees refused."""

import pytest

from splitserve.engine.page_allocator import PageAllocator


def test_free_count_is_exact_through_allocate_and_free():
    a = PageAllocator(10)
    x = a.allocate(3)
    y = a.allocate(4)
    assert a.num_free == 3
    a.free(x)
    assert a.num_free == 6
    a.free(y)
    assert a.num_free == 10
    assert sorted(x + y) == list(range(7))


def test_prefers_continuing_the_last_page_then_a_contiguous_run():
    a = PageAllocator(16)
    first = a.allocate(2)  # 0, 1
    other = a.allocate(2)  # 2, 3
    a.free(first)
    grown = a.allocate(2, after=other[-1])
    assert grown == [4, 5]
    a.allocate(1)  # takes 0, leaving 1 alone and 6.. as a run
    assert a.allocate(3) == [6, 7, 8]  # a run of 3, not the scattered 1 + 6 + 7


def test_falls_back_to_scattered_pages_when_no_run_is_long_enough():
    a = PageAllocator(6)
    pages = a.allocate(6)
    a.free([pages[0], pages[2], pages[4]])
    assert a.allocate(3) == [0, 2, 4]
    assert a.num_free == 0


def test_double_free_and_overdraw_raise():
    a = PageAllocator(4)
    p = a.allocate(2)
    a.free(p)
    with pytest.raises(ValueError):
        a.free(p)
    with pytest.raises(MemoryError):
        a.allocate(5)
    assert a.num_free == 4
