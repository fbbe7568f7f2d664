"""The settings table: env name, CLI flag, help. cli.py builds its flags from it, the docs' settings
reference is written from it (scripts/settings_reference.py), options.py parses by it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Option:
    env: str
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.env.lower().replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option("PROXY_HOST", "address to listen on (default 127.0.0.1)"),
    Option("PROXY_PORT", "port to listen on (default 8545)"),
    Option("EVM_UPSTREAM", "comma-separated upstream URLs of the default EVM network; first is primary"),
    Option("SOLANA_UPSTREAM", "comma-separated upstream URLs of the default Solana network"),
    Option("NETWORKS_FILE", "optional TOML file declaring more networks"),
    Option(
        "VERIFY_ANSWERS",
        "verified answers of the EVM_UPSTREAM network: auto, required or off (default auto; "
        "NETWORKS_FILE networks set their own `verify`)",
    ),
    Option("REDIS_URL", "optional Redis URL for the shared cache tier and credit ledger"),
    Option("REDIS_TIMEOUT", "seconds before a Redis command is abandoned (default 0.25)"),
    Option("API_KEYS", "comma-separated API keys, as written (${VAR} is not expanded); none: the proxy runs open"),
    Option(
        "API_KEYS_FILE",
        "TOML file of keys: [keys.NAME] key_sha256 (or key), daily_credits, credits_per_second, "
        "allowed_origins, allowed_methods, allowed_addresses; SIGHUP reads it again",
    ),
    Option("DAILY_CREDITS", "default daily credit balance per key (default 3000000)"),
    Option("CREDITS_PER_SECOND", "default per-key credits-per-second limit (default: none)"),
    Option("DEFAULT_CREDITS", "credit cost of methods in neither the spec's table nor the credits table (default 20)"),
    Option(
        "CREDITS_FILE",
        "optional TOML file whose [credits] table sets per-method costs (method = credits) of "
        "methods outside the spec's seven; unlisted methods keep the built-in table, else DEFAULT_CREDITS",
    ),
    Option("ALLOW_NAMESPACES", "comma-separated namespaces whose every method is served (debug,txpool,...); any case"),
    Option(
        "MAX_BATCH_SIZE",
        "maximum calls in one batch, each counted and charged (default 1000, as geth and viem's batch: true)",
    ),
    Option("MAX_BODY_BYTES", "maximum HTTP request body in bytes (default 5242880)"),
    Option("WS_MAX_MESSAGE_BYTES", "maximum WebSocket message in bytes (default 5242880)"),
    Option("WS_MAX_INFLIGHT", "maximum concurrent requests per WebSocket connection (default 64)"),
    Option("UPSTREAM_TIMEOUT", "seconds before an upstream request is abandoned (default 30)"),
    Option(
        "COALESCE_WAIT",
        "seconds a replica waits for another replica's identical miss via Redis; 0 disables (default 2)",
    ),
    Option("UPSTREAM_BATCH_MAX", "most calls in one upstream JSON-RPC batch, headers too; 1 disables (default 50)"),
    Option("HEAD_POLL_INTERVAL", "seconds between head-tracker polls, fractions allowed, at least 0.05 (default 2)"),
    Option("FINALITY_DEPTH", "blocks below latest counted final when a node has no finalized tag (default 64)"),
    Option("CACHE_MEMORY_BYTES", "size bound of the in-process cache tier in bytes (default 268435456)"),
    Option("CACHE_UNFINALIZED_TTL", "seconds an answer for an unfinalized block is kept (default 12)"),
    Option("CACHE_NEGATIVE_TTL", "seconds a null not-found answer is kept (default 2)"),
    Option("SOLANA_BALANCE_MAX_AGE", "max age in seconds of a cached getTokenAccountBalance (default 0.4)"),
    Option("SOLANA_LARGEST_ACCOUNTS_TTL", "seconds getLargestAccounts is cached, at most 7200 (default 3600)"),
    Option("GETLOGS_MAX_RESULTS", "eth_getLogs result limit (default 10000)"),
    Option("GETLOGS_TIMEOUT", "eth_getLogs query time limit in seconds (default 10)"),
    Option("GETLOGS_MAX_PARAMS", "eth_getLogs limit on addresses plus topic values (default 5000)"),
    Option(
        "GETLOGS_CHUNK_BLOCKS",
        "eth_getLogs ranges are asked and cached in aligned chunks of this many blocks "
        "(a tenth of it near finality); 0 disables (default 1000)",
    ),
    Option("GETLOGS_CHUNK_CONCURRENCY", "chunks of one eth_getLogs call asked upstream at once (default 4)"),
    Option(
        "MAX_RESPONSE_BYTES",
        "largest answer to one request body (a batch counted whole); beyond it calls "
        "get -32005 response size exceeded (default 33554432)",
    ),
    Option(
        "UPSTREAM_KEY_CONCURRENCY",
        "upstream calls one API key may have in flight at once (chunks and batch "
        "members included); 0: no cap (default 8)",
    ),
    Option(
        "MAX_CALLS_IN_FLIGHT_PER_KEY",
        "calls one API key may have in the making at once in a process (a batch counts its calls); more "
        "wait in the key's own queue; 0: no cap (default 2000)",
    ),
    Option(
        "CACHE_KEY_BYTES_PER_MINUTE",
        "bytes of answers one API key's calls may store in the cache per minute; "
        "past it answers are served but not kept; 0: no bound (default CACHE_MEMORY_BYTES / 16)",
    ),
    Option("GAS_CAP_MULTIPLIER", "eth_call/eth_estimateGas gas cap as a multiple of the block gas limit (default 10)"),
    Option(
        "ETH_CALL_REQUIRE_FROM",
        "require `from` in eth_call as the spec's table does (default false: "
        "the node's own default sender applies, as with geth and Anvil)",
    ),
    Option("LOG_FORMAT", "text or json (JSON lines), in any case"),
    Option("LOG_LEVEL", "DEBUG, INFO, WARNING or ERROR (default INFO)"),
    Option(
        "ACCESS_LOG",
        "log every request (key name, client IP, status, total ms, cache, upstream ms) and every "
        "call: request id, method, cache result, upstream latency (default false)",
    ),
    Option("SHUTDOWN_TIMEOUT", "seconds SIGTERM waits for in-flight requests (default 30)"),
    Option(
        "WORKERS",
        "worker processes (at most 1024) sharing the port, each with its own memory tier; auto: one per CPU the "
        "process may use (its affinity, at most its container's CPU limit) (default 1: one process, no supervisor)",
    ),
    Option(
        "EVENT_LOOP",
        "uvloop or asyncio; uvloop (less CPU per request) comes with the proxy wherever it builds "
        "(default uvloop where installed, else asyncio)",
    ),
    Option("ALLOW_METHODS", "comma-separated methods to serve beyond the default allow-list (exact names)"),
    Option(
        "BODY_TIMEOUT",
        "seconds a client has to send a request body once the proxy reads it (from its headers, or once "
        "a body left unread for want of room is read on), and a WebSocket message from its first byte "
        "(default 30)",
    ),
    Option("MAX_CONNECTIONS", "open client connections per worker; more are answered 503 and closed (default 4096)"),
    Option(
        "MAX_INFLIGHT_BODY_BYTES",
        "request-body bytes being received at once (a request waiting for room: what it read of its body, a "
        "key's at most a quarter; a WebSocket message not yet whole: what has come of it), all clients "
        "of the host together (every worker's); beyond it 503, a WebSocket closed 1013 (default 134217728)",
    ),
    Option(
        "MAX_PENDING_ANSWER_BYTES",
        "bytes of answers one connection may have made and not yet taken by its client; its next "
        "request waits, unmade, until it takes some (default 8388608)",
    ),
    Option(
        "MAX_PENDING_ANSWER_BYTES_PER_KEY",
        "as MAX_PENDING_ANSWER_BYTES, all connections of one API key on the host together, split evenly: "
        "each of N workers holds a key to 1/N of it, rounded up (default 67108864)",
    ),
    Option(
        "MAX_PENDING_ANSWER_BYTES_PER_PROCESS",
        "as MAX_PENDING_ANSWER_BYTES, all connections of a serving process (one worker) together; past it a "
        "key holding nothing is still served one answer at a time, and one under its even share up to a "
        "quarter past it (default 268435456)",
    ),
    Option("METRICS_HOST", "address of the internal /metrics listener (default 127.0.0.1)"),
    Option(
        "METRICS_PORT",
        "port of an internal listener serving /metrics; when set, the public port does not "
        "(default: unset, /metrics on the public port)",
    ),
    Option("ADMIN_HOST", "address of the admin listener (default 127.0.0.1)"),
    Option(
        "ADMIN_PORT",
        "port of the admin listener: list, cordon and uncordon upstreams, reload NETWORKS_FILE (default: unset, off)",
    ),
    Option(
        "ADMIN_TOKEN",
        "bearer token every admin request must carry (required with ADMIN_PORT; at least 16 "
        "printable ASCII characters, no whitespace, at least 8 distinct; never logged)",
    ),
    Option(
        "UPSTREAM_BATCH_MAX_BYTES",
        "most bytes of params in one upstream auto-batch; a larger call goes alone (default 1048576)",
    ),
    Option(
        "UPSTREAM_ATTEMPT_TIMEOUT",
        "seconds one upstream attempt may take before the next upstream is tried "
        "(default: UPSTREAM_TIMEOUT shared evenly by the upstreams left to try)",
    ),
    Option(
        "HEAD_STALE_AFTER",
        "seconds after the last good head poll when tags stop being resolved (calls with them go upstream "
        "uncached), /readyz degraded; more than HEAD_POLL_INTERVAL (default 3 poll intervals, at least 1)",
    ),
    Option(
        "HEAD_CATCH_UP_WAIT",
        "seconds a `latest` call waits for the head to reach a block the proxy has "
        "already shown; then it goes upstream uncached (default 0.3; 0: no wait)",
    ),
    Option(
        "IDENTITY_CHECK_INTERVAL",
        "seconds between checks of each upstream's chain id and genesis hash, at least 1 (default 30)",
    ),
    Option("CREDITS_REDIS_URL", "Redis URL of the credit ledger, ideally a noeviction one (default REDIS_URL)"),
    Option("CREDITS_REDIS_TIMEOUT", "seconds before a ledger Redis command is abandoned (default 2)"),
    Option("CREDITS_REDIS_FAILURES", "consecutive ledger Redis failures before it counts as down (default 3)"),
    Option("CREDITS_REQUIRE_NOEVICTION", "refuse to start if the ledger's Redis may evict keys (default false)"),
    Option("CREDITS_FAIL_OPEN", "serve keys with no known usage while the ledger is unreachable (default true)"),
    Option("CREDITS_LEASE_MAX", "most credits of a key one replica leases at a time (default 100000)"),
    Option("CREDITS_LEASE_SECONDS", "seconds before an unused lease goes back to the ledger (default 10)"),
    Option(
        "CREDITS_JOURNAL_DIR",
        "directory of the journal of debits made while the ledger is unreachable; must exist and be writable at start",
    ),
    Option(
        "EVM_UPSTREAM_WS",
        "comma-separated WebSocket URLs of the default EVM network's node: push heads, relayed subscriptions",
    ),
    Option("SOLANA_UPSTREAM_WS", "comma-separated WebSocket URLs of the default Solana network (pubsub relay)"),
    Option("WS_MAX_SUBSCRIPTIONS", "maximum subscriptions per WebSocket connection (default 100)"),
    Option(
        "WS_MAX_SUBSCRIPTION_BYTES",
        "bytes a worker's WebSocket subscriptions hold (their criteria), a key's at most a quarter, open "
        "mode's the whole; more are -32005 (default 67108864)",
    ),
    Option(
        "WS_SEND_BUFFER_BYTES",
        "bytes a WebSocket connection may have waiting to be sent; past it the "
        "connection is closed as a slow consumer with 1008 (default 4194304)",
    ),
    Option(
        "WS_MAX_LAG",
        "seconds a WebSocket connection may fall behind (its oldest unsent message's age) or take no "
        "byte while output waits; past it the connection is closed as a slow consumer with 1008 (default "
        "10); notifications the key's per-second limit holds that long end its subscriptions instead (-32005)",
    ),
    Option(
        "WS_MAX_CONNECTIONS_PER_KEY",
        "open WebSocket connections per API key; more are refused with HTTP 429 (-32005); 0: no cap (default 512)",
    ),
    Option(
        "MAX_CONNECTIONS_PER_IP",
        "open client connections per client IP address; more are answered 503 and closed "
        "at once; 0: no cap, for a proxy behind a load balancer that hides client addresses (default 1024)",
    ),
    Option(
        "WS_IDLE_TIMEOUT",
        "seconds a WebSocket connection with no subscription and no call is kept open; then it "
        "is closed with 1000 (default 300)",
    ),
    Option(
        "MAX_FILTERS_PER_KEY",
        "live node-side filters (eth_newFilter, eth_newBlockFilter, "
        "eth_newPendingTransactionFilter) per API key (open mode: the host's together); more are -32005 until "
        "one is uninstalled or expires (default 100)",
    ),
    Option(
        "MAX_FILTER_BYTES",
        "bytes the host's node-side filters hold (their criteria), a key's at most a quarter, open mode's "
        "the whole; more are -32005 (default 67108864)",
    ),
    Option(
        "CORS_ALLOW_ORIGINS",
        "comma-separated origins (https://app.example) browser pages may call from; * for any (default *)",
    ),
    Option(
        "COMPRESS_MIN_BYTES",
        "answers of at least this many bytes are gzip-compressed for clients that accept it; 0 disables (default 4096)",
    ),
    Option(
        "COMPRESS_CACHE_BYTES",
        "bytes of compressed cached answers kept, so a hit is not compressed again (default 67108864)",
    ),
    Option(
        "TRUSTED_PROXY_HEADER",
        "header carrying the client IP set by a proxy in front (X-Forwarded-For: its "
        "last entry; X-Real-IP); the access log shows it instead of the peer's address (default: unset)",
    ),
    Option(
        "UNMINED_TTL",
        "seconds a null receipt or transaction (not yet mined) is kept, at most; a new head "
        "ends it sooner (default 0.25)",
    ),
    Option(
        "SUBSCRIPTION_CREDITS",
        "per-kind subscription credits, each kind once, e.g. subscribe=5,newHeads=50,logs=300 "
        "(defaults: subscribe 5, newHeads 50, logs 300, newPendingTransactions 200, other 50)",
    ),
)
OPTION_NAMES = frozenset(o.env for o in OPTIONS)
