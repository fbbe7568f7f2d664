"""RLP (Yellow Paper appendix B): the Ethereum test vectors encode and decode, non-canonical bytes are
refused, and any item round-trips the same as the reference `rlp` package."""

from __future__ import annotations

import pytest
import rlp as reference
from hypothesis import given
from hypothesis import strategies as st

from proxy.chain.rlp import Encodable, Item, RlpError, decode, decode_int, encode, encode_int, wrap_list

LOREM_55 = b"Lorem ipsum dolor sit amet, consectetur adipisicing eli"
LOREM_56 = b"Lorem ipsum dolor sit amet, consectetur adipisicing elit"

# ethereum/tests RLPTests/rlptest.json
VECTORS: list[tuple[Encodable, str]] = [
    (b"", "80"),
    (b"\x00", "00"),
    (b"\x01", "01"),
    (b"\x7f", "7f"),
    (b"dog", "83646f67"),
    (LOREM_55, "b7" + LOREM_55.hex()),
    (LOREM_56, "b838" + LOREM_56.hex()),
    (0, "80"),
    (1, "01"),
    (16, "10"),
    (79, "4f"),
    (127, "7f"),
    (128, "8180"),
    (1000, "8203e8"),
    (1024, "820400"),
    (100000, "830186a0"),
    ([], "c0"),
    ([b"dog", b"god", b"cat"], "cc83646f6783676f6483636174"),
    ([b"cat", b"dog"], "c88363617483646f67"),
    ([b"zw", [4], 1], "c6827a77c10401"),
    ([[[], []], []], "c4c2c0c0c0"),
    ([[], [[]], [[], [[]]]], "c7c0c1c0c3c0c1c0"),
    (
        [b"asdf", b"qwer", b"zxcv"] * 3 + [b"asdf", b"qwer"],
        "f784617364668471776572847a78637684617364668471776572847a78637684617364668471776572847a7863768461736466"
        "8471776572",
    ),
    ([[b"asdf", b"qwer", b"zxcv"]] * 4, "f840" + "cf84617364668471776572847a786376" * 4),
]


def _as_item(value: Encodable) -> Item:
    if isinstance(value, int):
        return encode_int(value)
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    return [_as_item(part) for part in value]


class TestVectors:
    @pytest.mark.parametrize(("value", "expected"), VECTORS)
    def test_rlp_encodes_the_ethereum_test_vectors(self, value: Encodable, expected: str) -> None:
        assert encode(value).hex() == expected

    @pytest.mark.parametrize(("value", "expected"), VECTORS)
    def test_rlp_decodes_the_ethereum_test_vectors(self, value: Encodable, expected: str) -> None:
        assert decode(bytes.fromhex(expected)) == _as_item(value)

    def test_rlp_integers_are_minimal_big_endian(self) -> None:
        assert decode_int(decode(encode(2**256 - 1))) == 2**256 - 1
        assert decode_int(b"") == 0
        with pytest.raises(RlpError):
            decode_int(b"\x00\x01")
        with pytest.raises(RlpError):
            encode(-1)


class TestStrictDecoding:
    @pytest.mark.parametrize(
        "bad",
        [
            "8100",  # 0x00 wrapped in a prefix: its canonical form is the byte itself
            "817f",
            "b800",  # the long form for a short length
            "b837" + "61" * 0x37,
            "b90037" + "61" * 0x37,  # a length with a leading zero
            "f800",
            "c1",  # truncated
            "83646f",
            "b9",
            "c3836466",
            "8000",  # bytes after the item
            "c0c0",
            "c18180",  # an item running past the end of its list
            "",
        ],
    )
    def test_rlp_refuses_non_canonical_or_malformed_bytes(self, bad: str) -> None:
        with pytest.raises(RlpError):
            decode(bytes.fromhex(bad))

    def test_rlp_refuses_lists_nested_past_its_depth_limit_without_exhausting_the_stack(self) -> None:
        nested = b"\xc0"
        for _ in range(5000):
            nested = wrap_list(nested)
        with pytest.raises(RlpError, match="deep"):
            decode(nested)

    def test_rlp_refuses_what_it_cannot_encode(self) -> None:
        with pytest.raises(RlpError):
            encode("dog")  # type: ignore[arg-type]
        with pytest.raises(RlpError):
            encode(True)


items: st.SearchStrategy[Item] = st.recursive(
    st.binary(max_size=80),
    lambda inner: st.lists(inner, max_size=6),
    max_leaves=20,
)


class TestAgainstReference:
    @given(items)
    def test_rlp_encodes_as_the_reference_package_and_round_trips(self, item: Item) -> None:
        encoded = encode(item)
        assert encoded == reference.encode(item)
        assert decode(encoded) == item

    @given(st.binary(max_size=40))
    def test_rlp_decodes_only_what_the_reference_accepts_strictly(self, data: bytes) -> None:
        try:
            mine: Item | None = decode(data)
        except RlpError:
            mine = None
        try:
            theirs = reference.decode(data, strict=True)
        except reference.exceptions.DecodingError:
            theirs = None
        if mine is not None:  # what we accept, the reference accepts and reads the same
            assert theirs is not None and reference.encode(theirs) == data
