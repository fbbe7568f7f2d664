"""Pure validation and canonical forms of the first-class methods' params."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.rpc import params as p
from proxy.rpc.jsonrpc import INVALID_PARAMS, LIMIT_EXCEEDED, JsonRpcError
from tests.fake_solana import SIGNATURE

RULES = p.Rules()
ADDR = "0x5FbDB2315678afecb367f032d93F642f64180aa3"
HASH = "0x" + "ab" * 32
PUBKEY = "7fUAJdStEuGbc3sM84cKRL6yYaaSstyLSU4ve5oovLS7"


def rejects(fn: Any, params: list[Any], fragment: str, code: int = INVALID_PARAMS, rules: p.Rules = RULES) -> None:
    with pytest.raises(JsonRpcError) as caught:
        fn(params, rules)
    assert caught.value.code == code
    assert fragment in caught.value.message, caught.value.message


class TestCanonicalForms:
    def test_addresses_are_lower_cased_so_checksum_case_is_the_same_request(self) -> None:
        assert p.eth_get_storage_at([ADDR, "0x0", "0x1"], RULES)[0] == ADDR.lower()

    def test_long_calldata_is_lower_cased_and_kept_as_it_is_when_already_lower(self) -> None:
        # A call of megabytes of calldata held one more copy of it while made (bench/body_copies.py).
        lower, upper = "0x" + "ab" * 5000, "0x" + "Ab" * 5000
        assert p.eth_call([{"to": ADDR, "data": lower}, "latest"], RULES)[0]["data"] is lower
        assert p.eth_call([{"to": ADDR, "data": upper}, "latest"], RULES)[0]["data"] == lower

    def test_storage_positions_are_32_byte_words(self) -> None:
        short = p.eth_get_storage_at([ADDR, "0x0", "latest"], RULES)[1]
        padded = p.eth_get_storage_at([ADDR, "0x" + "0" * 64, "latest"], RULES)[1]
        assert short == padded == "0x" + "0" * 64

    def test_quantities_are_normalised(self) -> None:
        assert p.eth_get_uncle_by_block_hash_and_index([HASH, "0x00"], RULES)[1] == "0x0"
        assert p.eth_get_uncle_by_block_hash_and_index([HASH.upper().replace("0X", "0x"), "0x01"], RULES) == [
            HASH,
            "0x1",
        ]

    def test_block_numbers_become_refs_with_the_number(self) -> None:
        ref = p.eth_call([{"from": ADDR}, "0x0010"], RULES)[1]
        assert isinstance(ref, p.BlockRef) and ref.number == 16 and ref.encode() == "0x10"

    def test_eip1898_block_hash_object_is_kept_in_object_form(self) -> None:
        ref = p.eth_get_storage_at([ADDR, "0x0", {"blockHash": HASH}], RULES)[2]
        assert ref.hash == HASH and ref.encode() == {"blockHash": HASH}

    def test_eip1898_require_canonical_is_kept_and_forwarded(self) -> None:
        ref = p.eth_get_storage_at([ADDR, "0x0", {"blockHash": HASH, "requireCanonical": True}], RULES)[2]
        assert ref.require_canonical and ref.encode() == {"blockHash": HASH, "requireCanonical": True}
        plain = p.eth_call([{"from": ADDR}, {"blockHash": HASH, "requireCanonical": False}], RULES)[1]
        assert not plain.require_canonical and plain.encode() == {"blockHash": HASH}
        with pytest.raises(JsonRpcError):
            p.eth_call([{"from": ADDR}, {"blockHash": HASH, "requireCanonical": "yes"}], RULES)

    def test_get_logs_fills_latest_defaults(self) -> None:
        flt = p.eth_get_logs([{}], RULES)[0]
        assert flt["fromBlock"].tag == "latest" and flt["toBlock"].tag == "latest"

    def test_get_logs_addresses_and_topic_alternatives_are_sorted_sets(self) -> None:
        a, b = "0x" + "11" * 20, "0x" + "22" * 20
        flt = p.eth_get_logs([{"address": [b, a, b], "topics": [[HASH, "0x" + "01" * 32], None, None]}], RULES)[0]
        assert flt["address"] == [a, b]
        assert flt["topics"] == [sorted(["0x" + "01" * 32, HASH]), None, None]

    def test_get_logs_trailing_wildcards_are_part_of_the_key(self) -> None:
        # go-ethereum: a log with fewer topics than the filter's positions is skipped, so [A, null] != [A].
        assert p.eth_get_logs([{"topics": [HASH, None]}], RULES)[0]["topics"] == [[HASH], None]
        assert p.eth_get_logs([{"topics": [HASH]}], RULES)[0]["topics"] == [[HASH]]

    def test_get_logs_null_inside_an_or_list_is_a_wildcard(self) -> None:
        flt = p.eth_get_logs([{"topics": [[HASH, None], HASH]}], RULES)[0]
        assert flt["topics"] == [None, [HASH]]

    def test_receipts_pending_means_latest(self) -> None:
        assert p.eth_get_block_receipts(["pending"], RULES)[0].tag == "latest"

    def test_receipts_accept_decimal_numbers_and_block_hashes(self) -> None:
        assert p.eth_get_block_receipts([17], RULES)[0].number == 17
        assert p.eth_get_block_receipts(["17"], RULES)[0].number == 17
        assert p.eth_get_block_receipts([HASH], RULES)[0].hash == HASH

    def test_solana_commitment_defaults_to_finalized(self) -> None:
        assert p.get_token_account_balance([PUBKEY], RULES) == [PUBKEY, {"commitment": "finalized"}]
        assert p.get_largest_accounts([], RULES) == [{"commitment": "finalized"}]

    def test_eth_call_input_is_an_alias_of_data(self) -> None:
        assert p.eth_call([{"from": ADDR, "input": "0xABCD"}, "latest"], RULES)[0]["data"] == "0xabcd"


class TestEvmRules:
    @pytest.mark.parametrize(
        "bad",
        [
            "0x1234",
            ADDR + "00",
            "5FbDB2315678afecb367f032d93F642f64180aa3",
            5,
            None,
            "0xZZbDB2315678afecb367f032d93F642f64180aa3",
        ],
    )
    def test_address_must_be_20_bytes_of_hex(self, bad: Any) -> None:
        rejects(p.eth_get_storage_at, [bad, "0x0", "latest"], "address")

    @pytest.mark.parametrize("bad", ["0x" + "ab" * 31, "0x" + "ab" * 33, "ab" * 32, 1])
    def test_hash_must_be_32_bytes(self, bad: Any) -> None:
        rejects(p.eth_get_uncle_by_block_hash_and_index, [bad, "0x0"], "blockHash")

    @pytest.mark.parametrize("bad", ["0x", "12", 3, "0xg", None])
    def test_index_must_be_a_hex_quantity(self, bad: Any) -> None:
        rejects(p.eth_get_uncle_by_block_hash_and_index, [HASH, bad], "index")

    @pytest.mark.parametrize("bad", ["newest", "0x", 12, "12", "0x" + "ab" * 33, {"blockNumber": "x"}, {"foo": 1}])
    def test_block_param_is_a_hex_number_a_tag_an_eip1898_object_or_a_block_hash(self, bad: Any) -> None:
        rejects(p.eth_get_storage_at, [ADDR, "0x0", bad], "block")

    def test_a_plain_32_byte_hash_names_a_state_reads_block_as_geth_reads_it(self) -> None:
        [_, _, ref] = p.eth_get_storage_at([ADDR, "0x0", HASH.upper().replace("0X", "0x")], RULES)
        assert ref.hash == HASH.lower() and not ref.object_form and ref.encode() == HASH.lower()
        rejects(p.eth_get_block_by_number, [HASH, False], "block")  # a by-number method takes none

    def test_storage_position_is_a_hex_string(self) -> None:
        for bad in ("zero", "0x", "0X", "", "x0", "0x-1", " 0x1", 1):
            rejects(p.eth_get_storage_at, [ADDR, bad, "latest"], "position")
        for bare in ("10", "a", "0b1", "0010"):  # geth reads "10" as 0x10, Anvil as 10: never one answer
            rejects(p.eth_get_storage_at, [ADDR, bare, "latest"], "write the position with 0x")
        rejects(p.eth_get_storage_at, [ADDR, "0x1" + "0" * 64, "latest"], "exceeds 32 bytes")

    @pytest.mark.parametrize(
        "written", ["0x1", "0X1", "0x01", "0X" + "0" * 63 + "1", "0x" + "0" * 63 + "1", "1", "001"]
    )
    def test_a_storage_position_is_read_with_0x_or_0X_as_geth_and_anvil_read_it(self, written: str) -> None:
        # geth and Anvil take "0X1" and "0x1" alike, and "1" (hex and decimal agree): one position, one entry.
        [_, position, _] = p.eth_get_storage_at([ADDR, written, "latest"], RULES)
        assert position == "0x" + "0" * 63 + "1"

    def test_required_params_are_named_when_missing(self) -> None:
        rejects(p.eth_get_storage_at, [ADDR], "position: missing required parameter")
        rejects(p.eth_call, [], "transaction: missing required parameter")

    def test_extra_params_are_refused(self) -> None:
        rejects(p.eth_get_storage_at, [ADDR, "0x0", "latest", 1], "at most 3 parameters")

    def test_eth_call_from_is_optional_by_default_and_required_in_strict_mode(self) -> None:
        assert p.eth_call([{"to": ADDR}, "latest"], RULES)[0] == {"to": ADDR.lower()}
        strict = p.Rules(eth_call_require_from=True)
        rejects(p.eth_call, [{"to": ADDR}, "latest"], "transaction.from: missing required field", rules=strict)

    def test_an_absent_from_and_the_zero_address_are_different_calls(self) -> None:
        absent = p.eth_call([{"to": ADDR}, "0x1"], RULES)[0]
        zero = p.eth_call([{"to": ADDR, "from": "0x" + "00" * 20}, "0x1"], RULES)[0]
        assert absent != zero and "from" not in absent

    def test_eth_call_block_defaults_to_latest_when_absent_or_null(self) -> None:
        for params in ([{"to": ADDR}], [{"to": ADDR}, None]):
            ref = p.eth_call(params, RULES)[1]
            assert ref.tag == "latest" and ref.encode() == "latest"

    def test_storage_block_is_required_as_the_spec_and_nodes_say_and_null_is_latest_as_on_anvil(self) -> None:
        rejects(p.eth_get_storage_at, [ADDR, "0x0"], "block: missing required parameter")
        assert p.eth_get_storage_at([ADDR, "0x0", None], RULES)[2].tag == "latest"

    def test_eth_call_takes_geths_blob_fields(self) -> None:
        out = p.eth_call([{"to": ADDR, "blobs": ["0x00"], "commitments": [], "proofs": []}], RULES)[0]
        assert out["blobs"] == ["0x00"]
        rejects(p.eth_call, [{"to": ADDR, "blobs": "0x00"}], "transaction.blobs: expected an array")

    def test_eth_call_takes_state_and_block_overrides(self) -> None:
        out = p.eth_call([{"to": ADDR}, "latest", None, {"time": "0x1"}], RULES)
        assert out[2:] == [None, {"time": "0x1"}]
        assert len(p.eth_call([{"to": ADDR}, "latest", None, None], RULES)) == 2
        rejects(p.eth_call, [{"to": ADDR}, "latest", None, "soon"], "blockOverrides: expected an object")

    def test_eip1898_block_number_with_require_canonical_is_accepted_as_geth_does(self) -> None:
        ref = p.eth_call([{"to": ADDR}, {"blockNumber": "0x5", "requireCanonical": True}], RULES)[1]
        assert ref.number == 5 and ref.encode() == {"blockNumber": "0x5"}

    def test_eth_call_fields_are_checked(self) -> None:
        rejects(p.eth_call, [{"from": ADDR, "gas": "lots"}, "latest"], "transaction.gas")
        rejects(p.eth_call, [{"from": ADDR, "data": "0x123"}, "latest"], "odd number")
        rejects(p.eth_call, [{"from": ADDR, "colour": "red"}, "latest"], "transaction.colour: unknown field")
        rejects(p.eth_call, [{"from": ADDR, "data": "0x12", "input": "0x34"}, "latest"], "differs from data")
        rejects(p.eth_call, ["0x12", "latest"], "transaction: expected an object")

    def test_receipts_refuse_what_is_not_a_block(self) -> None:
        rejects(p.eth_get_block_receipts, [-1], "block")
        rejects(p.eth_get_block_receipts, [1.5], "block")
        rejects(p.eth_get_block_receipts, [True], "block")

    def test_block_hash_excludes_from_and_to_block(self) -> None:
        rejects(p.eth_get_logs, [{"blockHash": HASH, "fromBlock": "0x1"}], "blockHash excludes")
        rejects(p.eth_get_logs, [{"blockHash": HASH, "toBlock": "latest"}], "blockHash excludes")

    def test_at_most_four_topic_positions(self) -> None:
        rejects(p.eth_get_logs, [{"topics": [None] * 5}], "at most 4 topic positions")

    def test_filter_fields_are_checked(self) -> None:
        rejects(p.eth_get_logs, [{"address": "0x12"}], "filter.address")
        rejects(p.eth_get_logs, [{"address": [ADDR, 5]}], "filter.address[1]")
        rejects(p.eth_get_logs, [{"topics": ["0x12"]}], "filter.topics[0]")
        rejects(p.eth_get_logs, [{"topics": "x"}], "filter.topics")
        rejects(p.eth_get_logs, [{"fromBlock": "soon"}], "filter.fromBlock")
        rejects(p.eth_get_logs, [{"limit": 5}], "filter.limit: unknown field")
        rejects(p.eth_get_logs, [[]], "filter: expected an object")

    def test_more_than_5000_addresses_and_topics_is_refused_before_upstream(self) -> None:
        addresses = ["0x" + format(i, "040x") for i in range(4999)]
        p.eth_get_logs([{"address": addresses, "topics": [HASH]}], RULES)  # 5000: allowed
        rejects(
            p.eth_get_logs,
            [{"address": addresses, "topics": [[HASH, "0x" + "01" * 32]]}],
            "5001 parameters",
            code=LIMIT_EXCEEDED,
        )

    def test_every_given_address_and_topic_counts_toward_5000_before_dedupe(self) -> None:
        """spec (Limits): at most 5,000 parameters in one request: values given, repeats and other
        spellings of one value included; the canonical filter is still the sorted set."""
        method, mixed = p.eth_get_logs, [ADDR if i % 2 else ADDR.lower() for i in range(5001)]
        rejects(method, [{"address": mixed}], "5001 parameters", code=LIMIT_EXCEEDED)
        rejects(method, [{"topics": [[HASH] * 5001]}], "5001 parameters", code=LIMIT_EXCEEDED)
        rejects(method, [{"address": mixed[:2500], "topics": [HASH, [HASH] * 2500]}], "5001", code=LIMIT_EXCEEDED)
        [canonical] = method([{"address": mixed[:5000]}], RULES)
        assert canonical["address"] == [ADDR.lower()]


class TestSolanaRules:
    @pytest.mark.parametrize("bad", ["short", "0OIl" * 11, PUBKEY + "1", 123, "1" * 44])
    def test_address_is_a_base58_32_byte_key(self, bad: Any) -> None:
        rejects(p.get_token_account_balance, [bad], "address")

    def test_commitment_is_finalized_confirmed_or_processed(self) -> None:
        rejects(p.get_token_account_balance, [PUBKEY, {"commitment": "max"}], "config.commitment")
        assert p.get_token_account_balance([PUBKEY, {"commitment": "processed"}], RULES)[1] == {
            "commitment": "processed"
        }

    def test_filter_is_circulating_or_non_circulating(self) -> None:
        rejects(p.get_largest_accounts, [{"filter": "all"}], "config.filter")
        assert p.get_largest_accounts([{"filter": "nonCirculating"}], RULES)[0]["filter"] == "nonCirculating"

    def test_sort_results_is_agaves_boolean_kept_as_given(self) -> None:
        """Rule (docs/interface.md, getLargestAccounts): newer Agave's `sortResults` is taken (it was
        refused as an unknown field) and kept in the key as given, a sorted and an unsorted list apart."""
        assert p.get_largest_accounts([{"sortResults": False}], RULES)[0] == {
            "commitment": "finalized",
            "sortResults": False,
        }
        assert p.get_largest_accounts([{"sortResults": None}], RULES)[0] == {"commitment": "finalized"}
        rejects(p.get_largest_accounts, [{"sortResults": "no"}], "config.sortResults")
        rejects(p.get_largest_accounts, [{"sortResults": 0}], "config.sortResults")

    def test_encodings_are_agaves_for_accounts_and_for_transactions_apart(self) -> None:
        # One list let an account be asked in `json` and a block in base64+zstd; `binary` was refused.
        assert p.solana_account([PUBKEY, {"encoding": "binary"}], RULES)[1]["encoding"] == "binary"
        rejects(p.solana_account, [PUBKEY, {"encoding": "json"}], "config.encoding")
        assert p.get_block([5, {"encoding": "json"}], RULES)[1]["encoding"] == "json"
        rejects(p.get_block, [5, {"encoding": "base64+zstd"}], "config.encoding")

    def test_a_block_or_transaction_config_written_as_its_encoding_alone_is_agaves_deprecated_form(self) -> None:
        assert p.get_block([5, "base64"], RULES) == p.get_block([5, {"encoding": "base64"}], RULES)
        assert p.get_transaction([SIGNATURE, "json"], RULES)[1] == {"commitment": "finalized", "encoding": "json"}
        rejects(p.get_block, [5, "base64+zstd"], "config.encoding")

    def test_unknown_config_fields_are_refused(self) -> None:
        rejects(p.get_largest_accounts, [{"encoding": "base64"}], "config.encoding: unknown field")
        rejects(p.get_token_account_balance, [PUBKEY, {"filter": "circulating"}], "config.filter: unknown field")
