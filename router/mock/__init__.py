"""``kvrouter mock-replica``: the simulator's engine model on the wall clock behind an
OpenAI-compatible server that also publishes vLLM-format KV events."""
