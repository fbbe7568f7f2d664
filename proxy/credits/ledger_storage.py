"""Start-up check of the credit ledger's Redis: a policy that may evict ledger entries gives keys
their credits back."""

from __future__ import annotations

import logging

from proxy.redis_link import RedisLink, RedisUnavailable, config_values


class LedgerStorageError(Exception):
    """The ledger's Redis may evict keys and CREDITS_REQUIRE_NOEVICTION is set."""


async def check_ledger_storage(link: RedisLink, require_noeviction: bool) -> None:
    """Warn (or refuse) when the ledger's Redis may evict ledger entries: evicting one gives a key
    its credits back. Every policy but noeviction evicts our keys (they carry a TTL)."""
    try:  # on a cluster, every primary: any of them may hold a key's ledger
        policies = await link.run("credits_config", lambda c: config_values(c, "maxmemory-policy"))
        policy = next((p for p in policies if p != "noeviction"), "noeviction")
    except RedisUnavailable:
        policy = "unknown (CONFIG GET failed)"
    if policy == "noeviction":
        return
    problem = (
        f"the credit ledger's Redis has maxmemory-policy {policy}: ledger entries may be evicted, "
        "giving keys their credits back; point CREDITS_REDIS_URL at a Redis with noeviction"
    )
    if require_noeviction:
        raise LedgerStorageError(problem + " (CREDITS_REQUIRE_NOEVICTION is set)")
    logging.getLogger("proxy.credits").warning("credits: %s", problem)
