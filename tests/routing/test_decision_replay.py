"""Routing decisions on a recorded benchmark trace stay byte-identical.

The fixture holds the decision inputs of a seeded trace on dense, sliding-window and Mamba
fleets, for the default and a tuned TTFT configuration and every other policy, with the
decisions the policy made when it was recorded (`record_decisions.py` says how). Any change
to what the policy decides, the reason, its text, or a candidate's estimate fails here.
"""

from __future__ import annotations

import pytest

from tests.routing.decision_replay import FIXTURE, canonical, read_fixture, replay

_DATA = read_fixture()
_RUNS = {f"{r['profile']}-{r['scenario']}": r for r in _DATA["runs"]}


def test_the_fixture_is_small_and_covers_every_reason() -> None:
    assert FIXTURE.stat().st_size < 1_000_000
    reasons = {d["output"]["reason"] for r in _RUNS.values() for d in r["decisions"]}
    for reason in ("cache", "spill", "affinity", "session", "least_load", "round_robin"):
        assert reason in reasons
    profiles = {r["profile"] for r in _RUNS.values()}
    assert profiles == {"dense", "swa", "mamba"}
    assert all(len(r["decisions"]) >= 250 for r in _RUNS.values())


@pytest.mark.parametrize("run", sorted(_RUNS))
def test_replayed_decisions_are_byte_identical(run: str) -> None:
    recorded = _RUNS[run]["decisions"]
    want = "\n".join(canonical(d["output"]) for d in recorded).encode()
    got = "\n".join(replay(_RUNS[run])).encode()
    if got != want:
        for i, (a, b) in enumerate(zip(got.split(b"\n"), want.split(b"\n"), strict=True)):
            assert a == b, f"decision {i} of {run} differs"
    assert got == want
