"""Settings that would be silently wrong: a value of the wrong type taken as another
(``"false"`` as true), a section that is not a table read as empty, an environment
override naming a model the configuration does not have. Each is a ConfigError naming
the key (or the variable)."""

from __future__ import annotations

from typing import Any

import pytest

from router.core.errors import ConfigError
from router.service.config import build_settings


@pytest.mark.parametrize(
    ("policy", "params", "needle"),
    [
        ("vllm_kv_aware", {"speculates": "false"}, "models.m.policy_params.speculates"),
        ("vllm_kv_aware", {"max_sessions": 1.5}, "models.m.policy_params.max_sessions"),
        ("vllm_kv_aware", {"max_sessions": "7"}, "models.m.policy_params.max_sessions"),
        ("sglang", {"balance_abs_threshold": 2.5}, "balance_abs_threshold"),
        ("dynamo", {"temperature": "hot"}, "models.m.policy_params.temperature"),
        ("dynamo", {"temperature": True}, "models.m.policy_params.temperature"),
        ("ours", {"uses_session_hints": "no"}, "models.m.policy_params.uses_session_hints"),
        ("ours", {"cost": 1}, "models.m.policy_params.cost"),
        ("ours", {"cost": {"prefill_s_per_token": "1"}}, "policy_params.cost"),
    ],
)
def test_policy_params_of_the_wrong_type_are_refused(
    policy: str, params: dict[str, Any], needle: str
) -> None:
    """A policy parameter is of its declared type: a string "false" for a boolean would be
    true, a float for an integer count or a string for a weight would reach the routing."""
    with pytest.raises(ConfigError) as info:
        build_settings({"models": {"m": {"policy": policy, "policy_params": params}}})
    assert needle in str(info.value)


def test_policy_params_of_the_right_type_still_load() -> None:
    settings = build_settings(
        {
            "models": {
                "m": {"policy": "vllm_kv_aware", "policy_params": {"speculates": False}},
                "n": {"policy": "dynamo", "policy_params": {"temperature": 1}},
            }
        }
    )
    assert settings.models["m"].policy_params == {"speculates": False}
    assert settings.models["n"].policy_params == {"temperature": 1}
