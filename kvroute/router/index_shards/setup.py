"""Building the shard-backed index for one router process from its config."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from kvroute.router.config import RouterConfig
from kvroute.router.index_shards.client import ShardedIndexView
from kvroute.router.index_shards.control import ShardedEvents
from kvroute.router.index_shards.server import ShardSettings
from kvroute.router.index_shards.supervisor import DIR_ENV, ShardSupervisor, socket_path


def shard_settings(cfg: RouterConfig) -> ShardSettings:
    return ShardSettings(
        hash_unit=cfg.policy.hash_unit,
        events=cfg.events,
        release_after_s=cfg.index.release_after_s,
        log_level=cfg.log_level,
    )


def supervisor_for(cfg: RouterConfig) -> ShardSupervisor:
    """The host's shard supervisor (not started)."""
    return ShardSupervisor(
        cfg.index.processes, shard_settings(cfg), restart_max_s=cfg.index.restart_max_s
    )


@dataclass(slots=True)
class ShardedIndex:
    view: ShardedIndexView
    events: ShardedEvents
    supervisor: ShardSupervisor | None  # this process's own: started and stopped with the app


def build_sharded(
    cfg: RouterConfig,
    registry: CollectorRegistry,
    clock: Callable[[], float] = time.monotonic,
) -> ShardedIndex:
    """The view and event feed over the host's shards: those of the directory in DIR_ENV
    (started by `kvroute serve` for its router processes), else shards of our own."""
    directory = os.environ.get(DIR_ENV)
    supervisor = None
    if not directory:
        supervisor = supervisor_for(cfg)
        directory = supervisor.directory
    paths = [socket_path(directory, i) for i in range(cfg.index.processes)]
    view = ShardedIndexView(
        paths, cfg.policy.hash_unit, deadline_s=cfg.index.deadline_s, registry=registry
    )
    events = ShardedEvents(
        view,
        paths,
        status_interval_s=cfg.index.status_interval_s,
        registry=registry,
        clock=clock,
    )
    return ShardedIndex(view, events, supervisor)
