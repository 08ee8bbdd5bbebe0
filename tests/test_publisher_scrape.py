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
