"""A real `kvroute serve` in front of a simulated fleet (`kvroute sim fleet`), attacked over
loopback with more slow uploads than max_in_flight, more unread streams than the upstream pool
and more connections than uvicorn's limit_concurrency: a fresh request must get an answer
quickly throughout and a 200 soon after (kvroute/testbed/edge_attacks.py holds the attacks)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvroute.testbed import edge_attacks as atk
from kvroute.testbed.edge_target import MIB, Target, metric, sim_fleet, start_router, wait_metric
from kvroute.testbed.procs import ProcessGroup

# the edge bounds of the router under attack (small, so a short test reaches them)
LIMITS = {
    "KVROUTE_LIMITS__MAX_IN_FLIGHT": "16",
    "KVROUTE_LIMITS__MAX_BODY_BYTES": str(9 * MIB),
    "KVROUTE_LIMITS__UPSTREAM_CONNECTIONS": "4",
    "KVROUTE_EDGE__BODY_BYTES_IN_FLIGHT": str(16 * MIB),
    "KVROUTE_EDGE__BODY_READ_S": "1.0",
    "KVROUTE_EDGE__POOL_WAIT_S": "1.0",
    "KVROUTE_EDGE__WRITE_STALL_S": "1.0",
    "KVROUTE_EDGE__LIMIT_CONCURRENCY": "64",
    "KVROUTE_EDGE__CLIENT_SEND_BUFFER_BYTES": "16384",
}
POOL = int(LIMITS["KVROUTE_LIMITS__UPSTREAM_CONNECTIONS"])
CONNECTIONS = int(LIMITS["KVROUTE_EDGE__LIMIT_CONCURRENCY"])
# A non-reading client holds its stream until the kernel buffers between it and the router
# fill (~100 KB with the send buffer above), then write_stall_s: 1,500 tokens (~400 KB of
# events) always reach the stall, and keep the engines' wasted work short.
UNREAD_TOKENS = 1500
FRESH_DEADLINE_S = 5.0


BODY = 8 * MIB
BODIES = 32  # at once, against a budget of BODY_BUDGET // BODY of them
BODY_BUDGET = 64 * MIB
# The bodies' router: they may take their time, only the budget of body bytes bounds them.
BODY_LIMITS = {
    "KVROUTE_LIMITS__MAX_IN_FLIGHT": "64",
    "KVROUTE_LIMITS__MAX_BODY_BYTES": str(9 * MIB),
    "KVROUTE_LIMITS__UPSTREAM_CONNECTIONS": "16",
    "KVROUTE_EDGE__BODY_BYTES_IN_FLIGHT": str(BODY_BUDGET),
    "KVROUTE_EDGE__BODY_READ_S": "20",
    "KVROUTE_EDGE__LIMIT_CONCURRENCY": "128",
}
# Each admitted body may exist at once as the bytes received, its decoded JSON, the request
# sent upstream and its unsent rest: at most four copies of the budget (3.4 measured).
RSS_FACTOR = 4


@dataclass
class Routers:
    attacked: Target
    bodies: Target


@pytest.fixture(scope="module")
def routers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routers]:
    run_dir = tmp_path_factory.mktemp("edge")
    with ProcessGroup(run_dir) as pg:
        fleet = sim_fleet(pg, run_dir)
        attacked = start_router(pg, fleet, run_dir, LIMITS, "router")
        bodies = start_router(pg, fleet, run_dir, BODY_LIMITS, "bodies")
        yield Routers(attacked, bodies)


@pytest.fixture
def served(routers: Routers) -> Target:
    return routers.attacked


def test_slow_uploads_beyond_max_in_flight(served: Target) -> None:
    chat = served.url + "/v1/chat/completions"
    body = atk.chat_body(served.model)
    with atk.slow_uploads(served.host, served.port, 24, "/v1/chat/completions") as socks:
        fresh = atk.post(chat, body, timeout_s=3.0)
        assert fresh.status in (200, 503) and fresh.seconds < 2.0  # an answer, at once
        statuses = [atk.answered(s, 3.0) for s in socks]
    assert statuses.count(408) >= 16 - 1, statuses  # the ones admitted: read deadline
    assert set(statuses) <= {408, 503}, statuses
    ok, _ = atk.first_ok_within(chat, body, 3.0)
    assert ok.status == 200


def test_unread_streams_beyond_the_upstream_pool(served: Target) -> None:
    chat = served.url + "/v1/chat/completions"
    body = atk.chat_body(served.model)
    stalls_before = metric(served.url, "kvroute_errors_total", 'kind="write_stall"')
    disconnects = metric(served.url, "kvroute_client_disconnects_total", "")
    with atk.unread_streams(served.host, served.port, 2 * POOL, served.model, UNREAD_TOKENS):
        # every upstream connection is held by a client that reads nothing; the stall
        # timeout frees them while those clients are still connected
        ok, answers = atk.first_ok_within(chat, body, FRESH_DEADLINE_S)
        assert ok.status == 200, answers
        # until then each fresh request was answered at once (503 after pool_wait_s)
        assert all(a.status in (200, 503) and a.seconds < 2.0 for a in answers), answers
        # and every stream admitted upstream (at least a pool's worth) ends by the stall
        # timeout, not by its client leaving
        stalls = wait_metric(
            served.url, "kvroute_errors_total", 'kind="write_stall"', stalls_before + POOL
        )
        assert POOL <= stalls - stalls_before <= 2 * POOL
        assert metric(served.url, "kvroute_client_disconnects_total", "") == disconnects
    ok, _ = atk.first_ok_within(chat, body, 3.0)
    assert ok.status == 200


def test_connections_beyond_limit_concurrency(served: Target) -> None:
    chat = served.url + "/v1/chat/completions"
    body = atk.chat_body(served.model)
    refused_before = metric(served.url, "kvroute_errors_total", 'kind="concurrency_limit"')
    with atk.idle_connections(served.host, served.port, CONNECTIONS + 16):
        # uvicorn itself refuses, at once, without the app reading anything
        fresh = [atk.post(chat, body, timeout_s=3.0) for _ in range(5)]
        assert all(a.status == 503 and a.seconds < 1.0 for a in fresh), fresh
    # the flood gone, the router serves again (its connections are released as they close)
    ok, answers = atk.first_ok_within(chat, body, 3.0)
    assert ok.status == 200, answers
    refused = metric(served.url, "kvroute_errors_total", 'kind="concurrency_limit"')
    # each refusal counted (the /metrics scrapes themselves were not refused)
    assert refused - refused_before == 5 + sum(a.status == 503 for a in answers)
    # and logged once for all of them (uvicorn's own line, held back by the router)
    assert served.log.read_text().count("Exceeded concurrency limit") == 1


def test_large_bodies_at_once_stay_within_the_budget(routers: Routers) -> None:
    bodies = routers.bodies
    atk.large_bodies(bodies.host, bodies.port, 1, BODY, bodies.model)  # warm: first-use costs
    refused_before = metric(bodies.url, "kvroute_errors_total", 'kind="body_budget"')
    ok_before = metric(bodies.url, "kvroute_requests_total", 'status="200"')
    atk.reset_peak(bodies.pid)
    base_kib = atk.vm_kib(bodies.pid, "VmRSS")
    statuses = atk.large_bodies(bodies.host, bodies.port, BODIES, BODY, bodies.model)
    grown_mib = (atk.vm_kib(bodies.pid) - base_kib) / 1024
    # all are held at once (none finishes before all have started): the budget admits its
    # worth, the rest get 503 at once; every admitted one is answered, none is lost
    admitted = BODY_BUDGET // BODY
    assert sorted(statuses) == [200] * admitted + [503] * (BODIES - admitted), statuses
    refused = metric(bodies.url, "kvroute_errors_total", 'kind="body_budget"')
    assert refused - refused_before == BODIES - admitted
    assert metric(bodies.url, "kvroute_requests_total", 'status="200"') - ok_before == admitted
    assert grown_mib <= RSS_FACTOR * BODY_BUDGET / MIB, grown_mib
    # the budget is whole again
    assert (
        atk.large_bodies(bodies.host, bodies.port, admitted, BODY, bodies.model) == [200] * admitted
    )
