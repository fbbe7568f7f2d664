"""Transports: the HTTP and WebSocket handlers, the gateway behind them, subscriptions."""
