"""The start-up line of ``kvrouter serve``: where it listens, and how it routes each model
(exact or approximate prompts, which engine events reach its index, whose load it reads),
so a router that silently runs in approximate mode is visible in its first log lines."""

from __future__ import annotations

import logging

from router.service.state import RouterState

_log = logging.getLogger("kvrouter.service")


def describe(state: RouterState, host: str, port: int, max_connections: int) -> list[str]:
    """The lines :func:`log_startup` logs."""
    s = state.settings.server
    health = f"every {s.health_interval_s:g}s" if s.health_interval_s > 0 else "off"
    lines = [
        f"listening on http://{host}:{port}; at most {max_connections or 'unlimited'} "
        f"connections, idle ones closed after {s.keep_alive_timeout_s:g}s; active health "
        f"checks {health}; outlier ejection {'on' if s.outlier_detection else 'off'}"
    ]
    cfg = state.settings
    for model in sorted(state.processors):
        reps = [r for r in cfg.replicas if r.model == model]
        processor = state.processors[model]
        render = cfg.model(model)
        if render.render == "engine":
            where = render.render_url or "the model's replicas"
            mode = f"exact (rendered by the engine: {where}; the router's own stands in)"
        elif processor.exact:
            mode = f"exact (tokenizer {cfg.model(model).tokenizer})"
        else:
            mode = (
                "APPROXIMATE (no tokenizer: text prompts are hashed in character chunks and "
                f"never match engine events; set [models.{model}] tokenizer)"
            )
        zmq = sum(1 for r in reps if r.zmq)
        if s.redis_url:
            events = "engine events via Redis (publishers)"
        elif zmq:
            events = f"engine KV events over ZMQ from {zmq} of {len(reps)} replica(s)"
        else:
            events = "no engine events (the router's own predictions only)"
        scraped = sum(1 for r in reps if r.metrics_url)
        lines.append(
            f"model {model}: policy {cfg.model(model).policy}, {len(reps)} configured "
            f"replica(s), {mode}; {events}; engine metrics scraped from {scraped}"
        )
    return lines


def log_startup(state: RouterState, host: str, port: int, max_connections: int) -> None:
    for line in describe(state, host, port, max_connections):
        _log.info("%s", line)
