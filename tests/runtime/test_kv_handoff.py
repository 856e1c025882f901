"""Sessions moved between replicas by their KV (wire-2 §3.11, §3.12; issue
23), over real loopback sockets: two first-stage replicas in front of one
last stage, a gateway over the two.

* A drained replica's session goes on at the other by a KV hand-off: no
  chunk is replayed, the new replica computes only the new tokens, and the
  logits are the bits a chain without the drain computes.
* Prefill/decode: the prompt runs at the prefill replica, the session moves
  before its first one-token chunk, and every decode step runs at the
  decode replica, with the same bits.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from meshnet_gateway import Client
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_node import RunningNode
from support.handoff_chain import handoff_chain, random_prompt, split_reference
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

PROMPT = 20
STEPS = 3
ROLES_ANY = (["--kv-role", "any"], ["--kv-role", "any"])
ROLES_PD = (["--kv-role", "prefill"], ["--kv-role", "decode"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("handoff-chain") / "model"
    write_checkpoint(path, small_config(max_position_embeddings=128), seed=11)
    return str(path)


def _prompt(vocab: int) -> np.ndarray:
    return random_prompt(vocab, PROMPT, seed=2)


def _reference(checkpoint: str) -> list[np.ndarray]:
    return split_reference(checkpoint, _prompt(small_config().vocab_size), STEPS)


async def _generate(client: Client, vocab: int, session: str | None = None,
                    before_step: object = None) -> tuple[str, list[np.ndarray]]:  # fmt: skip
    first = await client.forward(_prompt(vocab), encoding="identity")
    out = [first.output]
    if callable(before_step):
        await before_step(first.session)
    for position in range(PROMPT, PROMPT + STEPS):
        step = np.asarray([[int(np.argmax(out[-1]))]], dtype=np.int32)
        result = await client.forward(step, session=first.session, position=position,
                                      encoding="identity")  # fmt: skip
        out.append(result.output)
    return first.session, out


async def test_a_drained_replicas_session_goes_on_by_its_kv_with_no_replay(
    checkpoint: str,
) -> None:
    want = _reference(checkpoint)
    vocab = small_config().vocab_size
    async with handoff_chain(checkpoint, ROLES_ANY) as (entries, hop, client):
        holder: list[RunningNode] = []

        async def drain_the_holder(session: str) -> None:
            holder.append(next(n for n in entries if n.url == hop.holder(session)))
            holder[0].server.request_shutdown()
            await wait_until(lambda: holder[0].server.draining, "the holder draining")

        with anyio.fail_after(60):
            session, got = await _generate(client, vocab, before_step=drain_the_holder)
        other = next(n for n in entries if n is not holder[0])
        assert hop.holder(session) == other.url
        assert hop.failover.handoffs.moved == 1 and hop.failover.handoffs.bytes > 0
        assert hop.failover.replayed_chunks == 0  # no replay: the KV moved
        # The new replica computed the decode steps only, never the prompt.
        assert other.app.tokens_computed == STEPS
        assert len(holder[0].app.table) == 0  # ended there after the move
        await wait_until(  # and the drain, with nothing left to keep, ends
            lambda: not (holder[0].server._connections or holder[0].app.table), "the drain over"
        )
    for mine, reference in zip(got, want, strict=True):
        assert np.array_equal(mine, reference)


async def test_prefill_and_decode_run_on_their_replicas_with_the_same_bits(
    checkpoint: str,
) -> None:
    want = _reference(checkpoint)
    vocab = small_config().vocab_size
    async with handoff_chain(checkpoint, ROLES_PD) as (entries, hop, client):
        await wait_until(  # registration: the roles come with the identities
            lambda: {r.kv_role for r in hop.replicas} == {"prefill", "decode"}, "the roles"
        )
        with anyio.fail_after(60):
            session, got = await _generate(client, vocab)
        prefill, decode = entries
        assert hop.holder(session) == decode.url
        assert prefill.app.tokens_computed == PROMPT  # the prompt, nothing else
        assert decode.app.tokens_computed == STEPS  # every decode step
        assert hop.failover.handoffs.moved == 1 and hop.failover.replayed_chunks == 0
        replicas = hop.describe()
        assert replicas is not None and replicas["handoff"]["moved"] == 1
        assert sorted(r["kv_role"] for r in replicas["replicas"]) == ["decode", "prefill"]
    for mine, reference in zip(got, want, strict=True):
        assert np.array_equal(mine, reference)
