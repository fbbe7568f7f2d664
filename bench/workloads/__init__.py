"""Workload benchmark: what an indexer, a dapp frontend and a wallet cost the upstream through the proxy.

    flock /work/wt/heavy.lock .venv/bin/python -m bench.workloads [--blocks 5000] [--seconds 30]

Modules: `chain` builds the token chain on Anvil, `rpc` is the measuring JSON-RPC client, `relay` counts
the calls that reach the node, `indexer` / `dapp` / `wallet` are the workloads, `report` prices and
prints, `__main__` wires them to a proxy process.
"""
