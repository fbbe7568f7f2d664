"""Cache keys, tiers and the pure decisions of what to keep and for how long."""
