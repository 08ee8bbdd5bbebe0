"""``kvrouter bench longctx`` at a small size: its output contract (every shape answered
through the router, with its figures), not its speed."""

from __future__ import annotations

from tests.benches import bench_json


def test_bench_longctx_answers_the_shapes_asked_for() -> None:
    # three of the five shapes (a smoke test's time): token ids, a chat prefill, a conversation
    args = ("--tokens", "20000", "--replicas", "1", "--shapes", "ids,prefill,conv")
    out = bench_json("longctx", *args, timeout=300)
    assert out["bench"] == "longctx"
    rows = out["rows"]
    assert [r["shape"] for r in rows] == ["ids", "prefill", "conv200", "conv201"]
    for row in rows:
        tokens = row["prompt_tokens"]
        assert isinstance(tokens, int) and 0.9 * 20_000 <= tokens <= 20_000, row
        assert row["settled_ms"] >= row["cpu_ms"] >= 0, row
        assert set(row["phases_ms"]) == {"tokenize", "hash", "lookup", "score"}, row
        assert row["rss_mb"] > 0, row
    assert 0 < out["prompt_cache_mb"] <= 256
