"""The JSON-RPC envelope and the one table of method policies with their param validators."""
