"""Engine KV events: decoding vLLM/SGLang payloads, re-blocking to canonical hashes, the ZMQ
subscriber with replay, and the direct (no Redis) single-router mode."""
