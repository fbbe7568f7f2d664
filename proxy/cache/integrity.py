"""Integrity before "forever" (per network in NETWORKS_FILE, off by default): an answer about to be
kept forever can be confirmed first, at an upstream cost README "Upstreams" states.

- `confirm_immutable = N` (2 or more): N-1 other upstreams that vouch for the answer's block are
  asked the same call; the answer is kept only when all N agree (as parsed JSON: nodes order fields
  differently). A disagreement is settled by asking further upstreams until N agree on one answer,
  which is served, uncached (a disputed answer is never kept); with no N in agreement, the majority's
  (the first one's on a tie). Either way it is logged, and each upstream outside the answer served
  is counted (rpc_proxy_upstream_disagreements_total). Too few upstreams to ask: served uncached.
  An answer proven against its block's header (verifying.py) is not put to a vote: a proof beats it.
- `confirm_logs_bloom = true`: an eth_getLogs answer over final blocks is checked against their
  headers' logsBloom, read from the cache tiers where they are (a final header never changes) and
  else from the node (then kept forever, proven as the service proves a final block). Every log
  must be in its block's bloom (else it was made up); a block whose bloom matches the filter but
  holds no log of the answer is asked for its receipts, and a matching log there means the answer
  left it out. Either way the answer is not kept and the upstream that gave it is counted. A range
  of more than BLOOM_MAX_BLOCKS blocks, or with more than BLOOM_MAX_SUSPECTS such blocks, cannot
  be checked at a bounded cost: served uncached.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from proxy.cache import log_chunks
from proxy.cache import policy as cp
from proxy.cache.planning import final_block_key, key_space
from proxy.cache.tiers import TieredCache
from proxy.chain import bloom
from proxy.chain.head_polls import Head
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.rpc.jsonrpc import JsonRpcError, dumps_canonical, loads
from proxy.values import Answer, Plan

log = logging.getLogger("proxy.integrity")
BLOOM_MAX_BLOCKS = 2000  # headers asked to check one answer (a chunk of the default 1000 fits)
BLOOM_MAX_SUSPECTS = 32  # blocks whose receipts are asked to check one answer


class Integrity:
    def __init__(self, metrics: Metrics, timeout: float, cache: TieredCache) -> None:
        self._metrics = metrics
        self._timeout = timeout
        self._cache = cache

    @staticmethod
    def checks(net: NetworkRuntime) -> bool:
        """Whether `doubt` may find anything on this network (confirmations or a logs bloom asked)."""
        config = net.config
        return net.per_upstream is not None and (config.confirm_logs_bloom or config.confirm_immutable >= 2)

    async def doubt(self, net: NetworkRuntime, plan: Plan, params: Any, answer: Answer) -> tuple[str | None, Answer]:
        """Why an answer about to be kept forever must not be (None: keep it), and the answer to serve."""
        config = net.config
        if not self.checks(net) or answer.upstream < 0 or answer.is_error:
            return None, answer
        if config.confirm_logs_bloom and plan.method == "eth_getLogs" and isinstance(answer.result, list):
            reason = await self._logs_bloom(net, plan.head, params[0], plan.forward[0], answer)
            if reason is not None:
                return reason, answer
        if config.confirm_immutable >= 2:
            return await self._confirm(net, plan, answer, config.confirm_immutable)
        return None, answer

    async def _headers(self, net: NetworkRuntime, head: Head | None, numbers: range) -> dict[int, dict[str, Any]]:
        """The final blocks' headers: from the cache tiers where they are (a final block is immutable),
        the rest from the node in one batch, kept forever when the node that gave them showed in the
        same batch that it is on the network's chain (the network's finalized block: its hash)."""
        space = key_space(net, head)
        keys = {n: final_block_key(space, n) for n in numbers} if space is not None else {}
        found = await self._cache.get_many(list(keys.values())) if keys else {}
        headers: dict[int, dict[str, Any]] = {}
        for n, key in keys.items():
            stored = found.get(key)
            header = loads(stored[0]) if stored is not None and not stored[1] else None
            if isinstance(header, dict):
                headers[n] = header
        missing = [n for n in numbers if n not in headers]
        if not missing:
            return headers
        calls: list[tuple[str, Any]] = [("eth_getBlockByNumber", [hex(n), False]) for n in missing]
        if head is not None and head.final_hash:
            calls.append(("eth_getBlockByNumber", [hex(head.finalized), False]))
        answers = await net.upstream.together(calls)
        proof = answers[-1] if answers is not None and len(answers) > len(missing) else None
        if answers is None:  # a node that refuses batches: each asked alone, so none shows another's chain
            answers = await net.upstream.batch(calls)
        on_chain = (
            proof is not None
            and isinstance(proof.result, dict)
            and head is not None
            and str(proof.result.get("hash", "")).lower() == head.final_hash
        )
        for n, answer in zip(missing, answers, strict=False):
            if not isinstance(answer.result, dict):
                continue
            headers[n] = answer.result
            if (
                on_chain
                and proof is not None
                and answer.upstream == proof.upstream
                and head is not None
                and n <= head.finalized
                and n in keys
            ):
                await self._cache.set(keys[n], (answer.payload, False), cp.FOREVER)
        return headers

    def _disagreed(self, net: NetworkRuntime, index: int) -> None:
        self._metrics.upstreams.disagreements.labels(net.name, str(index)).inc()

    async def _confirm(self, net: NetworkRuntime, plan: Plan, answer: Answer, count: int) -> tuple[str | None, Answer]:
        per = net.per_upstream
        assert per is not None
        others = [
            i
            for i in range(per.states.size)
            if i != answer.upstream and per.states.in_rotation(i) and per.states.vouches(i, plan.need)
        ]
        answers = [answer]
        forms: list[bytes] = [_form(answer)]
        for index in others:
            # N-1 others first; on a disagreement, further upstreams until N agree on one answer.
            if len(answers) >= count and (len(set(forms)) == 1 or Counter(forms).most_common(1)[0][1] >= count):
                break
            try:
                other = await per.ask(index, plan.method, plan.forward, timeout=self._timeout)
            except JsonRpcError:
                continue
            answers.append(other)
            forms.append(_form(other))
        tally = Counter(forms)
        if len(tally) == 1:
            return (None if len(answers) >= count else "unconfirmed"), answer
        majority, votes = tally.most_common(1)[0]
        if votes < count and list(tally.values()).count(votes) > 1:
            majority = forms[0]  # a tie no further upstream broke: the first answer, as without confirmation
        for form, other in zip(forms, answers, strict=True):
            if form != majority:
                self._disagreed(net, other.upstream)
        log.warning(
            "network %s: upstreams disagree on %s at block %s: served uncached", net.name, plan.method, plan.need
        )
        return "disagreement", answers[forms.index(majority)]

    async def _logs_bloom(
        self,
        net: NetworkRuntime,
        head: Head | None,
        log_filter: dict[str, Any],
        forward: dict[str, Any],
        answer: Answer,
    ) -> str | None:
        try:
            first, last = int(forward["fromBlock"], 16), int(forward["toBlock"], 16)
        except (KeyError, TypeError, ValueError):
            return "unchecked"  # a blockHash filter: final answers by hash are checked by their own proof
        if last - first + 1 > BLOOM_MAX_BLOCKS:
            return "unchecked"
        try:
            headers = await self._headers(net, head, range(first, last + 1))
        except JsonRpcError:
            return "unchecked"
        blooms = {n: b for n, h in headers.items() if (b := bloom.parse(h.get("logsBloom"))) is not None}
        if len(blooms) != last - first + 1:
            return "unchecked"
        logs = answer.result
        assert isinstance(logs, list)
        if not bloom.logs_in_blooms(logs, blooms):
            self._disagreed(net, answer.upstream)
            return "bloom_mismatch"
        with_logs = {int(e["blockNumber"], 16) for e in logs}
        bits = bloom.FilterBits(log_filter.get("address"), log_filter.get("topics"))
        if bits.cost * len(blooms) > bloom.MASK_CHECKS_MAX:
            return "unchecked"
        suspects = [n for n, b in blooms.items() if n not in with_logs and bits.may_match(b)]
        if len(suspects) > BLOOM_MAX_SUSPECTS:
            return "unchecked"
        if not suspects:
            return None
        try:
            receipts = await net.upstream.batch([("eth_getBlockReceipts", [hex(n)]) for n in suspects])
        except JsonRpcError:
            return "unchecked"
        found = log_chunks.logs_from_receipts([r.result for r in receipts], log_filter)
        if found is None:
            return "unchecked"
        if found:
            self._disagreed(net, answer.upstream)
            log.warning(
                "network %s: upstream #%d left logs out of eth_getLogs (blocks %s): not kept",
                net.name,
                answer.upstream,
                ", ".join(str(n) for n in suspects[:5]),
            )
            return "logs_missing"
        return None


def _form(answer: Answer) -> bytes:
    """An answer as compared with others' (parsed JSON, keys sorted: nodes order fields differently)."""
    return dumps_canonical(answer.result if not answer.is_error else {"error": answer.error})
