"""Node-side filters (eth_newFilter and friends), owned by the key that made them and bounded.

The proxy issues its own filter ids, so an id means nothing to another key ("filter not found", as
geth says of an unknown id), and counts each key's live filters (MAX_FILTERS_PER_KEY). An id is the
node's id behind an HMAC of the key's name and that id, keyed by a digest of every configured API key:
another worker or replica with the same keys reads it without shared state, and no tenant can forge
one for another key. eth_newFilter's criteria pass eth_getLogs' validator (GETLOGS_MAX_PARAMS);
eth_getFilterLogs is eth_getLogs over the filter's criteria, served by the read-through flow with
its limits, cache and chunks; eth_getFilterChanges is the node's, under eth_getLogs' time and
result limits. A filter the client has not polled for FILTER_TIMEOUT seconds is gone, as on geth.

A log filter's changes past GETLOGS_MAX_RESULTS are paged: the poll delivers the first `limit` logs
and leaves a cursor in the filter's entry, from which the next polls read the rest with eth_getLogs
before newer changes (filter_backlog.py). A filter made through another replica has no entry here:
its changes past the limit are -32005, as the node has moved past them (`data` names their blocks).

The live filters are a table: in the process (WORKERS=1), or in the run directory shared by the
workers of a host (workers/shared_table.py). So a filter made through one worker and polled or
uninstalled through another is one filter, polled and uninstalled, and the key's count is one number
for the host. A filter being made holds its place from before the node is asked until the node
answers: two workers making a key's last filter at once cannot both pass the cap. With Redis the
key's filters of every replica are counted there too (filter_places.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from proxy.asking import ASK_AGAIN
from proxy.cache.log_chunks import block_of
from proxy.chain.shown import shown
from proxy.config import Settings
from proxy.credits.accounts import OPEN_ACCOUNT
from proxy.gateway.filter_backlog import Backlog, after, behind, first_page, loaded, merged
from proxy.gateway.filter_places import FilterPlaces
from proxy.held_bytes import deep_size
from proxy.network import NetworkRuntime
from proxy.prepared import Prepared
from proxy.redis_link import RedisLink
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import INTERNAL_ERROR, LIMIT_EXCEEDED, Call, JsonRpcError
from proxy.values import BYPASS, Answer, Outcome
from proxy.workers.shared_table import LocalTable, SharedTable, alive

FILTER_METHODS = frozenset(
    {
        "eth_newFilter",
        "eth_newBlockFilter",
        "eth_newPendingTransactionFilter",
        "eth_getFilterChanges",
        "eth_getFilterLogs",
        "eth_uninstallFilter",
    }
)
FILTER_TIMEOUT = 300.0  # geth's filter deadline: 5 minutes without a poll
NOT_FOUND = -32000  # geth's code and message for an unknown filter id
_TAG = 32  # hex digits of the HMAC that bind an id to its key

Prepare = Callable[[Call, NetworkRuntime], Prepared]
Execute = Callable[[Prepared], Awaitable[Outcome]]


@dataclass(slots=True)
class _Filter:
    account: str
    network: str
    node_id: str  # the node's own id
    criteria: dict[str, Any] | None  # eth_newFilter's filter object; None for block/pending filters
    polled: float  # monotonic time of creation or the last eth_getFilterChanges
    pid: int  # the process that made it (a place held while the node is asked: dropped if it died)
    backlog: Backlog | None = None  # a log filter's changes past the limit, left to read
    size: int = 0  # bytes its entry holds (its criteria), of MAX_FILTER_BYTES


class Filters:
    def __init__(
        self,
        settings: Settings,
        prepare: Prepare,
        execute: Execute,
        clock: Callable[[], float] = time.monotonic,
        run_dir: str | None = None,
        link: RedisLink | None = None,
    ) -> None:
        self._settings = settings
        digests = sorted(k.sha256 for k in (settings.api_keys or {}).values())
        self._secret = hashlib.sha256("filter ids\0".join(["", *digests]).encode()).digest()
        self._prepare = prepare
        self._execute = execute
        self._clock = clock  # CLOCK_MONOTONIC: one clock for every worker of a host
        # own id -> _Filter's fields, in order; a place held while the node is asked: "pending:<pid>:<n>"
        self._table: SharedTable | LocalTable = (
            SharedTable(os.path.join(run_dir, "filters.json")) if run_dir is not None else LocalTable()
        )
        self._pid = os.getpid()
        self._made = 0
        self._origin = secrets.token_hex(4)  # places are unique across replicas, whose pids may coincide
        self._places = FilterPlaces(link, FILTER_TIMEOUT)  # across replicas, with Redis

    async def execute(self, prepared: Prepared, account: str) -> Outcome:
        """One filter call of `account` (validated and paid for by the gateway)."""
        try:
            return await self._serve(prepared, account)
        except JsonRpcError as error:
            return Outcome.failed(error)

    async def _serve(self, prepared: Prepared, account: str) -> Outcome:
        method, net, params = prepared.call.method, prepared.network, prepared.params
        if method in ("eth_newFilter", "eth_newBlockFilter", "eth_newPendingTransactionFilter"):
            return await self._install(prepared, account)
        own_id = params[0]
        node_id = self._node_id(account, own_id)
        if node_id is None:
            if method == "eth_uninstallFilter":
                return Outcome(jsonrpc.dumps(False), False, BYPASS, local=True)  # geth's answer; free
            raise JsonRpcError(NOT_FOUND, "filter not found", local=True)
        # Made on this host: its criteria and last poll are known. Else another replica made it.
        entry = self._entry(own_id, net.name, polled=method == "eth_getFilterChanges")
        if entry is not None and entry.network != net.name:
            raise JsonRpcError(NOT_FOUND, "filter not found", local=True)
        if method == "eth_uninstallFilter":
            with self._table.edit() as table:
                table.pop(own_id, None)
            await self._places.dropped(account, own_id)
            return Outcome.answered(await net.upstream.request(method, [node_id]), BYPASS)
        if method == "eth_getFilterLogs" and entry is not None:
            if entry.criteria is None:
                raise JsonRpcError(NOT_FOUND, "filter not found", local=True)  # geth: only log filters have logs
            # eth_getLogs over the filter's criteria: its limits, its -32005s, its cache.
            return await self._execute(self._prepare(Call("eth_getLogs", [entry.criteria], prepared.call.id), net))
        if method == "eth_getFilterChanges" and entry is not None and entry.criteria is not None:
            answer = await self._log_changes(net, own_id, node_id, entry.criteria, entry.backlog)
        else:
            answer = await self._limited(net, method, node_id)
        if method == "eth_getFilterChanges" and not answer.is_error:
            await self._places.polled(account, own_id)
        return Outcome.answered(shown(net.tracker, method, answer, []), BYPASS)  # latest: at least its logs' block

    def _entry(self, own_id: str, network: str, *, polled: bool) -> _Filter | None:
        """The filter behind `own_id` if this host made it; a poll on its network renews it."""
        with self._table.edit() as table:
            record = table.get(own_id)
            if record is None:
                return None
            entry = _loaded(record)
            if polled and entry.network == network:
                record[4] = entry.polled = self._clock()
            return entry

    async def _install(self, prepared: Prepared, account: str) -> Outcome:
        net, method = prepared.network, prepared.call.method
        raw = prepared.call.params
        assert isinstance(raw, list)  # the gateway validated it: positional params
        criteria = raw[0] if method == "eth_newFilter" else None  # validated as eth_getLogs' filter
        assert isinstance(criteria, dict) or criteria is None
        place, size = self._hold_place(account, net.name, criteria)
        made: tuple[str, _Filter] | None = None
        try:
            cap = self._settings.max_filters_per_key
            if account != OPEN_ACCOUNT and not await self._places.hold(account, place, cap):
                raise _too_many(cap, account)  # the key's filters made through the other replicas fill the cap
            answer = await net.upstream.request(method, raw)
            if answer.is_error or not isinstance(answer.result, str):
                return Outcome.answered(answer, BYPASS)
            node_id = answer.result.lower()
            if not node_id.startswith("0x"):
                return Outcome.answered(answer, BYPASS)
            own_id = "0x" + self._tag(account, node_id) + node_id[2:]
            made = own_id, _Filter(account, net.name, node_id, criteria, self._clock(), self._pid, size=size)
            return _result(own_id)
        finally:
            with self._table.edit() as table:  # the place becomes the filter, or is given back
                table.pop(place, None)
                if made is not None:
                    table[made[0]] = _record(made[1])
            if account != OPEN_ACCOUNT:
                await self._places.settle(account, place, made[0] if made is not None else None)

    def _hold_place(self, account: str, network: str, criteria: dict[str, Any] | None) -> tuple[str, int]:
        """A place among the account's filters while the node is asked, and the bytes the filter will
        hold; LIMIT_EXCEEDED when no place is left (open mode: every client is one account, its places
        the host's) or no room for its bytes among the host's filters (MAX_FILTER_BYTES, a key's a
        quarter, the open account's the whole)."""
        cap, limit = self._settings.max_filters_per_key, self._settings.max_filter_bytes
        self._made += 1
        place = f"pending:{self._pid}:{self._origin}:{self._made}"
        entry = _Filter(account, network, "", criteria, self._clock(), self._pid)
        entry.size = deep_size(_record(entry)) + _NODE_ID_BYTES
        with self._table.edit() as table:
            # Open mode's clients are one account: its cap is the host's (uncapped, 62,000 block filters
            # each scanned by the next install held the loop for seconds).
            live, held, mine = self._live(table, account)
            if live >= cap:
                raise _too_many(cap, account)
            if held + entry.size > limit or (account != OPEN_ACCOUNT and mine + entry.size > limit // 4):
                raise JsonRpcError(
                    LIMIT_EXCEEDED,
                    f"filters hold too many bytes: at most {limit} on this host (MAX_FILTER_BYTES), a key's a "
                    "quarter; uninstall some with eth_uninstallFilter, or ask for fewer addresses",
                )
            table[place] = _record(entry)
        return place, entry.size

    def _tag(self, account: str, node_id: str) -> str:
        return hmac.new(self._secret, f"{account}\0{node_id}".encode(), hashlib.sha256).hexdigest()[:_TAG]

    def _node_id(self, account: str, own_id: str) -> str | None:
        """The node's id behind one of `account`'s ids; None for anything else (another key's included)."""
        tag, node_id = own_id[2 : 2 + _TAG], "0x" + own_id[2 + _TAG :]
        if len(node_id) < 3 or not hmac.compare_digest(tag, self._tag(account, node_id)):
            return None
        return node_id

    def _live(self, table: dict[str, Any], account: str) -> tuple[int, int, int]:
        """The account's filters, and the bytes the host's and the account's hold, forgetting those past
        FILTER_TIMEOUT (the node has dropped them) and the places held by processes that died asking
        the node."""
        now = self._clock()
        gone = [
            own_id
            for own_id, record in table.items()
            if now - record[4] > FILTER_TIMEOUT or (own_id.startswith("pending:") and not alive(record[5]))
        ]
        for own_id in gone:
            del table[own_id]
        count = held = mine = 0
        for record in table.values():  # one pass: each install reads the host's every filter
            size = record[7] if len(record) > 7 else 0
            held += size
            if record[0] == account:
                count += 1
                mine += size
        return count, held, mine

    async def _limited(self, net: NetworkRuntime, method: str, node_id: str) -> Answer:
        """The node's logs or changes of a filter, under eth_getLogs' time and result limits."""
        answer = await self._asked(net, method, node_id)
        changes, limit = answer.result, self._settings.getlogs_max_results
        if isinstance(changes, list) and len(changes) > limit:
            # The node has moved the filter past these changes: the message names the blocks they
            # span (Infura's form), to be read with eth_getLogs in narrower ranges. Not in `data`:
            # spec, only a revert has one (the spec fixes eth_getLogs' message, not this one's).
            blocks = [b for b in (block_of(c) for c in changes) if b is not None]
            hint = f". Try with this block range [{hex(min(blocks))}, {hex(max(blocks))}]." if blocks else ""
            raise JsonRpcError(LIMIT_EXCEEDED, f"query returned more than {limit} results{hint}")
        return answer

    async def _asked(self, net: NetworkRuntime, method: str, node_id: str) -> Answer:
        """The node's answer to a filter call, under eth_getLogs' time limit."""
        timeout = self._settings.getlogs_timeout
        try:
            async with asyncio.timeout(timeout):
                return await net.upstream.request(method, [node_id], timeout=timeout + 1)
        except TimeoutError:
            raise JsonRpcError(LIMIT_EXCEEDED, "query timeout exceeded") from None

    async def _log_changes(
        self, net: NetworkRuntime, own_id: str, node_id: str, criteria: dict[str, Any], before: Backlog | None
    ) -> Answer:
        """A log filter's changes, GETLOGS_MAX_RESULTS at most: those past it are left as the entry's
        backlog, which the next polls read before newer changes (filter_backlog.py)."""
        answer = await self._asked(net, "eth_getFilterChanges", node_id)
        changes, limit = answer.result, self._settings.getlogs_max_results
        if answer.is_error or not isinstance(changes, list) or (before is None and len(changes) <= limit):
            return answer
        if before is None:
            page = first_page(changes, limit)
            self._keep(own_id, before, page.backlog)
            return _logs(page.logs)
        now, backlog = behind(changes, before)
        try:
            more, left = await self._backlog(net, criteria, backlog, limit - len(now))
        except JsonRpcError:
            self._keep(own_id, before, backlog)  # the node's changes are in it: read at the next poll
            if now:
                return _logs(now)
            raise
        self._keep(own_id, before, left)
        return _logs(now + more)

    async def _backlog(
        self, net: NetworkRuntime, criteria: dict[str, Any], backlog: Backlog, room: int
    ) -> tuple[list[Any], Backlog | None]:
        """Up to `room` logs of a backlog, read with eth_getLogs over the filter's criteria, and the
        backlog they leave. A range the node refuses is halved, down to one block, whose logs are paged
        by logIndex; all under eth_getLogs' time limit."""
        logs: list[Any] = []
        at, start, upto = backlog.after, backlog.after[0], backlog.upto
        try:
            async with asyncio.timeout(self._settings.getlogs_timeout):
                while len(logs) < room and start <= upto:
                    end = upto
                    while (answer := await self._read(net, criteria, start, end)) is None or answer.is_error:
                        if end == start:
                            if answer is None:  # no node shows the block yet (a shorter chain, nodes behind)
                                return logs, Backlog(at, upto)  # read on at the next poll
                            raise _refused(answer)
                        end = start + (end - start) // 2
                    page, last = after(answer.result, at, room - len(logs))
                    logs += page
                    if last is not None:  # more in this range than there is room for
                        return logs, Backlog(last, upto)
                    start, at = end + 1, (end + 1, -1)
        except TimeoutError:
            raise JsonRpcError(LIMIT_EXCEEDED, "query timeout exceeded") from None
        return logs, (Backlog(at, upto) if start <= upto else None)

    async def _read(self, net: NetworkRuntime, criteria: dict[str, Any], start: int, end: int) -> Answer | None:
        """eth_getLogs over the filter's criteria from block `start` to `end`, from a node that shows
        block `end` in the same batch: a node behind (a load balancer's lagging member) answers short of
        the blocks it lacks, which would be read as done. Asked again (another member may answer);
        None when no node showed the block. An error unless a list."""
        query = {k: v for k, v in criteria.items() if k not in ("fromBlock", "toBlock", "blockHash")}
        query.update(fromBlock=hex(start), toBlock=hex(end))
        calls = [("eth_getLogs", [query]), ("eth_getBlockByNumber", [hex(end), False])]
        for _ in range(ASK_AGAIN):  # asked again until a node shows the range's last block
            both = await net.upstream.together(calls)
            if both is None:  # batches refused: the logs alone, as the node gives them
                answer = await net.upstream.request("eth_getLogs", [query], timeout=self._settings.getlogs_timeout + 1)
                break
            answer, shown = both
            if isinstance(shown.result, dict) and shown.result.get("number") == hex(end):
                break
        else:
            return None
        if not answer.is_error and not isinstance(answer.result, list):
            return Answer(answer.payload, None, {"code": INTERNAL_ERROR, "message": "eth_getLogs gave no list"})
        return answer

    def _keep(self, own_id: str, before: Backlog | None, left: Backlog | None) -> None:
        """The filter's backlog is now `left`, read from `before`: merged with what another poll of the
        same filter left meanwhile (nothing is lost; a page may come twice)."""
        with self._table.edit() as table:
            record = table.get(own_id)
            if record is None:
                return  # uninstalled meanwhile
            stored = loaded(record[6]) if len(record) > 6 and record[6] is not None else None
            kept = left if stored == before else merged(stored, left)
            if len(record) > 6:
                record[6] = None if kept is None else kept.stored()
            elif kept is not None:  # an entry of six fields: one written before backlogs and sizes
                record.append(kept.stored())


_NODE_ID_BYTES = sys.getsizeof("0x" + "0" * 64)  # a filter's node id, set once the node answers


def _too_many(cap: int, account: str) -> JsonRpcError:
    where = "on this host in open mode" if account == OPEN_ACCOUNT else "per key"
    return JsonRpcError(
        LIMIT_EXCEEDED,
        f"too many filters: at most {cap} {where} (MAX_FILTERS_PER_KEY); uninstall one with eth_uninstallFilter",
    )


def _record(entry: _Filter) -> list[Any]:
    backlog = None if entry.backlog is None else entry.backlog.stored()
    return [entry.account, entry.network, entry.node_id, entry.criteria, entry.polled, entry.pid, backlog, entry.size]


def _loaded(record: list[Any]) -> _Filter:
    """A table entry; one written before backlogs and sizes existed has six fields."""
    account, network, node_id, criteria, polled, pid = record[:6]
    backlog = loaded(record[6]) if len(record) > 6 and record[6] is not None else None
    return _Filter(account, network, node_id, criteria, polled, pid, backlog, record[7] if len(record) > 7 else 0)


def _logs(logs: list[Any]) -> Answer:
    return Answer(jsonrpc.dumps(logs), logs)


def _refused(answer: Answer) -> JsonRpcError:
    """The node's refusal of a backlog's one block, as the client's error."""
    error = answer.error or {}
    return JsonRpcError(answer.error_code or INTERNAL_ERROR, str(error.get("message", "")), error.get("data"))


def _result(value: Any) -> Outcome:
    return Outcome(jsonrpc.dumps(value), False, BYPASS)
