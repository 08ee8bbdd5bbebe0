"""The lock-free metric families expose what prometheus-client's own classes expose."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from router.service.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = (-64.0, -1.0, 0.0, 0.5, 1.0, 16.0, 1e6)


def _page(registry: CollectorRegistry) -> list[str]:
    return [ln for ln in generate_latest(registry).decode().splitlines() if "_created" not in ln]


def test_same_exposition_as_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    c1 = LoopCounter("t_requests", "Requests", ["model", "outcome"], registry=ours)
    c2 = Counter("t_requests", "Requests", ["model", "outcome"], registry=theirs)
    h1 = LoopHistogram("t_error", "Error", ["model"], registry=ours, buckets=BUCKETS)
    h2 = Histogram("t_error", "Error", ["model"], registry=theirs, buckets=BUCKETS)
    s1 = LoopHistogram("t_secs", "Secs", ["phase"], registry=ours, buckets=(0.001, 0.1, 10))
    s2 = Histogram("t_secs", "Secs", ["phase"], registry=theirs, buckets=(0.001, 0.1, 10))
    rng = random.Random(7)
    for _ in range(2000):
        model, outcome = rng.choice("ab"), rng.choice(["ok", "timeout"])
        amount = rng.choice([1, 2.5, 0])
        c1.labels(model, outcome).inc(amount)
        c2.labels(model, outcome).inc(amount)
        # bucket bounds themselves, values between them and beyond both ends
        v = rng.choice([*BUCKETS, -1e9, 1e9, rng.uniform(-100, 100)])
        h1.labels(model=model).observe(v)
        h2.labels(model=model).observe(v)
        secs = rng.choice([0.0, 0.001, 0.05, 3.0, 99.0])
        s1.labels(outcome).observe(secs)
        s2.labels(outcome).observe(secs)
    h1.labels("empty")
    h2.labels("empty")
    assert _page(ours) == _page(theirs)
    c1.remove("a", "ok")
    c2.remove("a", "ok")
    assert _page(ours) == _page(theirs)


def test_misuse_is_refused() -> None:
    reg = CollectorRegistry(auto_describe=True)
    c = LoopCounter("t_x", "X", ["a"], registry=reg)
    with pytest.raises(ValueError):
        c.labels("v").inc(-1)
    with pytest.raises(ValueError):
        c.labels("v", "w")
    with pytest.raises(ValueError):
        c.labels(b="v")
    with pytest.raises(KeyError):
        c.remove("never")
    with pytest.raises(ValueError):  # a second family of the same name in one registry
        LoopCounter("t_x", "X", ["a"], registry=reg)
    with pytest.raises(ValueError):
        LoopHistogram("t_h", "H", [], registry=reg, buckets=(1.0, 1.0))
    with pytest.raises(ValueError):  # prometheus-client refuses unsorted buckets too
        Histogram("t_u", "U", [], registry=CollectorRegistry(), buckets=(2.0, 1.0))


def test_buckets_must_ascend() -> None:
    reg = CollectorRegistry(auto_describe=True)
    with pytest.raises(ValueError):
        LoopHistogram("t_u", "U", [], registry=reg, buckets=(2.0, 1.0))
