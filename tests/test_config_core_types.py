"""Settings that land in router/core's dataclasses (``[models.NAME]`` routing keys and
``[models.NAME.busy]``) are type-checked as the service's own are: a wrong type is a
ConfigError naming the key, whether router/core is compiled or not."""

from __future__ import annotations

from typing import Any

import pytest

from router.core.errors import ConfigError
from router.service.config import build_settings


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ({"busy": {"max_in_flight": "x"}}, "models.m.busy.max_in_flight: expected int | None"),
        ({"busy": {"max_kv_usage": "high"}}, "models.m.busy.max_kv_usage: expected float"),
        ({"busy": {"reject_when_all_busy": "yes"}}, "models.m.busy.reject_when_all_busy"),
        ({"busy": {"max_cats": 1}}, "models.m.busy: unknown key 'max_cats'"),
        ({"speculative_ttl_s": "x"}, "models.m.speculative_ttl_s: expected float"),
        ({"session_ttl_s": True}, "models.m.session_ttl_s: expected float"),
        ({"hybrid": "true"}, "models.m.hybrid"),
        ({"reuse_window_s": "5m"}, "models.m.reuse_window_s: expected float"),
        ({"reuse_window_s": 0}, "models.m.reuse_window_s: expected a positive number"),
        ({"reuse_window_s": float("nan")}, "models.m.reuse_window_s: expected a positive number"),
        # exp(-horizon / inf) = 1: every evicting cache a certain loss whatever its horizon,
        # and with all caches full, turnover priced at nothing (sim --reuse-window-s refuses it)
        (
            {"reuse_window_s": float("inf")},
            "models.m.reuse_window_s: expected a positive number of seconds (finite), got inf",
        ),
    ],
)
def test_wrong_types_for_core_settings_name_the_key(table: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_settings({"models": {"m": table}})
    assert needle in str(info.value)


def test_core_settings_take_their_types_and_yaml_nulls() -> None:
    m = build_settings(
        {
            "models": {
                "m": {
                    "session_ttl_s": 60,  # an integer where a float is declared
                    "hybrid": None,  # YAML null: the default (learned)
                    "busy": {"max_in_flight": 8, "max_kv_usage": None},
                }
            }
        }
    ).model("m")
    assert m.routing.session_ttl_s == 60.0 and isinstance(m.routing.session_ttl_s, float)
    assert m.routing.hybrid is None and m.routing.busy.max_in_flight == 8


def test_reuse_window_reaches_the_routing_engines_turnover_meter() -> None:
    from router.core.index import PrefixIndex
    from router.core.load import LoadTracker
    from router.core.policies import Ours
    from router.core.routing import RoutingEngine
    from router.core.turnover import REUSE_WINDOW_S

    default = build_settings({"models": {"m": {}}}).model("m").routing
    assert default.reuse_window_s == REUSE_WINDOW_S
    routing = build_settings({"models": {"m": {"reuse_window_s": 60}}}).model("m").routing
    engine = RoutingEngine(PrefixIndex(), LoadTracker(), Ours(), routing)
    assert engine.turnover.reuse_window_s == 60.0
