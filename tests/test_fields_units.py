"""JSON-RPC quantities and data read strictly: only the one canonical form of a value is proven and
kept, never a form Python's int() or bytes.fromhex() would also take."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.chain.fields import FieldError, block_time, data, keccak256, quantity


class TestQuantity:
    @pytest.mark.parametrize(
        ("text", "value"), [("0x0", 0), ("0x1", 1), ("0xff", 255), ("0xFF", 255), ("0x" + "f" * 64, 2**256 - 1)]
    )
    def test_a_canonical_quantity_reads_as_its_number(self, text: str, value: int) -> None:
        assert quantity(text) == value

    @pytest.mark.parametrize(
        "text",
        [
            "0x",
            "0x01",
            "0x00",
            "0X1",
            "1",
            "0x1_0",
            "0x 1",
            "0x+1",
            "0x-1",
            "0x1 ",
            "0xg",
            "",
            None,
            1,
            True,
            [],
            "0x\u0661",
        ],
    )
    def test_a_non_canonical_quantity_is_refused(self, text: Any) -> None:
        with pytest.raises(FieldError):
            quantity(text)


class TestData:
    def test_data_reads_as_its_bytes_of_the_size_asked(self) -> None:
        assert data("0x") == b"" and data("0x00ff") == b"\x00\xff" and data("0xAB", size=1) == b"\xab"
        with pytest.raises(FieldError):
            data("0x00", size=2)

    @pytest.mark.parametrize(
        "text",
        [
            *("0x0", "0x00 11", "0x 0011", "0x0011 ", "0x00\t", "0x\x0b00", "0x\uff10\uff10", "0x\u0660\u0660"),
            *("00", "0X00", "0x0g", "0x0G", None, b"0x00", 0),
        ],
    )
    def test_malformed_data_is_refused(self, text: Any) -> None:
        with pytest.raises(FieldError):
            data(text)


def test_block_time_is_a_quantity_or_a_json_number() -> None:
    assert block_time("0x10") == block_time(16) == 16
    with pytest.raises(FieldError):
        block_time(True)


def test_keccak256_of_the_empty_string() -> None:
    assert keccak256(b"").hex() == "c5d2460186f7233c927e7db2dcc703c0e500b653ca82273b7bfad8045d85a470"
