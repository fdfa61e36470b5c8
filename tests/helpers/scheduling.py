"""Shared builders for scheduler tests."""

import dataclasses


def reconfigure(scheduler, **changes):
    """Give a built scheduler, its ranking and its preemption rule one new config (the engine's
    with ``changes``), as if it had been built with it; returns that config."""
    config = dataclasses.replace(scheduler.config, **changes)
    scheduler.config = scheduler.ranking.config = scheduler.preemption.config = config
    return config
