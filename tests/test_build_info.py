"""``kvrouter_build_info`` says which build runs: the version, and whether the routing core and
the service's hot modules were imported compiled (CI runs this both ways, pure and after
``make compile``)."""

from __future__ import annotations

import re

import router
import router.core.routing
import router.service.proxy
from router.service.config import build_settings
from router.service.state import RouterState


def _is_extension(module: object) -> bool:
    return not str(getattr(module, "__file__", "")).endswith(".py")


def test_build_info_names_the_version_and_what_runs_compiled() -> None:
    page = RouterState(build_settings({"models": {"m": {}}})).metrics.render().decode()
    (line,) = [ln for ln in page.splitlines() if ln.startswith("kvrouter_build_info{")]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert labels["version"] == router.__version__
    expected = [
        name
        for name, module in (("core", router.core.routing), ("service", router.service.proxy))
        if _is_extension(module)
    ]
    assert labels["compiled"] == (",".join(expected) or "none")
    assert line.endswith(" 1.0")
