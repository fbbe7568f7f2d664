"""API keys as accounts, daily credit balances, leases, prices and the charging rule."""
