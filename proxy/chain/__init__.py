"""What the proxy knows of each chain: heads, finality, reorgs, identity, pinning to hashes."""
