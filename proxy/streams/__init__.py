"""Subscriptions, their fan-out per connection, and the head feed that drives them."""
