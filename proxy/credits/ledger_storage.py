"""Start-up check of the credit ledger's Redis: a policy that may evict ledger entries gives keys
their credits back."""

from __future__ import annotations

import logging

from proxy.redis_link import RedisLink, RedisUnavailable, memory_policies


class LedgerStorageError(Exception):
    """The ledger's Redis may evict keys and CREDITS_REQUIRE_NOEVICTION is set."""


def eviction_problem(policies: list[str]) -> str | None:
    """What a ledger Redis of these policies (one per primary) risks; None under noeviction. Every
    policy but noeviction evicts our keys (they carry a TTL), and evicting one gives a key its credits back."""
    policy = next((p or "unknown (INFO memory does not say)" for p in policies if p != "noeviction"), "noeviction")
    if policy == "noeviction":
        return None
    return (
        f"the credit ledger's Redis has maxmemory-policy {policy}: ledger entries may be evicted, "
        "giving keys their credits back; point CREDITS_REDIS_URL at a Redis with noeviction"
    )


async def check_ledger_storage(link: RedisLink, require_noeviction: bool) -> None:
    """Warn (or, CREDITS_REQUIRE_NOEVICTION, refuse) when the ledger's Redis may evict ledger entries.
    A Redis that cannot be asked (down, a wrong password) is named in a warning of its own, never
    refused: it does not stop serve (the ledger runs on its outage leases), and `check` tries it."""
    log = logging.getLogger("proxy.credits")
    try:  # on a cluster, every primary: any of them may hold a key's ledger
        policies = await link.run("credits_config", memory_policies)
    except RedisUnavailable:
        log.warning(
            "credits: the credit ledger's Redis could not be asked its maxmemory-policy (INFO memory): not checked"
        )
        return
    problem = eviction_problem(policies)
    if problem is not None and require_noeviction:
        raise LedgerStorageError(problem + " (CREDITS_REQUIRE_NOEVICTION is set)")
    if problem is not None:
        log.warning("credits: %s", problem)
