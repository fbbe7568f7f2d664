"""Verified uncles: eth_getUncleByBlockHashAndIndex about a final block is proven before it is kept
forever (chain/answer_proofs.py). The block is the trusted chain's block by its header's hash; its
uncle hashes are proven by sha3Uncles with every uncle header; a null is proven by no uncle at the
index, an uncle by its header hashing to the block's uncle hash there. Post-merge chains (and Anvil)
have no uncles: the usual answer is a null proven by an empty list whose sha3Uncles is EMPTY_UNCLES."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.chain import answer_proofs as ap
from proxy.chain.block_body import EMPTY_UNCLES
from proxy.chain.fields import keccak256
from proxy.chain.headers import header_hash, header_rlp, verify_header
from proxy.chain.rlp import wrap_list
from tests.lying_relay import LyingRelay
from tests.support import Anvil
from tests.test_verified_answers import _ask, _final, _proxy, _refuted_then_proven, _verifications

UNCLE = "eth_getUncleByBlockHashAndIndex"


def _header(number: int, sha3_uncles: bytes = EMPTY_UNCLES, extra: str = "0x") -> dict[str, Any]:
    """A Frontier header with its hash computed from its fields."""
    header: dict[str, Any] = {
        "parentHash": "0x" + "01" * 32,
        "sha3Uncles": "0x" + sha3_uncles.hex(),
        "miner": "0x" + "02" * 20,
        "stateRoot": "0x" + "03" * 32,
        "transactionsRoot": "0x" + "04" * 32,
        "receiptsRoot": "0x" + "05" * 32,
        "logsBloom": "0x" + "00" * 256,
        "difficulty": "0x20000",
        "number": hex(number),
        "gasLimit": "0x1c9c380",
        "gasUsed": "0x0",
        "timestamp": hex(1000 + number),
        "extraData": extra,
        "mixHash": "0x" + "06" * 32,
        "nonce": "0x" + "07" * 8,
    }
    header["hash"] = "0x" + header_hash(header).hex()
    return header


def _block_with_uncles(uncles: list[dict[str, Any]]) -> dict[str, Any]:
    sha3 = keccak256(wrap_list(b"".join(header_rlp(u) for u in uncles)))
    return {**_header(10, sha3), "uncles": [u["hash"] for u in uncles], "transactions": []}


def test_an_uncle_is_proven_by_its_hash_in_the_blocks_uncles_and_a_null_by_none_at_its_index() -> None:
    one, two = _header(9, extra="0x01"), _header(9, extra="0x02")
    block = _block_with_uncles([one, two])
    header, extras = verify_header(block), [block, one, two]
    assert ap.answer_block(UNCLE, [block["hash"], "0x1"], two) == block["hash"]  # not the uncle's number
    assert ap.extra_calls(UNCLE, [block["hash"], "0x1"], two, 10) == [("eth_getBlockByHash", [block["hash"], False])]
    assert ap.follow_up_calls(UNCLE, [block["hash"], "0x1"], [block]) == [
        (UNCLE, [block["hash"], "0x0"]),
        (UNCLE, [block["hash"], "0x1"]),
    ]
    ap.prove(UNCLE, [block["hash"], "0x1"], two, header, extras)
    ap.prove(UNCLE, [block["hash"], "0x2"], None, header, extras)  # no third uncle
    with pytest.raises(ap.AnswerError):
        ap.prove(UNCLE, [block["hash"], "0x0"], None, header, extras)  # null for an uncle the block has
    with pytest.raises(ap.AnswerError):
        ap.prove(UNCLE, [block["hash"], "0x0"], two, header, extras)  # the other index's uncle
    with pytest.raises(ap.AnswerError):
        ap.prove(UNCLE, [block["hash"], "0x0"], one, header, [block, two, one])  # headers not sha3Uncles'
    with pytest.raises(ap.AnswerError):
        ap.prove(UNCLE, [block["hash"], "0x2"], None, header, [block, one])  # an uncle header missing
    made_up = {**_block_with_uncles([one]), "hash": block["hash"]}  # claims the block's hash
    with pytest.raises(ap.AnswerError):
        ap.prove(UNCLE, [block["hash"], "0x1"], None, header, [made_up, one])


def test_a_block_without_uncles_proves_every_index_null() -> None:
    block = {**_header(10), "uncles": [], "transactions": []}
    header = verify_header(block)
    assert ap.follow_up_calls(UNCLE, [block["hash"], "0x0"], [block]) == []
    ap.prove(UNCLE, [block["hash"], "0x0"], None, header, [block])
    with pytest.raises(ap.AnswerError):
        ap.prove(UNCLE, [block["hash"], "0x0"], _header(9), header, [block])  # an uncle it cannot have
    with pytest.raises(ap.AnswerError):
        ap.prove(UNCLE, [block["hash"], "0x0"], None, verify_header(_header(11)), [block])  # another block
    with pytest.raises(ap.AnswerError):
        ap.prove(UNCLE, [block["hash"], "0x0"], None, header, [None])  # no block for a final hash


def _final_block(anvil: Anvil) -> tuple[str, int]:
    anvil.mine(1)
    n = anvil.block_number()
    return anvil.rpc("eth_getBlockByNumber", hex(n), False)["hash"], n


async def test_a_final_blocks_null_uncle_is_proven_and_a_repeat_is_a_hit(anvil: Anvil, tmp_path: Path) -> None:
    block_hash, n = _final_block(anvil)
    async with _proxy(tmp_path, [anvil.url]) as proxy:
        await _final(anvil, proxy, n)
        params = [block_hash, "0x0"]
        assert await _ask(proxy, UNCLE, params) == (None, "MISS", "proven")
        assert _verifications(proxy, UNCLE, "proven") == 1
        # Found in the cache by block hash: told unproven, as every answer by block hash is.
        assert (await _ask(proxy, UNCLE, params))[:2] == (None, "HIT")
        # A hash no chain holds: no block to prove a null by; null as the interface says (Anvil's own
        # answer is -32001 "Resource not found"), never kept, not proven.
        unknown = {"jsonrpc": "2.0", "id": 1, "method": UNCLE, "params": ["0x" + "ee" * 32, "0x0"]}
        _, body, headers = await proxy.post(unknown)
        assert (body["result"], headers["X-Cache"]) == (None, "BYPASS")
        assert _verifications(proxy, UNCLE, "proven") == 1


async def test_an_uncle_made_up_for_a_final_block_alone_is_never_kept(anvil: Anvil, tmp_path: Path) -> None:
    block_hash, n = _final_block(anvil)
    some_header = anvil.rpc("eth_getBlockByNumber", "0x1", False)
    liar = await LyingRelay(anvil.url, "uncle", below=n, uncle=some_header).start()
    try:
        async with _proxy(tmp_path, [liar.url]) as proxy:
            await _final(anvil, proxy, n)
            params = [block_hash, "0x0"]
            told, cache, verified = await _ask(proxy, UNCLE, params)
            # served (nothing better to serve), told unproven, not kept
            assert told == some_header and cache != "HIT" and verified == "unproven"
            assert (await _ask(proxy, UNCLE, params))[1] != "HIT"
            assert _verifications(proxy, UNCLE, "refuted") == 2
            liar.lie = None  # honest now: the null is proven and kept
            assert await _ask(proxy, UNCLE, params) == (None, "MISS", "proven")
            assert (await _ask(proxy, UNCLE, params))[:2] == (None, "HIT")
    finally:
        await liar.close()


async def test_an_uncle_made_up_for_a_block_not_yet_final_is_never_kept(anvil: Anvil, tmp_path: Path) -> None:
    """Rule: an uncle asked by the hash of a block above finality is proven against the header that
    hash names, so a made-up one is refuted and never kept (its key being the hash, it was kept forever)."""
    anvil.mine(1)
    some_header = anvil.rpc("eth_getBlockByNumber", "0x1", False)
    liar = await LyingRelay(anvil.url, "uncle", below=10**9, uncle=some_header).start()
    try:
        async with _proxy(tmp_path, [liar.url]) as proxy:
            await _final(anvil, proxy, anvil.block_number())
            top = anvil.mine(1)  # above finality
            await proxy.head_at(top)
            params = [anvil.rpc("eth_getBlockByNumber", hex(top), False)["hash"], "0x0"]
            assert await _refuted_then_proven(proxy, liar, UNCLE, params, None) == some_header
    finally:
        await liar.close()


async def test_beside_an_honest_node_a_made_up_uncle_is_never_served(anvil: Anvil, tmp_path: Path) -> None:
    block_hash, n = _final_block(anvil)
    liar = await LyingRelay(anvil.url, "uncle", below=n, uncle=anvil.rpc("eth_getBlockByNumber", "0x1", False)).start()
    try:
        async with _proxy(tmp_path, [liar.url, anvil.url]) as proxy:
            await _final(anvil, proxy, n)
            for _ in range(3):
                assert (await _ask(proxy, UNCLE, [block_hash, "0x0"]))[0] is None
            assert liar.lies_told > 0
            assert _verifications(proxy, UNCLE, "refuted") >= 1
    finally:
        await liar.close()
