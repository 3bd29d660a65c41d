"""BankPool with free banks of different sizes (found by ``make demo``: loads of different sizes on the bench model)."""

from __future__ import annotations

import pytest

from range_connector.banks import BankPool

MIB = 1 << 20


@pytest.mark.timeout(30)
@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="BankPool.acquire removes a buffer with list.remove, which compares tensors with ==: "
                          "free banks of different sizes raise, and the bank slot taken before is never given back")
def test_acquire_picks_among_free_banks_of_different_sizes() -> None:
    pool = BankPool(2)
    large, small = pool.acquire(4 * MIB, 1.0), pool.acquire(2 * MIB, 1.0)
    pool.release(large)
    pool.release(small)
    bank = pool.acquire(2 * MIB, 1.0)  # the smallest that fits is second in the free list
    assert bank.buffer.numel() == 2 * MIB
    pool.release(bank)
    assert pool.in_use == 0
