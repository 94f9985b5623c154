"""uvicorn's concurrency-limit warnings: each counted, one logged per interval."""

from __future__ import annotations

import logging

import pytest

from kvroute.router.edge.refusals import (
    CONCURRENCY_LIMIT_MESSAGE,
    UVICORN_LOGGER,
    ConcurrencyRefusals,
    counting_refusals,
)


def test_each_refusal_counted_one_line_per_interval() -> None:
    counted: list[int] = []
    now = [0.0]
    refusals = ConcurrencyRefusals(lambda: counted.append(1), interval_s=10.0, clock=lambda: now[0])

    def passes(msg: str) -> bool:
        record = logging.LogRecord(UVICORN_LOGGER, logging.WARNING, "", 0, msg, (), None)
        return refusals.filter(record) and bool(record.getMessage())

    assert passes(CONCURRENCY_LIMIT_MESSAGE)
    assert not any(passes(CONCURRENCY_LIMIT_MESSAGE) for _ in range(99))
    assert passes("something else")  # other lines are not touched
    assert len(counted) == 100
    now[0] = 10.0
    record = logging.LogRecord(
        UVICORN_LOGGER, logging.WARNING, "", 0, CONCURRENCY_LIMIT_MESSAGE, (), None
    )
    assert refusals.filter(record)
    assert record.getMessage() == f"{CONCURRENCY_LIMIT_MESSAGE} (99 similar suppressed)"
    assert len(counted) == 101


def test_filter_installed_only_while_serving(caplog: pytest.LogCaptureFixture) -> None:
    counted: list[int] = []
    logger = logging.getLogger(UVICORN_LOGGER)
    with caplog.at_level(logging.WARNING, UVICORN_LOGGER):
        with counting_refusals(lambda: counted.append(1)):
            for _ in range(3):
                logger.warning(CONCURRENCY_LIMIT_MESSAGE)
        logger.warning(CONCURRENCY_LIMIT_MESSAGE)
    assert len(counted) == 3
    assert [r.getMessage() for r in caplog.records] == [CONCURRENCY_LIMIT_MESSAGE] * 2
