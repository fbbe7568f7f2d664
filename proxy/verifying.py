"""Verified answers: an answer about a final block is kept forever only when proven against the
block's header (per network, NETWORKS_FILE `verify`; the proofs per method: chain/answer_proofs.py,
the headers believed: chain/header_chain.py).

- `auto` (the default): a provable answer is kept forever only when proven; an answer no proof
  covers (eth_call, Solana's) is kept as without verification, marked not-applicable;
- `required`: nothing unproven is kept forever (kept for the unfinalized TTL instead), and a call no
  upstream gives a proven answer to fails (-32002, naming why);
- `off`: answers are kept as the node gave them.

An answer its proofs refute is never kept: its upstream cools down and is counted
(rpc_proxy_verifications_total{outcome="refuted"}, a log line naming it by index), and the call goes
to the next upstream; the first proven answer is served. When none is proven, `auto` serves the first
answer uncached.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from typing import Any

from proxy.cache import log_chunks
from proxy.chain import answer_proofs as ap
from proxy.chain import bloom
from proxy.chain.head_polls import Head
from proxy.chain.header_chain import HeaderChain, Proven, Unverifiable
from proxy.chain.headers import HeaderError, verify_header
from proxy.chain.heads import EvmHeadTracker
from proxy.logs import Throttled
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.rpc.jsonrpc import UPSTREAM_UNAVAILABLE, JsonRpcError
from proxy.rpc.methods import metric_label
from proxy.upstream.pool import http_pool
from proxy.upstream.sending import too_large
from proxy.values import FOREVER, Answer, Plan

log = logging.getLogger("proxy.verify")

PROVEN, UNPROVEN, REFUTED, NOT_APPLICABLE, OFF = "proven", "unproven", "refuted", "not-applicable", "off"
# Kept as without verification, told unproven: an answer about no block the proxy can tell, or about
# block 0 and unproven (a dev node's genesis stateRoot is not its state's). An answer by the hash of
# a block above finality is proven against the header that hash names (no final block vouches for
# it, and none need: the hash names that content alone), else served uncached.
UNFINAL = "unfinal"
# A proof past its budget (an eth_getLogs range of too many blocks to check): kept as without
# verification (told unproven) under auto, as an answer no proof covers; nothing unproven is kept
# forever under required.
UNCHECKED = "unchecked"
LOGS_MAX_BLOCKS = 2000  # headers read to check one eth_getLogs answer (a chunk of the default 1000 fits)
LOGS_MAX_CHECKED = 32  # blocks whose receipts are asked to check one eth_getLogs answer
LOGS_SUSPECTS = 4  # past that, blocks whose bloom may match and that show no log, checked at random
BLOOMS_PER_TURN = 100  # blooms checked against a filter in one turn of the event loop


class Verifier:
    def __init__(self, metrics: Metrics, timeout: float) -> None:
        self._metrics = metrics
        self._timeout = timeout
        # Per network: the upstream pool and the key space (its epoch) the header chain was begun under.
        self._chains: dict[str, tuple[object, str | None, HeaderChain]] = {}
        self._throttled = Throttled(log)  # a lying node fails every proof: one line per interval says so

    def chain(self, net: NetworkRuntime) -> HeaderChain:
        """The network's header chain: a new one when a reload gave the network new upstreams, or when
        the tracker moved to a new epoch (a reorg below finality, a dev node's state changed): the
        hashes held are the old chain's, against which the new chain's true answers would be refuted
        and its final blocks never proven again."""
        head = net.tracker.head
        space = head.space if isinstance(head, Head) else None
        held = self._chains.get(net.name)
        if held is not None and held[0] is net.upstream and (held[1] is None or space is None or held[1] == space):
            if held[1] is None and space is not None:
                self._chains[net.name] = (net.upstream, space, held[2])
            return held[2]
        config = net.config
        gauge = self._metrics.unverifiable.labels(net.name)
        gauge.set(0)
        chain = HeaderChain(
            net.name,
            net.upstream,
            net.per_upstream,
            quorum=config.checkpoint_quorum,
            trusted=config.trusted_checkpoint,
            timeout=self._timeout,
            on_unverifiable=lambda _why: gauge.set(1),
        )
        self._chains[net.name] = (net.upstream, space, chain)
        return chain

    def unverifiable(self, name: str) -> str | None:
        """Why network `name`'s answers cannot be proven (for /readyz), or None."""
        held = self._chains.get(name)
        return held[2].unverifiable if held is not None else None

    @staticmethod
    def applies(net: NetworkRuntime, method: str) -> bool:
        return net.config.verify != OFF and net.config.family == "evm" and method in ap.PROVABLE

    @staticmethod
    def proves_null(net: NetworkRuntime, method: str) -> bool:
        """A null of this method about a final block is proven like any answer (then kept forever)."""
        return Verifier.applies(net, method) and method in ap.NULL_PROVABLE

    async def settle(self, net: NetworkRuntime, plan: Plan, answer: Answer) -> tuple[str, Answer]:
        """For an answer about to be kept forever: its verdict (proven, unproven, not-applicable, off)
        and the answer to serve (a proven one from another upstream when this one's was refuted)."""
        if net.config.verify == OFF:
            return OFF, answer
        if not self.applies(net, plan.method):
            return NOT_APPLICABLE, answer
        number, asked = await self._block_number(net, plan, answer)
        head = net.tracker.head
        final = isinstance(head, Head) and bool(head.final_hash) and number is not None and number <= head.finalized
        # Above finality, an answer by a block's hash is proven against the header that hashes to it
        # (no final block vouches for it, and none need: the hash names that content alone).
        pinned = None if final else ap.named_hash(plan.method, plan.forward)
        if number is None or (not final and pinned is None):
            return (UNFINAL if pinned is None else UNPROVEN), answer
        if number == 0 and not asked and plan.method in ap.STATE:
            # A dev node (Anvil) does not commit its genesis state to the genesis stateRoot: the state
            # of block 0, named by its number, is kept as without verification and told unproven. A
            # hash the node says is block 0's is proven as any other (its header must have that hash).
            return UNFINAL, answer
        first, tried, refuted = answer, {answer.upstream}, False
        per = net.per_upstream
        while True:
            outcome = await self._prove(net, plan, answer, number, pinned)
            if outcome == UNCHECKED:
                self._metrics.child(self._metrics.verifications, net.name, metric_label(plan.method), outcome).inc()
                # Kept as without verification (required: for a short TTL); above finality, uncached.
                return (UNFINAL if pinned is None else UNPROVEN), answer
            self._metrics.child(self._metrics.verifications, net.name, metric_label(plan.method), outcome).inc()
            if outcome == PROVEN:
                # Block 0's answers are told unproven, on the miss as on every hit: releases before
                # this one kept them unproven (refuted ones too) under the same keys, so a hit about
                # block 0 cannot tell a proven entry from those (stored_as).
                return (UNFINAL if number == 0 else PROVEN), answer
            if outcome == REFUTED:
                refuted = True
                self._refuted(net, plan.method, answer.upstream)
            nxt = _next_upstream(net, plan, tried) if outcome == REFUTED and per is not None else None
            while nxt is not None and per is not None:
                tried.add(nxt)
                try:
                    answer = await per.ask(nxt, plan.method, plan.forward, timeout=self._timeout)
                    break
                except JsonRpcError:
                    nxt = _next_upstream(net, plan, tried)
            if nxt is None:
                break
        if pinned is not None and not refuted:
            return UNPROVEN, first  # neither proven nor refuted: served uncached (required too: not final)
        if net.config.verify == "required":
            why = "every upstream's answer was refuted by its proofs" if refuted else "no proof could be had"
            raise JsonRpcError(
                UPSTREAM_UNAVAILABLE,
                f"upstream unavailable: network '{net.name}' (no proven answer for {plan.method}: {why})",
                http_status=502,
            )
        return (REFUTED if refuted else UNPROVEN), first

    def _refuted(self, net: NetworkRuntime, method: str, index: int) -> None:
        pool = http_pool(net.upstream)
        if pool is not None:
            pool.cool_down(index)
        self._throttled.warning(
            f"{net.name}#{index}",
            "network %s: upstream #%d gave a %s answer its block's proofs refute",
            net.name,
            index,
            method,
        )

    async def _block_number(self, net: NetworkRuntime, plan: Plan, answer: Answer) -> tuple[int | None, bool]:
        """The block the answer is about: by its number, else the plan's; for a hash outside the
        tracker's window, the number the answering node gives that hash (its header is then proven
        to have that hash at that height, or nothing is), with True: the node's word, not the call's."""
        if plan.method == "eth_getLogs":
            log_filter = plan.forward[0] if isinstance(plan.forward[0], dict) else {}
            last, named = log_filter.get("toBlock"), log_filter.get("blockHash")
            block: int | str | None = int(last, 16) if isinstance(last, str) and last.startswith("0x") else named
        else:
            block = ap.answer_block(plan.method, plan.forward, answer.result)
        if isinstance(block, int) or plan.need is not None:
            return (block if isinstance(block, int) else plan.need), False
        if not isinstance(block, str) or answer.upstream < 0:
            return None, False
        found = await self._extras(net, answer.upstream, [("eth_getBlockByHash", [block, False])])
        item = found[0] if found else None
        number = item.get("number") if isinstance(item, dict) else None
        try:
            return (int(number, 16) if isinstance(number, str) else None), True
        except ValueError:
            return None, True

    async def _prove(self, net: NetworkRuntime, plan: Plan, answer: Answer, number: int, pinned: str | None) -> str:
        """`pinned`: the hash of a block above finality the call names (its header and the proof's
        calls are asked by that hash); None: a final block, whose header the header chain holds."""
        if answer.is_error or answer.upstream < 0:
            return UNPROVEN
        head = net.tracker.head
        head = head if isinstance(head, Head) else None
        chain = self.chain(net)
        try:
            if plan.method == "eth_getLogs":
                return await self._prove_logs(net, chain, head, plan, answer, number, pinned)
            block = ap.answer_block(plan.method, plan.forward, answer.result)
            # Above finality the header comes after the proof's calls: a full block among them is its own.
            header = None if pinned is not None else (await chain.header(number, head))[0]
            if header is not None and isinstance(block, str) and header.hash.hex() != block[2:]:
                return UNPROVEN  # a hash the chain does not hold at the block the plan names
            calls = ap.extra_calls(plan.method, plan.forward, answer.result, number)
            if pinned is not None:
                calls = ap.by_hash(calls, number, pinned)
            rode = answer.state_proof  # asked beside the read, of the same node (pool.py)
            if rode is not None and len(calls) == 1 and rode[0] == calls[0]:
                extras: list[Any] | None = [rode[1]]
            else:
                extras = await self._extras(net, answer.upstream, calls)
            if extras is None:
                return UNPROVEN
            if header is None:  # pinned: a block above finality
                header = (await self._pinned(net, answer, plan.method, pinned or "", extras))[0]
            more = await self._extras(net, answer.upstream, ap.follow_up_calls(plan.method, plan.forward, extras))
            if more is None:
                return UNPROVEN
            identity = net.tracker.identity if isinstance(net.tracker, EvmHeadTracker) else None
            ap.prove(plan.method, plan.forward, answer.result, header, [*extras, *more], identity)
        except (Unverifiable, ap.Unprovable):
            return UNPROVEN
        except ap.AnswerError:
            return REFUTED
        return PROVEN

    async def _pinned(
        self, net: NetworkRuntime, answer: Answer, method: str, block_hash: str, extras: Sequence[Any] = ()
    ) -> Proven:
        """The header of the block a hash names: one whose fields hash to it, so true whichever node
        gives it (a block answer's own, or a block among the proof's `extras`, else the answering
        node's, asked). AnswerError when the node's header for that hash is not one; Unprovable when
        it has none, or a field the proxy does not know."""
        given = [answer.result] if method in ap.BLOCKS else []
        found = [b for b in (*given, *extras) if isinstance(b, dict) and str(b.get("hash")).lower() == block_hash]
        if not found:
            found = await self._extras(net, answer.upstream, [("eth_getBlockByHash", [block_hash, False])]) or []
        block = found[0] if found else None
        if not isinstance(block, dict):
            raise ap.Unprovable("no header for the block's hash")
        try:
            header = verify_header(block)
        except HeaderError as exc:
            if str(exc).startswith("unknown header field"):
                raise ap.Unprovable(str(exc)) from exc
            raise ap.AnswerError(str(exc)) from exc
        if "0x" + header.hash.hex() != block_hash:
            raise ap.AnswerError("the header is not the one its hash names")
        return header, block

    async def _prove_logs(
        self,
        net: NetworkRuntime,
        chain: HeaderChain,
        head: Head | None,
        plan: Plan,
        answer: Answer,
        number: int,
        pinned: str | None,
    ) -> str:
        """Every log returned is in its block's proven receipts; with verify_logs = "complete", none
        is missing from a block whose logsBloom may match the filter."""
        log_filter = plan.forward[0]
        named = log_filter.get("blockHash")
        # By hash: the block the hash names, whose header must have that hash.
        numbered = (number, number) if isinstance(named, str) else _range_of(log_filter)
        if numbered is None:
            return UNPROVEN
        first, last = numbered
        if last - first + 1 > LOGS_MAX_BLOCKS:
            return UNCHECKED
        shown = ap.logs_by_block(answer.result)
        if any(not first <= n <= last for n in shown):
            return REFUTED
        complete = net.config.verify_logs == "complete"
        numbers = list(range(first, last + 1)) if complete or isinstance(named, str) else sorted(shown)
        if complete:  # every block's bloom is checked against the filter's values, each hashed once
            bits = bloom.FilterBits(log_filter.get("address"), log_filter.get("topics"))
            if bits.cost * len(numbers) > bloom.MASK_CHECKS_MAX:
                return UNCHECKED  # a filter of thousands of values over a chunk: as a range of too many blocks
        headers = (
            {number: await self._pinned(net, answer, plan.method, pinned)}
            if pinned
            else await chain.headers(numbers, head)
        )
        if isinstance(named, str) and "0x" + headers[first][0].hash.hex() != named.lower():
            return UNPROVEN  # the hash is not the chain's block at that height
        checked = set(shown)
        if complete:
            for i, (n, (_header, fields)) in enumerate(headers.items(), 1):
                filled = bloom.parse(fields.get("logsBloom"))
                if filled is None or bits.may_match(filled):
                    checked.add(n)
                if i % BLOOMS_PER_TURN == 0:
                    await asyncio.sleep(0)  # a filter of thousands of values: other calls go on between
        unchecked = len(checked) > LOGS_MAX_CHECKED
        # Past the receipts one answer may cost, LOGS_SUSPECTS blocks whose bloom may match and that
        # show no log are checked, drawn at random (a liar cannot tell which): a pruned node's `[]`, a
        # node that dropped logs. None refuted: unchecked, as before. A few, as full blooms (mainnet's)
        # match most blocks, and each costs a full block and its receipts.
        suspects = sorted(checked.difference(shown))
        order = sorted(random.sample(suspects, min(len(suspects), LOGS_SUSPECTS))) if unchecked else sorted(checked)
        if not order and unchecked:
            return UNCHECKED
        calls = [
            c for n in order for c in (("eth_getBlockByNumber", [hex(n), True]), ("eth_getBlockReceipts", [hex(n)]))
        ]
        if pinned is not None:
            calls = ap.by_hash(calls, number, pinned)
        extras = await self._extras(net, answer.upstream, calls)
        if extras is None:
            return UNPROVEN
        for i, n in enumerate(order):
            full, receipts = extras[2 * i], extras[2 * i + 1]
            ap.prove_receipts(full, receipts, headers[n][0])
            expected = log_chunks.logs_from_receipts([receipts], log_filter)
            if expected is None:
                return UNPROVEN
            ap.prove_block_logs(shown.get(n, []), expected, complete=complete)
        return UNCHECKED if unchecked else PROVEN

    async def _extras(self, net: NetworkRuntime, index: int, calls: list[ap.Call]) -> list[Any] | None:
        """The answers of the calls that prove an answer, asked of the node that gave it (None when
        any failed: nothing to prove it with)."""
        if not calls:
            return []
        per = net.per_upstream
        try:
            if per is not None and len(calls) == 1:  # the usual proof (eth_getProof): no task of its own
                answers = [await per.ask(index, calls[0][0], calls[0][1], timeout=self._timeout)]
            elif per is not None:  # one batch: one more call to the node, whatever the proof needs
                try:
                    answers = await per.ask_all(index, calls, timeout=self._timeout)
                except JsonRpcError as error:
                    if too_large(error):
                        raise  # every part asked alone would be sent again: nothing to prove it with
                    # A node that takes no batches: each part asked of it alone.
                    answers = await asyncio.gather(*(per.ask(index, m, p, timeout=self._timeout) for m, p in calls))
            else:
                answers = await net.upstream.batch(calls)
        except JsonRpcError:
            return None
        if any(a.is_error for a in answers):
            return None
        return [a.result for a in answers]


def shown_as(net: NetworkRuntime, method: str, verdict: str) -> str:
    """X-Verified for a verdict: proven, not-applicable (no proof covers the method), else unproven."""
    if verdict == PROVEN:
        return "proven"
    if verdict == NOT_APPLICABLE or net.config.family != "evm" or method not in ap.PROVABLE:
        return "not-applicable"
    return "unproven"


def stored_as(net: NetworkRuntime, plan: Plan) -> str:
    """X-Verified for an answer found in the cache: proven when it is one kept forever about a final
    block under verification (nothing else is kept so: settle()); an answer by hash is told unproven
    (it may have been kept before its block was final)."""
    method = plan.method
    if net.config.family != "evm" or method not in ap.PROVABLE:
        return "not-applicable"
    head = net.tracker.head
    decision = plan.decision
    if net.config.verify == OFF or plan.by_hash or decision.tied_to_answer or decision.ttl != FOREVER:
        return "unproven"  # a transaction or receipt may have been kept for a while before its block was final
    if method == "eth_getLogs":
        numbered = _range_of(plan.forward[0])
        if numbered is None or numbered[1] - numbered[0] >= LOGS_MAX_CHECKED:
            # Kept unchecked when more of its blocks than LOGS_MAX_CHECKED have logs, or blooms that
            # may match (settle()); a range no wider is always checked whole.
            return "unproven"
    number = plan.need
    final = isinstance(head, Head) and bool(head.final_hash) and number is not None and 0 < number <= head.finalized
    return "proven" if final else "unproven"  # block 0: told unproven (settle)


def _range_of(log_filter: Any) -> tuple[int, int] | None:
    """An eth_getLogs filter's numbered range (fromBlock, toBlock); None when it names none."""
    try:
        return int(log_filter["fromBlock"], 16), int(log_filter["toBlock"], 16)
    except (KeyError, TypeError, ValueError):
        return None


def _next_upstream(net: NetworkRuntime, plan: Plan, tried: set[int]) -> int | None:
    """An upstream not yet asked that vouches for the block the answer needs."""
    per = net.per_upstream
    if per is None:
        return None
    states = per.states
    for index in range(states.size):
        if index not in tried and states.in_rotation(index) and states.vouches(index, plan.need):
            return index
    return None
