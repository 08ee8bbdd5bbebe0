"""Usage on every stream (router.service.stream_usage): the request asks the engine for it,
the client that did not ask never sees the usage chunk, whatever the piece boundaries."""

from __future__ import annotations

import json

import pytest

from router.service.stream_usage import UsageFilter, usage_patch, with_patch

TOKEN = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = (
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1,'
    b'"prompt_tokens_details":{"cached_tokens":8}}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def test_patch_asks_for_usage_and_keeps_the_clients_options() -> None:
    for body in (
        {"stream": True, "model": "m"},
        {"stream": True, "stream_options": {"continuous_usage_stats": True}},
        {"stream": True, "stream_options": {"include_usage": False}},
    ):
        raw = json.dumps(body).encode()
        patch = usage_patch(body)
        assert patch is not None
        sent = json.loads(with_patch(raw, patch))
        assert sent["stream_options"]["include_usage"] is True
        assert {k: v for k, v in sent.items() if k != "stream_options"} == {
            k: v for k, v in body.items() if k != "stream_options"
        }
        kept = {
            k: v
            for k, v in (body.get("stream_options") or {}).items()
            if k not in ("include_usage", "continuous_usage_stats")
        }
        assert sent["stream_options"].items() >= kept.items()
        # usage in every chunk only comes with include_usage: the client asked for none
        assert not sent["stream_options"].get("continuous_usage_stats")
    assert json.loads(with_patch(b"{}", b',"a":1')) == {"a": 1}
    for body in (
        {"stream": False},
        {"model": "m"},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"stream": True, "stream_options": "odd"},
    ):
        assert usage_patch(body) is None


@pytest.mark.parametrize("piece", [1, 2, 5, 17, 64, 4096])
def test_filter_removes_only_the_usage_chunk(piece: int) -> None:
    stream = TOKEN * 3 + USAGE + DONE
    f = UsageFilter()
    out = b"".join(f.feed(stream[i : i + piece]) for i in range(0, len(stream), piece))
    assert out + f.flush() == TOKEN * 3 + DONE


@pytest.mark.parametrize("piece", [1, 2, 5, 17, 64, 4096])
def test_a_filter_that_keeps_usage_only_holds_cut_events(piece: int) -> None:
    """``drop_usage=False`` (a stream whose client asked for usage): every event goes out,
    the usage chunk too, each only once it is whole."""
    stream = TOKEN * 3 + USAGE + DONE[:-2]  # the last event's end missing: held till flush
    f = UsageFilter(drop_usage=False)
    outs = [f.feed(stream[i : i + piece]) for i in range(0, len(stream), piece)]
    assert all(out.endswith(b"\n\n") for out in outs if out)
    assert b"".join(outs) + f.flush() == stream
    cut = UsageFilter(drop_usage=False)
    assert cut.feed(TOKEN + USAGE[:20]) == TOKEN
    assert cut.pending() == b""  # what a stream that broke off there still relays


def test_filter_keeps_usage_inside_content_chunks_and_odd_events() -> None:
    continuous = b'data: {"choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":1}}\n\n'
    text = b'data: {"choices":[{"delta":{"content":"\\"usage\\""}}]}\n\n'
    f = UsageFilter()
    assert f.feed(continuous + text + b"data: not json usage\n\n") == (
        continuous + text + b"data: not json usage\n\n"
    )


@pytest.mark.parametrize("piece", [1, 2, 5, 17, 64, 4096])
def test_crlf_streams_are_filtered_as_lf_ones(piece: int) -> None:
    """Events ended by CRLF blank lines: the usage chunk is taken out, cut events held."""

    def crlf(event: bytes) -> bytes:
        return event.replace(b"\n\n", b"\r\n\r\n")

    stream = crlf(TOKEN * 3 + FINAL + FP_USAGE + DONE)
    f = UsageFilter()
    outs = [f.feed(stream[i : i + piece]) for i in range(0, len(stream), piece)]
    assert all(out.endswith(b"\r\n\r\n") for out in outs if out)
    stamped = crlf(FINAL).replace(b"}]}", b'}],"system_fingerprint":"vllm-0.34"}')
    assert b"".join(outs) + f.flush() == crlf(TOKEN * 3) + stamped + crlf(DONE)


@pytest.mark.parametrize("piece", [1, 5, 4096])
def test_the_first_event_end_tells_how_a_stream_ends_its_lines(piece: int) -> None:
    """An LF stream stays one when an odd event later ends with CRLF: nothing is lost or
    reordered, and the usage chunk still goes."""
    odd = b"data: {}\r\n\r\n"
    stream = TOKEN + odd + TOKEN + USAGE + DONE
    f = UsageFilter()
    out = b"".join(f.feed(stream[i : i + piece]) for i in range(0, len(stream), piece))
    assert out + f.flush() == TOKEN + odd + TOKEN + DONE


def test_bare_cr_streams_are_relayed_untouched() -> None:
    cr = TOKEN.replace(b"\n", b"\r") + USAGE.replace(b"\n", b"\r")
    f = UsageFilter()
    assert f.feed(cr) + f.flush() == cr


def _event(obj: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


FINAL = _event({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
FP_USAGE = _event(
    {"id": "c", "choices": [], "usage": {"prompt_tokens": 9}, "system_fingerprint": "vllm-0.34"}
)


@pytest.mark.parametrize("piece", [1, 2, 5, 17, 64, 4096])
def test_the_usage_chunks_fingerprint_goes_to_the_chunk_that_ends_the_choice(piece: int) -> None:
    """vLLM moves ``system_fingerprint`` from the chunk that ends a choice to the usage chunk
    when the stream has one: taking that chunk out gives the fingerprint back."""
    stream = TOKEN * 2 + FINAL + FP_USAGE + DONE
    f = UsageFilter()
    out = b"".join(f.feed(stream[i : i + piece]) for i in range(0, len(stream), piece))
    out += f.flush()
    events = out.split(b"\n\n")
    assert out.startswith(TOKEN * 2) and out.endswith(DONE) and len(events) == 5
    final = json.loads(events[2][5:])
    assert final == {**json.loads(FINAL[5:]), "system_fingerprint": "vllm-0.34"}


def test_a_chunk_that_ends_a_choice_waits_for_the_next_event_only() -> None:
    f = UsageFilter()
    assert f.feed(TOKEN + FINAL) == TOKEN  # held: a usage chunk may follow
    assert f.feed(TOKEN) == FINAL + TOKEN  # another choice's token: no fingerprint to give
    assert f.feed(FINAL) == b""
    assert f.flush() == FINAL  # the stream's end
    stamped = FINAL.replace(b'"id"', b'"system_fingerprint":"x","id"')
    f = UsageFilter()
    assert f.feed(stamped) == b"" and f.feed(FP_USAGE + DONE) == stamped + DONE  # has one
    f = UsageFilter()
    assert f.feed(FINAL) == b"" and f.pending() == FINAL and f.flush() == b""


def test_lax_flags_are_read_as_vllm_reads_them() -> None:
    """``include_usage: "true"`` asked for usage (nothing to add, nothing to take out); a
    value vLLM refuses is left for it to refuse; ``"stream": "yes"`` is a stream."""
    for options in ({"include_usage": "true"}, {"include_usage": 1}, {"include_usage": "x"}):
        assert usage_patch({"stream": True, "stream_options": options}) is None
    assert usage_patch({"stream": True, "stream_options": {"continuous_usage_stats": 2}}) is None
    for stream, options in (
        ("yes", {"include_usage": "off"}),
        (1, {"include_usage": 0, "continuous_usage_stats": "on"}),
    ):
        patch = usage_patch({"stream": stream, "stream_options": options})
        assert patch is not None
        merged = json.loads(patch[len(b',"stream_options":') :])
        assert merged["include_usage"] is True and not merged.get("continuous_usage_stats")
    assert usage_patch({"stream": "false"}) is None


def test_lax_values_are_what_pydantic_makes_of_them() -> None:
    pydantic = pytest.importorskip("pydantic")
    from router.tokenize.lax import INVALID, lax_bool, lax_int

    class Request(pydantic.BaseModel):  # type: ignore[name-defined,misc]
        flag: bool | None = None
        number: int | None = None

    values: list[object] = [
        *(True, False, None, 0, 1, 2, -1, 0.0, -0.0, 1.0, 0.5, 5.0, 5.5, 1e20, 2**70),
        *(float("nan"), float("inf"), [], {}, "", " yes", "YES", "Off", "maybe", "1.0"),
        *("yes", "true", "on", "y", "t", "1", "0", "off", "no", "n", "f", "false"),
        *("5", " 5 ", "+5", "-5", "+-5", "5_0", "_5", "5_", "1e3", "0x10", " 5.00 ", "5."),
        *("-0", ".5", "5.0.0", "\u0661\u0662", "5 0", "5.10"),
    ]
    for value in values:
        for field, lax in (("flag", lax_bool), ("number", lax_int)):
            try:
                expected = getattr(Request(**{field: value}), field)
            except pydantic.ValidationError:
                expected = INVALID
            got = lax(value)
            assert got == expected and type(got) is type(expected), (field, value, got)


@pytest.mark.parametrize(
    "options",
    [{}, {"continuous_usage_stats": True}, {"include_usage": None}, {"include_usage": True}],
)
def test_the_router_asks_for_usage_exactly_where_vllm_would_give_none(
    options: dict[str, object],
) -> None:
    """vLLM 0.34's own ``StreamOptions`` (run unmodified) decides whether the client asked:
    its ``include_usage`` defaults to false, so a ``stream_options`` without it asked for
    no usage, and the router adds it (and takes the chunk out again)."""
    from tests.engines import anthropic_ref

    chat = anthropic_ref.load()["vllm.entrypoints.openai.chat_completion.protocol"]
    asked = chat.StreamOptions.model_validate(options).include_usage
    patch = usage_patch({"stream": True, "stream_options": options})
    assert (patch is None) == bool(asked), (options, asked)
