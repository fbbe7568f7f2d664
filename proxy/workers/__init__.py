"""Many serving processes on one port: the supervisor, shared head polls, one metrics scrape."""
