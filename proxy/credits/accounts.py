"""API keys as accounts: a secret is checked once, at the door, and only its non-secret name goes on.

Metrics labels, log lines, the credit ledger's Redis keys and response headers all carry the
account name; the configured secret is held only as a SHA-256 digest and compared in constant time.
A secret a request presented and the digest accepted is remembered in memory (never written
anywhere), so the next request that presents it costs a dict lookup, not a SHA-256.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping

ACCOUNT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
OPEN_ACCOUNT = "open"  # the account of every call in open mode, where nothing is charged
MAX_ACCEPTED = 4096  # accepted secrets remembered (each opens an account, so a few per account at most)


def digest(secret: str) -> str:
    """The SHA-256 of a key's secret, hex: what the proxy keeps instead of the secret."""
    return hashlib.sha256(secret.encode()).hexdigest()


def derived_name(secret: str) -> str:
    """A name for a key declared only by its secret (`API_KEYS`, or `[keys.SECRET]`): a short hash
    prefix, which names the key in metrics and logs without revealing it."""
    return "key-" + digest(secret)[:12]


class Accounts:
    """Secret -> account name, from the configured digests (name -> sha256 hex)."""

    def __init__(self, digests: Mapping[str, str]) -> None:
        self._by_digest = {bytes.fromhex(d): (name, bytes.fromhex(d)) for name, d in digests.items()}
        # Only secrets the digest accepted: a guess is never remembered, so guesses cannot fill it.
        # A str's hash is keyed per process (SipHash), so a lookup compares characters only with
        # the secret whose hash it matches: the memo leaks no more than the digest's dict does.
        self.accepted: dict[str, str] = {}  # read by Gateway.account, which a hit calls first

    def account(self, secret: str) -> str | None:
        """The account a secret opens, or None. The digest is looked up, then compared in constant
        time, so neither the dict nor the comparison leaks how much of a guess was right."""
        known = self.accepted.get(secret)
        if known is not None:
            return known
        wanted = hashlib.sha256(secret.encode()).digest()
        found = self._by_digest.get(wanted)
        if found is None or not hmac.compare_digest(found[1], wanted):
            return None
        if len(self.accepted) < MAX_ACCEPTED:
            self.accepted[secret] = found[0]
        return found[0]
