"""Numeric flags out of their range are usage errors while parsing (exit status 2, naming the
flag and the range; router/cliargs.py), before anything starts. Each case below was a
traceback, a run that never ended, or a run reporting figures of nothing."""

from __future__ import annotations

import pytest

from router.cli import build_parser


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The usage error's last line for ``kvrouter ARGV...``, which must not parse."""
    parser = build_parser(argv[0])
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("bench", "flag", "value"),
    [
        ("hash", "--reps", "0"),  # IndexError
        ("hash", "--tokens", "0"),  # figures of 0 blocks
        ("index", "--reps", "-1"),  # IndexError
        ("index", "--replicas", "0"),  # figures of an empty index
        ("index", "--unique-blocks", "-1"),  # ZeroDivisionError
        ("ingest", "--requests", "0"),  # ZeroDivisionError
        ("ingest", "--engine-block-size", "-1"),  # OverflowError
        ("store", "--event-blocks", "-1"),  # IndexError
        ("store", "--cluster", "-1"),  # RuntimeError from redis-cli
        ("store", "--shared-fraction", "nan"),
        ("tokenize", "--reps", "0"),  # IndexError
        ("tokenize", "--reuse", "inf"),  # OverflowError
        ("render", "--block-size", "0"),  # ZeroDivisionError
        ("body", "--reps", "0"),  # IndexError
        ("body", "--tokens", "1000,0"),
        ("grpc", "--sessions", "0"),  # IndexError
        ("grpc", "--seconds", "nan"),  # 0 picks, exit status 1
        ("grpc", "--seconds", "inf"),  # never ended
        ("reliability", "--replicas", "0"),  # ZeroDivisionError
        ("reliability", "--duration", "nan"),
        ("faults", "--rate", "0"),  # RuntimeError: Session is closed
        ("faults", "--duration", "-1"),  # rows of 0 requests
        ("proxy", "--seconds", "0"),
        ("admit", "--rounds", "0"),  # Infinity figures
        ("admit", "--requests", "0"),  # IndexError
        ("route", "--requests", "0"),  # ZeroDivisionError
        ("route", "--replicas", "0"),  # IndexError
        ("route", "--replicas", ","),  # no fleets
        ("scrape", "--scrapes", "0"),  # IndexError
        ("scrape", "--entries", "0"),  # ZeroDivisionError
        ("pods", "--speedup", "0"),
        ("stalls", "--rate", "inf"),
        ("longctx", "--tokens", "-5"),
        ("overload", "--priority-share", "-1"),
        ("overload", "--time-scale", "nan"),
        ("live", "--requests", "0"),  # taken as "the workload's default"
        ("live", "--speedup", "-1"),
    ],
)
def test_bench_flags_out_of_range_are_usage_errors(
    capsys: pytest.CaptureFixture[str], bench: str, flag: str, value: str
) -> None:
    last = _refused(capsys, "bench", bench, flag, value)
    assert last.startswith(f"kvrouter bench {bench}: error: argument {flag}: must "), last


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["demo", "--replicas", "0"], "--replicas"),  # a fleet of no replicas, never ended
        (["demo", "--kv-blocks", "0"], "--kv-blocks"),  # ZeroDivisionError
        (["demo", "--speedup", "nan"], "--speedup"),
        (["demo", "--max-output", "-1"], "--max-output"),
        (["demo", "--racks", "0"], "--racks"),
        (["demo", "--prefill-share", "inf"], "--prefill-share"),
        (["mock-replica", "--port", "-1"], "--port"),  # OverflowError from bind()
        (["mock-replica", "--block-size", "0"], "--block-size"),  # ZeroDivisionError
        (["mock-replica", "--engine-block-size", "-1"], "--engine-block-size"),  # served
        (["mock-replica", "--kv-blocks", "-5"], "--kv-blocks"),  # a cache of no blocks
        (["mock-replica", "--kv-blocks", "0"], "--kv-blocks"),
        (["mock-replica", "--cpu-blocks", "-1"], "--cpu-blocks"),
        (["mock-replica", "--default-max-tokens", "0"], "--default-max-tokens"),
        (["mock-replica", "--default-max-tokens", "-3"], "--default-max-tokens"),
        (["mock-replica", "--fault-retry-after", "-1"], "--fault-retry-after"),  # sent as is
    ],
)
def test_demo_and_mock_flags_out_of_range_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    last = _refused(capsys, *argv)
    assert f"error: argument {flag}: must " in last, last


def test_valid_values_still_parse() -> None:
    """The range's edges and the defaults: unchanged."""
    args = build_parser("bench").parse_args(
        ["bench", "index", "--unique-blocks", "0", "--shared", "0", "--reps", "1"]
    )
    assert (args.unique_blocks, args.shared, args.reps) == (0, 0, 1)
    args = build_parser("bench").parse_args(["bench", "body"])
    assert args.tokens == [1000, 20000, 60000, 1000000]
    args = build_parser("bench").parse_args(["bench", "store", "--shared-fraction", "1"])
    assert args.shared_fraction == 1.0 and args.cluster == 0
    args = build_parser("mock-replica").parse_args(["mock-replica", "--port", "0"])
    assert args.port == 0 and args.kv_blocks is None and args.cpu_blocks is None
    args = build_parser("mock-replica").parse_args(
        ["mock-replica", "--kv-blocks", "1", "--cpu-blocks", "0", "--default-max-tokens", "1"]
        + ["--fault-retry-after", "0"]
    )
    assert (args.kv_blocks, args.cpu_blocks, args.default_max_tokens) == (1, 0, 1)
    assert args.fault_retry_after == 0
    args = build_parser("bench").parse_args(["bench", "live", "--sim-samples", "0"])
    assert args.sim_samples == 0 and args.requests is None
