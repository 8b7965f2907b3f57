"""One live fleet (agent + ``kvherd serve`` under traffic) shared by the operator tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from live_fleet import LiveFleet, live_fleet


@pytest.fixture(scope="session")
def fleet() -> Iterator[LiveFleet]:
    with live_fleet() as running:
        yield running
