"""Which API key a call is being served for, as the layers below the gateway need it (the per-key
upstream budget, cache admission): a context variable the gateway sets once per request body.

None: the proxy's own calls (head polls, identity probes) and open mode, where there are no keys.
Tasks inherit it, so a batch's members, a chunked call's pieces and a coalesced fill run as the key
that started them.
"""

from __future__ import annotations

from contextvars import ContextVar

CALLER: ContextVar[str | None] = ContextVar("rpc_proxy_caller", default=None)
