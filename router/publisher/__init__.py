"""``kvrouter publish``: the sidecar that moves one engine's KV events and load to Redis."""
