"""ByteBudget: tensor bytes held for requests in flight, bounded across peers."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet_proto import CapacityError, WireHeaders
from meshnet_proto._budget import ByteBudget, request_cost
from meshnet_proto._codec import zstd_body_bound


def headers(encoding: str = "identity", tokens: int = 16) -> WireHeaders:
    array = np.zeros((1, tokens, 64), dtype=np.float32)
    return WireHeaders.for_array(array, encoding=encoding)


def test_request_cost_is_the_tensor_and_for_zstd_also_its_compressed_body() -> None:
    h = headers()
    assert request_cost(h) == h.nbytes == 16 * 64 * 4
    z = headers("zstd")
    assert request_cost(z) == z.nbytes + zstd_body_bound(z.nbytes)


def test_reservations_add_up_and_a_full_budget_is_503_memory_full() -> None:
    budget = ByteBudget(1000, retry_after=3)
    first = budget.reserve(600)
    second = budget.reserve(400)
    assert budget.in_use == 1000
    with pytest.raises(CapacityError) as caught:
        budget.reserve(1)
    err = caught.value
    assert (err.status, err.code, err.retry_after) == (503, "memory_full", 3)
    assert "1,000" in err.message
    first.release()
    first.release()  # idempotent: released bytes are not given back twice
    assert budget.in_use == 400
    with budget.reserve(600):
        assert budget.in_use == 1000
    second.release()
    assert budget.in_use == 0
    assert budget.peak == 1000


def test_one_request_larger_than_the_budget_gets_in_alone() -> None:
    budget = ByteBudget(100)
    big = budget.reserve(10_000)  # nothing else held: let it through, alone
    with pytest.raises(CapacityError):
        budget.reserve(1)
    big.release()
    budget.reserve(100).release()


@pytest.mark.parametrize("limit", [0, -5, True, 1.5])
def test_a_budget_needs_a_positive_int(limit: object) -> None:
    with pytest.raises(ValueError, match="positive int"):
        ByteBudget(limit)  # type: ignore[arg-type]


def test_negative_reservations_are_a_bug() -> None:
    with pytest.raises(ValueError, match="negative"):
        ByteBudget(10).reserve(-1)
