"""The nodes behind the proxy: pools, per-upstream state, upstream WebSockets."""
