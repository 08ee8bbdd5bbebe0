"""Discrete-event simulator that replays traces through router.core's policies."""
