"""rpc-cache-proxy: a caching, read-through JSON-RPC proxy for EVM and Solana nodes."""

__version__ = "0.1.0"
