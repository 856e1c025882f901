"""The link-aware ``--encoding auto`` (meshnet_runtime.link): zstd only when the
wire time it saves exceeds the codec time it costs. Pure arithmetic on the
estimates, fed by hand here; docs/multihost.md measures it across namespaces."""

from __future__ import annotations

import pytest

from meshnet_gateway import Client
from meshnet_runtime.link import MEASURE_MIN_BYTES, PROBE_EVERY, LinkAwareAuto, LinkEstimate
from support.gateway import activation, chain, same_bits

MIB = 2**20
CHUNK = 256 * 1024


def learned(link_mib_s: float, compress_mib_s: float = 400, saving: float = 0.22) -> LinkAwareAuto:
    auto = LinkAwareAuto(LinkEstimate())
    auto.link.observe(CHUNK, CHUNK, CHUNK / (link_mib_s * MIB))
    raw = CHUNK
    auto.observe_encoding(
        "auto", raw, int(raw * (1 - saving)), "zstd", raw / (compress_mib_s * MIB)
    )
    return auto


def test_unknown_link_falls_back_to_the_content_based_auto() -> None:
    auto = LinkAwareAuto(LinkEstimate())
    assert auto.pays() is None and auto.policy(CHUNK) == "auto"


def test_slow_link_sends_zstd_fast_link_sends_identity() -> None:
    assert learned(12).pays() is True  # 100 Mbit/s: 22 % saved is worth 3 ms/MiB of zstd
    assert learned(1000).pays() is False  # ~8 Gbit/s: the codec costs more than it saves
    assert learned(12, saving=0.0).pays() is False  # nothing to save
    slow, fast = learned(12), learned(1000)
    assert {slow.policy(CHUNK) for _ in range(PROBE_EVERY - 1)} == {"zstd"}
    assert {fast.policy(CHUNK) for _ in range(PROBE_EVERY - 1)} == {"identity"}
    # Then one probe (content-based auto) refreshes ratio and speed.
    assert fast.policy(CHUNK) == "auto"
    assert fast.chosen == {"identity": PROBE_EVERY - 1, "zstd": 0, "auto": 1}


def test_small_bodies_and_small_samples_are_left_to_the_content_based_auto() -> None:
    auto = learned(12)
    assert auto.policy(MEASURE_MIN_BYTES - 1) == "auto"
    before = auto.link.rate.samples
    auto.link.observe(MEASURE_MIN_BYTES - 1, 0, 1.0)  # too few bytes to time a link by
    assert auto.link.rate.samples == before


def test_answers_that_arrive_whole_before_the_first_read_mean_a_fast_link() -> None:
    auto = learned(12)
    assert auto.pays() is True
    for _ in range(10):  # 256 KiB answers, all there at the first read
        auto.link.observe(CHUNK, 0, 0.0)
    assert auto.pays() is False


def test_estimates_follow_a_link_that_changes() -> None:
    auto = learned(1000)
    for _ in range(10):  # the link is shaped: answers now arrive at ~12 MiB/s
        auto.link.observe(CHUNK, CHUNK, CHUNK / (12 * MIB))
    assert auto.pays() is True
    # An identity-only stretch teaches nothing about compression.
    auto.observe_encoding("identity", CHUNK, CHUNK, "identity", 0.001)
    assert auto.compress_rate.samples == 1
    # A probe where the core kept identity (< 10 % saved) counts as no saving.
    auto.observe_encoding("auto", CHUNK, CHUNK, "identity", CHUNK / (400 * MIB))
    assert auto.saving.value is not None and auto.saving.value < 0.22


@pytest.mark.anyio
async def test_a_node_with_auto_toward_next_measures_and_chooses() -> None:
    """In a real chain (loopback), a node with ``--encoding auto`` and a
    ``--next`` times its downstream's answers and its own compression, and
    shows what it chose in ``/info`` — every chunk still bit-exact."""
    async with chain(2, node_flags=["--encoding", "auto"],
                     gateway_flags=["--chunk-tokens", "128"]) as c:  # fmt: skip
        async with Client(c.gateway.url) as client:
            for seed in range(3):
                array = activation(512, 512, seed=seed)  # 128 KiB chunks
                result = await client.forward(array, encoding="identity")
                assert same_bits(result.output, array)
        entry = c.nodes[0].app.info()["auto_encoding"]
        assert entry["link_mib_s"] is not None and entry["compress_mib_s"] is not None
        assert sum(entry["chosen"].values()) == 3 * 4
        assert c.nodes[1].app.info()["auto_encoding"] is None  # the last stage has no --next
