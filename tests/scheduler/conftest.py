"""Fixtures shared by the real-scheduler tests (``test_orderings.py``, ``test_fences.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.scheduler.real_scheduler import RealEngine


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The fake forward's tensor arithmetic on one thread: on the shared 2-core machine, two intra-op threads
    made each step 30x slower (spinning against the tier's threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Callable[..., RealEngine]]:
    """``engine(**config)``: a :class:`RealEngine` on a fresh file tier, closed at teardown."""
    made: list[RealEngine] = []

    def make(**config: object) -> RealEngine:
        made.append(RealEngine(tmp_path / f"tier-{len(made)}", **config))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for eng in made:
        eng.close()
