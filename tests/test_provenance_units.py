"""Pure decisions that tie answers to their blocks: pinning, upstream states, chain identity."""

from __future__ import annotations

from proxy.chain import pinning
from proxy.chain.head_polls import Head, Resolved
from proxy.chain.identity import judge, parse_identity
from proxy.rpc.params import BlockRef
from proxy.upstream.standing import ChainIdentity, UpstreamStates

H = "0x" + "ab" * 32
A = ChainIdentity(31337, "0x" + "11" * 32)
B = ChainIdentity(999, "0x" + "22" * 32)


class TestPinning:
    def test_an_unfinalized_block_goes_upstream_by_its_hash_where_the_position_takes_one(self) -> None:
        resolved = Resolved(10, H)
        assert pinning.forward_form(BlockRef(tag="latest", hash_form="object"), resolved, True) == {"blockHash": H}
        assert pinning.forward_form(BlockRef(number=10, hash_form="plain"), resolved, True) == H
        assert pinning.forward_form(BlockRef(number=10), resolved, True) == "0xa"  # a getLogs bound
        assert pinning.forward_form(BlockRef(tag="latest", hash_form="object"), resolved, False) == "0xa"

    def test_the_block_an_answer_depends_on_is_its_highest_number(self) -> None:
        assert pinning.needed_block([Resolved(3, None), Resolved(9, H), None], [], {}) == 9
        assert pinning.needed_block([Resolved(None, H)], [H], {}) is None
        assert pinning.needed_block([Resolved(None, H)], [H], {H: 12}) == 12  # a hash the tracker places

    def test_a_tag_forwarded_as_a_tag_needs_the_block_it_stood_for_at_the_last_head(self) -> None:
        head = Head(latest=100, safe=68, finalized=36, latest_hash=H, gas_limit=1, timestamp=0, stale=True)
        assert pinning.tag_floor(["latest"], head) == 100
        assert pinning.tag_floor(["finalized", "safe"], head) == 68
        assert pinning.tag_floor(["earliest"], head) == 0
        assert pinning.tag_floor([], head) is None and pinning.tag_floor(["latest"], None) is None

    def test_logs_must_carry_the_hash_the_tracker_holds_for_their_block(self) -> None:
        log = {"blockNumber": "0xa", "blockHash": H}
        assert pinning.logs_on_chain([log], {10: H})
        assert not pinning.logs_on_chain([log], {10: "0x" + "cd" * 32})
        assert pinning.logs_on_chain([log], {})  # final blocks: nothing to compare
        assert not pinning.logs_on_chain({"not": "a list"}, {})

    def test_forwarded_answers_that_show_a_block(self) -> None:
        assert pinning.shown_block("eth_blockNumber", "0x10") == 16
        assert pinning.shown_block("eth_getTransactionReceipt", {"blockNumber": "0x5"}) == 5
        assert pinning.shown_block("eth_getBlockByNumber", {"number": "0x7"}) == 7
        assert pinning.shown_block("eth_getTransactionByHash", {"blockNumber": None}) is None
        assert pinning.shown_block("eth_gasPrice", "0x10") is None


class TestUpstreamStates:
    def test_an_upstream_vouches_only_when_verified_and_its_head_has_the_block(self) -> None:
        states = UpstreamStates(2)
        states.observe_head(0, 100)
        assert not states.vouches(0, 50)  # not verified yet
        states.judged(0, True)
        assert states.vouches(0, 100) and not states.vouches(0, 101) and states.vouches(0, None)
        assert not states.vouches(-1, None)  # an answer of unknown origin

    def test_another_upstream_is_the_one_furthest_ahead_that_has_the_block(self) -> None:
        states = UpstreamStates(3)
        for index, head in enumerate((120, 200, 150)):
            states.observe_head(index, head)
            states.judged(index, True)
        assert states.other_with(0, 130) == 1
        assert states.other_with(1, 130) == 2
        assert states.other_with(0, 300) is None

    def test_the_upstream_the_head_is_taken_from_is_parted_from_it_nowhere(self) -> None:
        """Rule (docs/caching.md, a backup on another fork): a mark set while the head was a backup's
        (its first poll reached a backup on a fork the network left) never keeps the node the head
        then follows from the reads the backup is refuted for (a clean-clone CI run: 502 for block
        106 of the network's chain, one start in five)."""
        states = UpstreamStates(2)
        for index, head in enumerate((111, 106)):
            states.observe_head(index, head)
            states.judged(index, True)
        states.parted[0] = 101  # seen ahead of the backup's head, on another fork
        assert states.other_with(1, 106) is None
        states.followed(0, 40)
        assert states.other_with(1, 106) == 0 and states.final_mark == 40

    def test_a_lost_connection_takes_a_verified_upstream_out_of_rotation_until_checked(self) -> None:
        states = UpstreamStates(1)
        states.lost(0)
        assert states.in_rotation(0)  # never verified: in rotation, answers uncached
        states.judged(0, True)
        states.lost(0)
        assert not states.in_rotation(0) and states.suspect.is_set()
        states.judged(0, True)
        assert states.in_rotation(0)


class TestIdentity:
    def test_the_first_identity_seen_is_the_networks(self) -> None:
        assert judge(None, None, A) == (A, True)
        assert judge(A, None, B) == (A, False)

    def test_a_declared_chain_id_refuses_another_chain_even_first(self) -> None:
        assert judge(None, 999, A) == (None, False)
        assert judge(None, 999, B) == (B, True)

    def test_identity_answers_are_parsed_or_ignored(self) -> None:
        assert parse_identity("0x7a69", {"hash": "0x" + "11" * 32}) == A
        assert parse_identity("0x7a69", None) is None
        assert parse_identity("nonsense", {"hash": "0x"}) is None

    def test_the_key_space_names_chain_id_and_genesis(self) -> None:
        assert A.key_space() == "31337:" + "11" * 8
