"""The bounded memos of pure results: their bounds and what they forget first."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.memo import ByteBoundMemo, Memo


def test_a_full_memo_starts_over_and_a_computing_memo_fills_itself() -> None:
    squares = Memo[int, int](2, lambda n: n * n)
    assert (squares[3], squares[4]) == (9, 16)
    assert squares[5] == 25 and dict(squares) == {5: 25}  # full: started over
    squares[5] = 26  # a key already held replaces its value without starting over
    assert squares[6] == 36 and dict(squares) == {5: 26, 6: 36}


def test_a_byte_bound_memo_forgets_its_oldest_entries_to_make_room_and_keeps_none_larger_than_its_bound() -> None:
    memo = ByteBoundMemo[str, int](10)
    memo.keep("a", 1, 4)
    memo.keep("b", 2, 4)
    memo.keep("c", 3, 4)  # 12 > 10: "a" goes
    assert dict(memo) == {"b": 2, "c": 3} and memo.held == 8
    memo.keep("b", 20, 2)  # kept again: its old size no longer counted, and it is now the newest
    assert list(memo) == ["c", "b"] and memo.held == 6
    memo.keep("big", 0, 11)
    assert "big" not in memo and memo.held == 6
    memo.keep("c", 0, 11)  # a key kept again too large for the bound is forgotten, not left stale
    assert dict(memo) == {"b": 20} and memo.held == 2
    memo.forget("absent")
    assert memo.held == 2


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 40)), max_size=60), st.integers(0, 60))
def test_a_byte_bound_memo_holds_exactly_the_sizes_it_counts_and_never_more_than_its_bound(
    entries: list[tuple[int, int]], bound: int
) -> None:
    memo = ByteBoundMemo[int, int](bound)
    sizes: dict[int, int] = {}
    for key, size in entries:
        memo.keep(key, size, size)
        sizes.pop(key, None)
        if size <= bound:
            sizes[key] = size
            while sum(sizes.values()) > bound:
                del sizes[next(iter(sizes))]
        assert dict(memo) == sizes and memo.held == sum(sizes.values()) <= bound
