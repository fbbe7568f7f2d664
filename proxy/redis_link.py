"""The one place Redis is called: a short timeout per command, and a breaker that skips Redis
while it is down so no request waits on it. redis-py reconnects by itself once Redis is back. The
client is one server's, a Redis Cluster's or a Sentinel-watched primary's (redis_topology.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import AskError, ClusterError, RedisClusterException, RedisError, ResponseError, TryAgainError

from proxy.logs import Throttled
from proxy.metrics import Metrics
from proxy.redis_topology import RedisTopology, topology_of

log = logging.getLogger("proxy.redis")
throttled = Throttled(log)  # a flapping Redis would otherwise log every time it drops
T = TypeVar("T")
# What every caller sees: one server (direct or through Sentinel) or a cluster; they take the same
# commands, as long as each multi-key command's keys share a slot (redis_topology.slot_tag).
RedisClient = aioredis.Redis | RedisCluster
# redis-py 8's pools refuse a command past `max_connections` (100 by default) instead of opening
# one more; under a burst that refusal would open the breaker and skip Redis for everyone. Redis's
# own `maxclients` is the bound that matters.
UNBOUNDED_CONNECTIONS = 2**31
DISCOVERY_SECONDS = 5.0  # the least a cluster's slot map (and first command table) is read within, in the background


def connect(url: str, timeout: float) -> RedisClient:
    """A client for the topology the URL names (redis_topology.py). Nothing connects until used."""
    # A retry would only add latency; the breaker handles outages.
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
        "max_connections": UNBOUNDED_CONNECTIONS,
    }
    topology = topology_of(url)
    if topology.kind == "cluster":
        return _cluster(topology, options)
    if topology.kind == "sentinel":
        return _sentinel(topology, options)
    return aioredis.Redis.from_url(url, **options)


class BoundedCluster(RedisCluster):
    """A cluster client whose redirections fit in one command's budget.

    redis-py follows up to 16 redirections per command, sleeping 50 ms on each TRYAGAIN of the
    second half: a key of a slot being resharded (ASK, then TRYAGAIN, then MOVED back, in a loop)
    took longer than REDIS_TIMEOUT, a timeout the breaker reads as an outage of every key. Four
    cover a stale slot map (MOVED), a migrating slot (ASK) and the command itself."""

    RedisClusterRequestTTL = 4


def _cluster(topology: RedisTopology, options: dict[str, Any]) -> RedisCluster:
    # A node that fails (a dead primary) makes the slot map be read again (by redis-py after a
    # failed command, by RedisLink after any failure), so commands then go to the promoted replica;
    # MOVED/ASK redirections are followed within a command. Reads go to primaries only: a replica
    # may lag, and a lagging read is a wrong miss at worst for the cache but a stale balance for the
    # ledger. reinitialize_steps=0: on every fifth MOVED redis-py closed every connection of every
    # node, failing the other commands in flight (an outage to the breaker) while one slot moved; a
    # MOVED now patches that slot, and RedisLink reads the whole map again after a failure.
    return BoundedCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in topology.nodes],
        username=topology.username,
        password=topology.password,
        ssl=topology.tls,
        reinitialize_steps=0,
        **options,
    )


class SentinelManagedRedis(aioredis.Redis):
    """The primary found through Sentinel; closing it also closes the connections to the Sentinels."""

    sentinels: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinels is not None:
            for node in self.sentinels.sentinels:
                await node.aclose()


def _sentinel(topology: RedisTopology, options: dict[str, Any]) -> aioredis.Redis:
    # Each new connection to the primary asks the Sentinels for its address: their pools too.
    # No retry either: redis-py's own retries multiplied a silent Sentinel's wait (about 12 timeouts).
    shared = ("max_connections", "retry")
    sentinel_options = {k: v for k, v in options.items() if k.startswith("socket_") or k in shared}
    # rediss+sentinel: TLS to the Sentinels as to the data nodes.
    sentinel_options.update(username=topology.sentinel_username, password=topology.sentinel_password, ssl=topology.tls)
    sentinel = Sentinel(list(topology.nodes), sentinel_kwargs=sentinel_options)  # type: ignore[no-untyped-call]
    # The pool asks the Sentinels for the primary's address on every new connection, and drops its
    # connections when that address changes: after a failover the next command reaches the new one.
    client: SentinelManagedRedis = sentinel.master_for(
        topology.service,
        redis_class=SentinelManagedRedis,
        db=topology.db,
        username=topology.username,
        password=topology.password,
        ssl=topology.tls,
        **options,
    )
    client.sentinels = sentinel
    return client


async def memory_policies(client: RedisClient) -> list[str]:
    """The maxmemory-policy of each node that holds data, from INFO memory (answered where a managed
    Redis renames or blocks CONFIG): every primary of a cluster (by default redis-py asks one), else
    the one server."""
    replies: list[Any]
    if isinstance(client, RedisCluster):  # then the reply is {node name: {field: value}}
        per_node: Any = await client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        replies = [per_node] if "maxmemory_policy" in per_node else list(per_node.values())
    else:
        replies = [await client.info("memory")]
    values = [reply.get("maxmemory_policy", "") for reply in replies]
    return [value.decode() if isinstance(value, bytes) else str(value) for value in values]


def of_one_key(exc: BaseException) -> bool:
    """A failure of one key or slot, not of Redis: a key holding another type than the command's
    (WRONGTYPE: another program's, or tampered), a slot moving between cluster nodes (ASK and TRYAGAIN
    until redis-py's redirections run out, as every slot does during a reshard). Each had opened the
    breaker, so one such key took the shared tier from every other (and a value never written over)."""
    if isinstance(exc, (AskError, TryAgainError)):
        return True
    if isinstance(exc, ResponseError):
        return "WRONGTYPE" in str(exc)
    return isinstance(exc, ClusterError) and "TTL exhausted" in str(exc)


class RedisUnavailable(Exception):
    """Redis is down or skipped; callers fall back to in-process state."""


class RedisLink:
    def __init__(
        self,
        client: RedisClient,
        *,
        timeout: float,
        metrics: Metrics,
        min_backoff: float = 0.5,
        max_backoff: float = 5.0,
        failures_to_open: int = 1,
        name: str = "redis",
        report_up: bool = True,
    ) -> None:
        self.client = client
        self._timeout = timeout
        self._metrics = metrics
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._backoff = min_backoff
        self._skip_until = 0.0
        # The breaker opens after this many failures in a row: the ledger's budget is larger than
        # the cache's, so one slow answer under CPU load does not count as an outage.
        self._failures_to_open = failures_to_open
        self._failures = 0
        self._told_down = False  # an outage was logged whose end was not
        self._name = name
        self._report_up = report_up  # the cache's link drives rpc_proxy_redis_up
        if report_up:
            metrics.redis_up.set(1)
        self._rediscovery: asyncio.Task[None] | None = None
        self._reached = False  # a command was answered once: a cluster's first discovery is made

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._skip_until

    @property
    def timeout(self) -> float:
        return self._timeout

    async def run(
        self,
        operation: str,
        command: Callable[[RedisClient], Awaitable[T]],
        *,
        timeout: float | None = None,
    ) -> T:
        """Run one command; raise RedisUnavailable (never a redis error) when it cannot be done now.
        `timeout`: a shorter budget than the link's (what is left of a caller's deadline)."""
        if not self.up or self._discovering():
            raise RedisUnavailable(operation)
        try:
            async with asyncio.timeout(self._timeout if timeout is None else min(timeout, self._timeout)):
                result = await command(self.client)
        except (RedisError, RedisClusterException, OSError, TimeoutError, ValueError, TypeError) as exc:
            # ValueError/TypeError: redis-py's own, for options it reads only when it connects.
            self._metrics.redis_errors.labels(operation).inc()
            if isinstance(self.client, RedisCluster):
                self._rediscover(self.client)
            if of_one_key(exc):
                raise RedisUnavailable(operation) from exc  # this key's: no outage for every other
            self._failures += 1
            if self._failures >= self._failures_to_open:
                if self._report_up:
                    self._metrics.redis_up.set(0)
                if not self._told_down:  # tried on each failure of the outage until logged (throttled)
                    self._told_down = throttled.warning(
                        f"{self._name} unavailable",
                        "%s unavailable (%s): %s; skipping it for %.1fs",
                        self._name,
                        operation,
                        type(exc).__name__,
                        self._backoff,
                    )
                self._skip_until = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, self._max_backoff)
            raise RedisUnavailable(operation) from exc
        self._failures = 0
        self._reached = True
        if self._skip_until:
            if self._told_down:  # after each outage logged (once a minute at most), so the log's last word is true
                log.info("%s is back", self._name)
                self._told_down = False
            self._skip_until = 0.0
            self._backoff = self._min_backoff
            if self._report_up:
                self._metrics.redis_up.set(1)
        return result

    def _rediscover(self, client: RedisCluster) -> None:
        """Read a cluster's slot map again, in the background (one reading at a time).

        redis-py does so by itself after a failed command, but not after a failed pipeline, and
        every cache lookup is one: a replica that only reads would ask a dead primary forever. The
        reading also gets a budget of its own, larger than one command's: redis-py's first discovery
        (the slot map, then the command table) runs within the first command, and cut off at its
        budget its work was thrown away and begun again by the next, so a replica whose discovery
        outlasted REDIS_TIMEOUT (seconds on a loaded machine) never reached the cluster. A first
        discovery not yet made is made whole here: the slot map alone left redis-py with nodes but no
        command table, and its next command failed with an AttributeError, no Redis error."""
        if self._rediscovery is None or self._rediscovery.done():
            self._rediscovery = asyncio.get_running_loop().create_task(self._read_slot_map(client))

    def _discovering(self) -> bool:
        """A cluster's first discovery runs in the background: a command now would find redis-py's
        nodes without their command table (an AttributeError), or wait for it past its budget."""
        task = self._rediscovery
        return task is not None and not task.done() and self._first(self.client)

    def _first(self, client: RedisClient) -> bool:
        """A cluster never reached yet (redis-py's own flag, which a lost connection sets again later:
        then the slot map alone is read, its command table kept, and no command waits on its lock)."""
        return not self._reached and bool(getattr(client, "_initialize", False))

    async def _read_slot_map(self, client: RedisCluster) -> None:
        try:
            async with asyncio.timeout(max(DISCOVERY_SECONDS, 4 * self._timeout)):
                if self._first(client):
                    await client.initialize()
                else:
                    await client.nodes_manager.initialize()
        except Exception as exc:  # the cluster is still unreachable: the next failure asks again
            log.debug("%s: reading the cluster's slot map failed: %s", self._name, type(exc).__name__)

    @property
    def is_cluster(self) -> bool:
        return isinstance(self.client, RedisCluster)

    async def close(self) -> None:
        if self._rediscovery is not None:
            self._rediscovery.cancel()
            await asyncio.gather(self._rediscovery, return_exceptions=True)
        await self.client.aclose()
        if isinstance(self.client, RedisCluster):
            # redis-py's aclose does nothing while the client waits to rediscover the cluster (after
            # a node failed): close every node's connections here, or they outlive the client.
            await self.client.nodes_manager.aclose()
            await self.client.nodes_manager.aclose("startup_nodes")
