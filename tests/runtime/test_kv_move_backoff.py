"""A prefill/decode move that the decode replica refuses is not tried again
on every decode step (wire-2 §3.12; issue 37, part 4), over real loopback
sockets: a prefill and a decode first-stage replica in front of one last
stage, a gateway over the two.

The decode replica's KV budget cannot hold the session: each try of the
move costs the prefill replica a whole export, and is refused. The session
decodes at the prefill replica with the bits a chain without roles computes,
and the moves tried grow with the log of the time, not with the steps.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from meshnet_model.testing import small_config, write_checkpoint
from meshnet_runtime.replicas.handoff import MoveBackoff
from support.handoff_chain import handoff_chain, random_prompt, split_reference
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

PROMPT = 20
STEPS = 12
# The decode replica's budget is smaller than the prompt's KV (10 KiB).
ROLES = (["--kv-role", "prefill"], ["--kv-role", "decode", "--kv-budget-bytes", "4096"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("move-backoff") / "model"
    write_checkpoint(path, small_config(max_position_embeddings=128), seed=17)
    return str(path)


def _prompt(vocab: int) -> np.ndarray:
    return random_prompt(vocab, PROMPT, seed=4)


def _reference(checkpoint: str) -> list[np.ndarray]:
    return split_reference(checkpoint, _prompt(small_config().vocab_size), STEPS)


async def test_a_refused_move_backs_off_and_the_session_decodes_where_it_is(
    checkpoint: str,
) -> None:
    want = _reference(checkpoint)
    vocab = small_config().vocab_size
    async with handoff_chain(checkpoint, ROLES) as (entries, hop, client):
        await wait_until(  # registration: the roles come with the identities
            lambda: {r.kv_role for r in hop.replicas} == {"prefill", "decode"}, "the roles"
        )
        prefill, decode = entries
        started = anyio.current_time()
        with anyio.fail_after(60):
            first = await client.forward(_prompt(vocab), encoding="identity")
            got = [first.output]
            for position in range(PROMPT, PROMPT + STEPS):
                step = np.asarray([[int(np.argmax(got[-1]))]], dtype=np.int32)
                result = await client.forward(
                    step, session=first.session, position=position, encoding="identity"
                )
                got.append(result.output)
        elapsed = anyio.current_time() - started
        # Tries 1 s apart, then 2, 4, ...: one at the first step, one more per doubling.
        tries = hop.failover.handoffs.failed
        assert 1 <= tries <= 2 + int(np.log2(1 + elapsed)), (tries, elapsed)
        assert tries < STEPS // 2  # before: one export and refused import every step
        assert hop.failover.handoffs.moved == 0
        assert hop.holder(first.session) == prefill.url
        assert prefill.app.tokens_computed == PROMPT + STEPS  # it decoded where it was
        assert decode.app.tokens_computed == 0
    for mine, reference in zip(got, want, strict=True):
        assert np.array_equal(mine, reference)


def test_the_backoff_doubles_to_its_longest_then_gives_up() -> None:
    now = [100.0]
    backoff = MoveBackoff(first=1.0, longest=4.0, give_up=5, limit=2, clock=lambda: now[0])
    assert backoff.due("s")
    waits = []
    for _ in range(4):
        backoff.failed("s")
        assert not backoff.due("s")
        start = now[0]
        while not backoff.due("s"):
            now[0] += 0.5
        waits.append(now[0] - start)
    assert waits == [1.0, 2.0, 4.0, 4.0]
    backoff.failed("s")  # the fifth: the session stays where it is
    now[0] += 3600
    assert not backoff.due("s")
    backoff.forget("s")  # it ended (or moved): a new start
    assert backoff.due("s")
    for session in ("a", "b", "c"):  # at most ``limit`` remembered: the oldest goes
        backoff.failed(session)
    assert backoff.due("a") and not backoff.due("b") and not backoff.due("c")
