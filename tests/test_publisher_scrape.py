"""Engine /metrics parsing (vLLM, SGLang) for the publisher's load scrape."""

from __future__ import annotations

import pytest

from router.publisher.scrape import ScrapedLoad, parse_engine_metrics

VLLM_DP = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.25
"""

SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 9
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 3
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.75
"""


def test_vllm_per_rank() -> None:
    assert parse_engine_metrics(VLLM_DP) == {
        0: ScrapedLoad(4, 2, 0.5),
        1: ScrapedLoad(1, 0, 0.25),
    }


def test_sglang() -> None:
    assert parse_engine_metrics(SGLANG) == {0: ScrapedLoad(9, 3, 0.75)}


@pytest.mark.parametrize(
    "text", ["", "# nothing\n", "other_metric 1\n", "vllm:num_requests_running{"]
)
def test_pages_without_load_gauges_are_errors(text: str) -> None:
    with pytest.raises(ValueError):
        parse_engine_metrics(text)


VLLM_V1_COUNTERS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="1",model_name="m"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.2
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0
"""


def test_vllm_prefix_cache_counters_per_rank() -> None:
    assert parse_engine_metrics(VLLM_V1_COUNTERS) == {
        0: ScrapedLoad(1, 0, 0.1, 1000.0, 640.0),
        1: ScrapedLoad(0, 0, 0.2, 500.0, 0.0),
    }
    older = VLLM_V1_COUNTERS.replace("vllm:prefix_cache_", "vllm:gpu_prefix_cache_")
    assert parse_engine_metrics(older)[0].prefix_cache_hits == 640.0
    # engines without the counters: None, not 0 (unknown is not "no hits")
    assert parse_engine_metrics(VLLM_DP)[0].prefix_cache_queries is None


def test_load_samples_with_and_without_counters_round_trip() -> None:
    from router.store.base import LoadSample

    full = LoadSample(1, 2, 0.5, 3.0, 100.0, 40.0)
    assert LoadSample.from_json(full.to_json()) == full
    bare = LoadSample(1, 2, 0.5, 3.0)
    assert "prefix_cache" not in bare.to_json()  # what older routers expect to read
    old_publisher = '{"running":1,"waiting":2,"kv_usage":0.5,"wall_ts":3.0}'
    assert LoadSample.from_json(old_publisher) == bare
    with pytest.raises(ValueError):
        LoadSample.from_json('{"running":1,"waiting":2,"kv_usage":0.5,"wall_ts":3,'
                             '"prefix_cache_hits":"x"}')  # fmt: skip


def test_counter_values_that_are_not_counts_are_dropped() -> None:
    page = VLLM_V1_COUNTERS.replace("} 1000.0", "} NaN").replace("} 640.0", "} -1.0")
    assert parse_engine_metrics(page)[0].prefix_cache_queries is None
    assert parse_engine_metrics(page)[0].prefix_cache_hits is None


@pytest.mark.parametrize("how", ["content_length", "chunked", "gzip_bomb"])
async def test_oversized_metrics_pages_are_refused_without_reading_them_whole(how: str) -> None:
    """A replica's page is read at most MAX_PAGE_BYTES (after decompression) and refused."""
    import gzip

    import aiohttp
    from aiohttp import web

    from router.publisher.scrape import MAX_PAGE_BYTES, fetch_page
    from tests.ports import free_port

    big = b"# junk\n" * (MAX_PAGE_BYTES // 7 + 10)

    async def page(request: web.Request) -> web.StreamResponse:
        if how == "content_length":
            return web.Response(body=big)
        if how == "gzip_bomb":  # ignores Accept-Encoding: identity
            blob = gzip.compress(big * 4)
            return web.Response(body=blob, headers={"Content-Encoding": "gzip"})
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(0, len(big), 65536):
            await resp.write(big[i : i + 65536])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", page)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(ValueError, match="over"):
                await fetch_page(session, f"http://127.0.0.1:{port}/metrics")
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("value", "taken"), [("NaN", 0.0), ("+Inf", 1.0), ("-0.3", 0.0), ("1.7", 1.0)]
)
def test_kv_usage_outside_the_unit_range_is_clamped(value: str, taken: float) -> None:
    """A gauge an engine has nothing for yet reads NaN: it must not reach the router (NaN
    compares false with everything, so no score would ever win)."""
    page = VLLM_DP.replace(
        'engine="1",model_name="m"} 0.25', f'engine="1",model_name="m"}} {value}'
    )
    assert parse_engine_metrics(page)[1] == ScrapedLoad(1, 0, taken)


@pytest.mark.parametrize(("value", "taken"), [("NaN", 0), ("+Inf", 0), ("-2", 0), ("3.9", 3)])
@pytest.mark.parametrize("line", [1, 0], ids=["running", "waiting"])
def test_a_request_count_that_is_not_a_count_does_not_refuse_the_page(
    value: str, taken: int, line: int
) -> None:
    """One rank's running or waiting gauge reading NaN or infinite (an engine with nothing
    to report for it yet) must not cost every rank its load report, nor a negative one go
    on as a count: it counts as 0, as a NaN kv usage does."""
    old = {1: 'running{engine="1",model_name="m"} 1.0', 0: 'waiting{engine="1",model_name="m"} 0.0'}
    page = VLLM_DP.replace(old[line], old[line].rsplit(" ", 1)[0] + " " + value)
    loads = parse_engine_metrics(page)
    assert loads[0] == ScrapedLoad(4, 2, 0.5)
    assert (loads[1].running, loads[1].waiting) == ((taken, 0) if line else (1, taken))


FULL_PAGE = (
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="m"} 4.0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{engine="0",model_name="m"} 12.0\n'
)


@pytest.mark.parametrize("framing", ["none", "content_length", "chunked"])
async def test_a_page_cut_short_is_refused_not_read_as_a_smaller_figure(framing: str) -> None:
    """A connection that drops mid-page: ``waiting`` 12 cut to ``1`` must not be read as 1.
    With a Content-Length or chunked body the client sees the body end early; a response
    delimited by the connection's close alone (HTTP/1.1 allows it) cannot tell, but the
    exposition format ends every line, the last one too, with a line feed."""
    import asyncio

    import aiohttp

    from router.publisher.scrape import fetch_page

    cut = FULL_PAGE.encode()[: FULL_PAGE.index("12.0") + 1]
    assert cut.endswith(b"} 1") and parse_engine_metrics(cut.decode())[0].waiting == 1

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
        if framing == "content_length":
            head += f"Content-Length: {len(FULL_PAGE)}\r\n"
            body = cut
        elif framing == "chunked":
            head += "Transfer-Encoding: chunked\r\n"
            body = b"%x\r\n%s\r\n" % (len(cut), cut)  # no last chunk: the page goes on
        else:
            body = cut
        writer.write(head.encode() + b"\r\n" + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises((ValueError, aiohttp.ClientPayloadError)):
                await fetch_page(session, f"http://127.0.0.1:{port}/metrics")
    finally:
        server.close()
        await server.wait_closed()


async def test_a_whole_page_closed_by_the_connection_is_read() -> None:
    """The same server, the page whole: read (the check refuses only a page cut short)."""
    import asyncio

    import aiohttp

    from router.publisher.scrape import fetch_page

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + FULL_PAGE.encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            text = await fetch_page(session, f"http://127.0.0.1:{port}/metrics")
        assert parse_engine_metrics(text)[0] == ScrapedLoad(4, 12, 0.5)
    finally:
        server.close()
        await server.wait_closed()
