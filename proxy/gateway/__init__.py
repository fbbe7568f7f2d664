"""Per-body work between a transport and the service: routing, keys, charging, accounting, filters."""
