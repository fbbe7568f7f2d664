"""Chunked eth_getLogs, the pure part: aligned pieces, cutting, merging, the limit over the merge."""

from __future__ import annotations

from typing import Any

from proxy.cache.log_chunks import (
    BYPASS,
    HIT,
    MAX_PIECES,
    MISS,
    PARTIAL,
    Piece,
    cache_result,
    chunked,
    cut,
    logs_from_receipts,
    matches,
    merge,
    plan,
    well_formed,
)


def log(block: int, index: int = 0) -> dict[str, Any]:
    return {"blockNumber": hex(block), "logIndex": hex(index)}


class TestPlan:
    def test_finalized_ranges_are_whole_aligned_chunks_shared_by_overlapping_windows(self) -> None:
        # An indexer's windows overlapping by half name the same aligned chunks.
        assert plan(500, 1499, finalized=5000, size=1000) == [Piece(0, 999, 500, 999), Piece(1000, 1999, 1000, 1499)]
        assert plan(1000, 1999, finalized=5000, size=1000) == [Piece(1000, 1999, 1000, 1999)]

    def test_an_inner_range_is_served_by_the_chunk_around_it(self) -> None:
        assert plan(1200, 1300, finalized=5000, size=1000) == [Piece(1000, 1999, 1200, 1300)]

    def test_near_finality_chunks_are_a_tenth_and_the_rest_is_one_exact_tail(self) -> None:
        assert plan(0, 2345, finalized=2250, size=1000) == [
            Piece(0, 999, 0, 999),
            Piece(1000, 1999, 1000, 1999),
            Piece(2000, 2099, 2000, 2099),
            Piece(2100, 2199, 2100, 2199),
            Piece(2200, 2345, 2200, 2345),  # 2200..2250 fill no small chunk: asked with the unfinalized rest
        ]

    def test_a_range_ending_below_finality_inside_an_incomplete_small_chunk_ends_with_an_exact_tail(self) -> None:
        assert plan(1950, 2230, finalized=2250, size=1000) == [
            Piece(1000, 1999, 1950, 1999),
            Piece(2000, 2099, 2000, 2099),
            Piece(2100, 2199, 2100, 2199),
            Piece(2200, 2230, 2200, 2230),
        ]

    def test_pieces_cover_the_range_once_in_order(self) -> None:
        for first, last, finalized, size in [(0, 0, 0, 1000), (7, 12345, 9999, 1000), (3, 77, 50, 10), (5, 9, 100, 1)]:
            pieces = plan(first, last, finalized, size)
            wanted = [b for p in pieces for b in range(p.want_start, p.want_end + 1)]
            assert wanted == list(range(first, last + 1))
            assert all(p.start <= p.want_start <= p.want_end <= p.end for p in pieces)

    def test_only_ranges_reaching_into_finalized_blocks_are_chunked(self) -> None:
        assert chunked(0, 10, finalized=5, size=1000)
        assert not chunked(6, 10, finalized=5, size=1000)  # wholly above finality: pinned as one range
        assert not chunked(0, 10, finalized=5, size=0)  # GETLOGS_CHUNK_BLOCKS=0

    def test_a_range_of_more_than_max_pieces_chunks_is_asked_whole(self) -> None:
        assert chunked(0, MAX_PIECES * 1000 - 1, finalized=10**9, size=1000)
        assert not chunked(0, MAX_PIECES * 1000 + 5000, finalized=10**9, size=1000)


class TestMerge:
    def test_a_whole_chunk_is_cut_to_the_blocks_the_range_wants(self) -> None:
        logs = [log(999), log(1000), log(1500), log(1501)]
        assert cut(logs, Piece(1000, 1999, 1000, 1500)) == [log(1000), log(1500)]

    def test_pieces_merge_in_range_order(self) -> None:
        assert merge([[log(1), log(1, 1)], [], [log(5)]]) == [log(1), log(1, 1), log(5)]

    def test_an_answer_with_logs_outside_the_asked_blocks_is_not_well_formed(self) -> None:
        assert well_formed([log(10)], Piece(10, 20, 10, 20))
        assert not well_formed([log(21)], Piece(10, 20, 10, 20))
        assert not well_formed([{"blockNumber": None}], Piece(10, 20, 10, 20))
        assert not well_formed(None, Piece(10, 20, 10, 20))


class TestCacheResult:
    def test_hit_only_when_no_piece_went_upstream(self) -> None:
        assert cache_result([False, False]) == HIT
        assert cache_result([True, False]) == PARTIAL
        assert cache_result([True, True]) == MISS

    def test_bypass_when_any_piece_was_served_but_not_kept(self) -> None:
        assert cache_result([False, False], bypassed=True) == BYPASS
        assert cache_result([True, True], bypassed=True) == BYPASS


class TestFromReceipts:
    A, B = "0x" + "aa" * 20, "0x" + "bb" * 20
    T1, T2, T3 = "0x" + "01" * 32, "0x" + "02" * 32, "0x" + "03" * 32

    def entry(self, address: str, *topics: str) -> dict[str, Any]:
        return {"address": address, "topics": list(topics), "blockNumber": "0x1"}

    def test_the_filter_rule_is_go_ethereums(self) -> None:
        log_entry = self.entry(self.A, self.T1, self.T2)
        assert matches(log_entry, None, None)
        assert matches(log_entry, [self.A], [[self.T1]])
        assert not matches(log_entry, [self.B], None)
        assert matches(log_entry, None, [None, [self.T2, self.T3]])  # a wildcard, then an OR-list
        assert not matches(log_entry, None, [[self.T2]])
        assert not matches(log_entry, None, [None, None, [self.T3]])  # more positions than topics

    def test_logs_come_in_block_then_receipt_order_filtered(self) -> None:
        first = [{"logs": [self.entry(self.A, self.T1), self.entry(self.B, self.T1)]}, {"logs": []}]
        second = [{"logs": [self.entry(self.A, self.T2)]}]
        assert logs_from_receipts([first, second], {"address": [self.A]}) == [
            self.entry(self.A, self.T1),
            self.entry(self.A, self.T2),
        ]

    def test_a_null_or_malformed_receipts_answer_gives_no_answer(self) -> None:
        assert logs_from_receipts([[], None], {}) is None

    def test_a_trailing_wildcard_is_left_to_the_node(self) -> None:
        # Nodes differ on logs with fewer topics than the filter's positions: never derived here.
        assert logs_from_receipts([[]], {"topics": [["0x" + "aa" * 32], None]}) is None
        assert logs_from_receipts([[{"logs": None}]], {}) is None
