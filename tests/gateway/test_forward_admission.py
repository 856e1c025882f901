"""``/forward`` through the gateway's admission (issue 37): a run holds a
running place and its prefill budget, gives both back however it ends, and
a refusal is wire 2's 503 ``gateway_busy`` with ``Retry-After``."""

from __future__ import annotations

import pytest

from meshnet_gateway.admission import Admission
from meshnet_gateway.forward_admission import admitted
from meshnet_proto import CapacityError
from meshnet_runtime.deadlines import Deadline

pytestmark = pytest.mark.anyio


def _admission(**overrides: int) -> Admission:
    budgets = {"max_running": 1, "max_prefill_tokens": 64, "max_queued": 0, **overrides}
    return Admission(**budgets, queue_timeout=5.0)


async def test_a_run_holds_its_place_and_gives_it_back() -> None:
    admission = _admission()
    async with admitted(admission, 10, "alice", Deadline.after(5)):
        assert admission.running == 1 and admission.prefill_tokens == 10
        with pytest.raises(CapacityError) as caught:
            async with admitted(admission, 1, "bob", Deadline.after(5)):
                pass  # pragma: no cover - never admitted
        assert (caught.value.status, caught.value.code) == (503, "gateway_busy")
        assert caught.value.retry_after is not None and caught.value.retry_after >= 1
    assert admission.running == 0 and admission.prefill_tokens == 0


async def test_a_failed_run_gives_its_place_back_too() -> None:
    admission = _admission()
    with pytest.raises(RuntimeError):
        async with admitted(admission, 10, "alice", Deadline.after(5)):
            raise RuntimeError("the chain failed")
    assert admission.running == 0 and admission.prefill_tokens == 0


async def test_a_refused_prefill_grant_gives_the_running_place_back() -> None:
    admission = _admission(max_running=2, max_prefill_tokens=8)
    async with admitted(admission, 8, "alice", Deadline.after(5)):
        with pytest.raises(CapacityError) as caught:
            async with admitted(admission, 8, "bob", Deadline.after(0.05)):
                pass  # pragma: no cover - never admitted
        assert caught.value.code == "gateway_busy"
        assert admission.running == 1
    assert admission.running == 0
