"""`indexer.FleetIndex` against several real vLLM workers at once.

The driver records fleets: workers with different cache layouts (a rolling upgrade, several
models) or replicas of one model, fed overlapping traffic (each request goes to some of them),
every worker publishing through its own vLLM `ZmqEventPublisher`. At each probe, vLLM's native
hit of every worker is known; one `FleetIndex.score` call must give all of them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from vllm_recording import FLEETS, converted, probe_namespace

from kvroute.indexer import FleetIndex

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def fleets_by_name(vllm_recording: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {fleet["name"]: fleet for fleet in vllm_recording["fleets"]}


@pytest.mark.parametrize("name", FLEETS)
def test_fleet_index_matches_every_vllm_worker(
    fleets_by_name: dict[str, dict[str, Any]], name: str
) -> None:
    fleet = fleets_by_name[name]
    batches = {w: list(converted(worker)) for w, worker in fleet["workers"].items()}
    index = FleetIndex(hash_unit=16)
    applied = Counter[str]()
    wrong = []
    hits = Counter[str]()
    for probe in fleet["probes"]:
        for worker, after in probe["after"].items():
            while applied[worker] < after:
                index.apply(worker, batches[worker][applied[worker]])
                applied[worker] += 1
        scores = index.score(probe["tokens"], probe_namespace(probe))
        for worker, native in probe["hits"].items():
            expected = native if probe["after"][worker] else None
            got = scores.get(worker)
            hits[worker] += native > 0
            if got != expected:
                wrong.append(
                    f"{probe['label']!r} ({len(probe['tokens'])} tokens) on {worker}: vLLM "
                    f"{expected} per group {probe['per_group'][worker]}, FleetIndex {got}"
                )
    total = len(fleet["probes"]) * len(fleet["workers"])
    print(f"{name}: FleetIndex agrees on {total - len(wrong)} of {total} (probe, worker) pairs")
    # Overlapping traffic: every worker has hits to get right.
    assert all(hits[w] > 10 for w in fleet["workers"]), hits
    assert not wrong, f"{len(wrong)} of {total} differ:\n" + "\n".join(wrong[:10])
