"""``--encoding auto`` that knows its link: zstd only when the wire time it saves
exceeds the codec time it costs (wire-2 §5: "zstd only when it pays").

The core's ``auto`` (``meshnet_proto.encode_for_wire``) judges the content
alone: a frame that saves 10 % is sent. That is right on a slow link and
wrong on a fast one, where compressing and decompressing take longer than
sending the bytes saved (docs/multihost.md has both measured across network
namespaces). The core has no clock, so the link half lives here:

* ``LinkEstimate`` — each ``DownstreamPool`` measures the rate at which
  response bytes arrive from its downstream (bytes after the first read ÷
  the time they took: what was already buffered at the first read did not
  wait for the link). An answer of at least ``MEASURE_MIN_BYTES`` that was
  (nearly) all there at the first read came faster than this sender reads:
  it counts as ``INSTANT_RATE``. Smaller answers say nothing. An
  exponentially weighted mean of the time per byte (so an instant answer
  moves the estimate by its weight, not to infinity) smooths the samples. On a shared or
  concurrent link that is this sender's share, which is what its next chunk
  will get.
* ``LinkAwareAuto`` — per downstream, also tracks how fast this sender
  compresses and how much zstd saves on its data, from the bodies it did
  compress. It sends zstd when

      saving / link_rate  >  PAYS_MARGIN * (1 + 1 / DECODE_SPEEDUP) / compress_rate

  i.e. when the seconds per raw byte saved on the wire exceed, by a margin,
  the seconds per raw byte spent compressing here and decompressing at the
  receiver (decompression is taken as ``DECODE_SPEEDUP`` times faster than
  level-1 compression, zstd's usual ratio, since the receiver's time cannot
  be measured here). The margin is there because the two sides are not
  measured alike: compression by CPU time, the link by wall time — and on a
  fast link that is CPU-bound, answers arrive only as fast as the receiving
  processes get the CPU, so the link reads slower exactly when the machine
  is busiest, which is when compressing would hurt most (measured: without
  the margin a loaded unlimited link flipped to zstd now and then).
  Until all three estimates exist, and for one body in every
  ``PROBE_EVERY`` after, the decision is the core's content-based ``auto``,
  which compresses and so refreshes the ratio and speed estimates (the link
  estimate refreshes with every response).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LinkAwareAuto", "LinkEstimate"]

MEASURE_MIN_BYTES = 32 * 1024
# An answer that arrived whole before we read it: the link is not what limits
# us. Any rate far above what compression could beat does; this is one.
INSTANT_RATE = 4 * 2**30
PROBE_EVERY = 16
DECODE_SPEEDUP = 3.0
PAYS_MARGIN = 2.0
_ALPHA = 0.3  # weight of the newest sample in each moving average


@dataclass(slots=True)
class _Mean:
    value: float | None = None
    samples: int = 0

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - _ALPHA) * self.value + _ALPHA * sample
        self.samples += 1


@dataclass(slots=True)
class _Rate:
    """A rate averaged as time per byte (a harmonic mean): times add up, and
    one burst that arrived at once (a rate near infinity) moves it by its
    weight, not to infinity."""

    per_byte: _Mean = field(default_factory=_Mean)

    def add(self, nbytes: float, seconds: float) -> None:
        self.per_byte.add(seconds / nbytes)

    @property
    def value(self) -> float | None:
        mean = self.per_byte.value
        if mean is None:
            return None
        return 1 / mean if mean > 0 else float("inf")

    @property
    def samples(self) -> int:
        return self.per_byte.samples


@dataclass(slots=True)
class LinkEstimate:
    """Bytes per second a downstream's answers arrive at (moving average)."""

    rate: _Rate = field(default_factory=_Rate)

    def observe(self, total: int, after_first: int, seconds: float) -> None:
        """An answer of ``total`` bytes; ``after_first`` of them arrived in
        ``seconds`` after the first read."""
        if total < MEASURE_MIN_BYTES:
            return
        if after_first >= MEASURE_MIN_BYTES and seconds > 0:
            self.rate.add(after_first, seconds)
        else:
            self.rate.add(total, total / INSTANT_RATE)

    @property
    def bytes_per_second(self) -> float | None:
        return self.rate.value


@dataclass(slots=True)
class LinkAwareAuto:
    """Chooses identity or zstd per body for one downstream (see the module doc)."""

    link: LinkEstimate
    compress_rate: _Rate = field(default_factory=_Rate)  # raw bytes per second
    saving: _Mean = field(default_factory=_Mean)  # fraction of raw bytes zstd saved
    _until_probe: int = PROBE_EVERY
    chosen: dict[str, int] = field(default_factory=lambda: {"identity": 0, "zstd": 0, "auto": 0})

    def policy(self, nbytes: int) -> str:
        """The encoding policy for a body of ``nbytes`` raw bytes: ``identity``,
        ``zstd``, or ``auto`` (the core's content-based choice: a probe)."""
        verdict = self.pays()
        if verdict is None or nbytes < MEASURE_MIN_BYTES:
            choice = "auto"
        else:
            self._until_probe -= 1
            if self._until_probe <= 0:
                self._until_probe = PROBE_EVERY
                choice = "auto"
            else:
                choice = "zstd" if verdict else "identity"
        self.chosen[choice] += 1
        return choice

    def pays(self) -> bool | None:
        """Whether zstd pays on this link with this data; None while unknown."""
        link, speed, saving = (
            self.link.bytes_per_second,
            self.compress_rate.value,
            self.saving.value,
        )
        if link is None or speed is None or saving is None:
            return None
        return saving / link > PAYS_MARGIN * (1 + 1 / DECODE_SPEEDUP) / speed

    def observe_encoding(
        self, policy: str, raw: int, wire: int, encoding: str, seconds: float
    ) -> None:
        """What an encode under ``policy`` gave; learns only when it compressed."""
        if policy == "identity" or raw < MEASURE_MIN_BYTES or seconds <= 0:
            return
        # Under "auto" the core compressed and kept identity only when the
        # frame saved under 10 %: count that as no saving.
        self.saving.add(1 - wire / raw if encoding == "zstd" else 0.0)
        self.compress_rate.add(raw, seconds)

    def describe(self) -> dict[str, Any]:
        link, speed, saving = (
            self.link.bytes_per_second,
            self.compress_rate.value,
            self.saving.value,
        )
        return {
            "link_mib_s": None if link is None else round(link / 2**20, 1),
            "compress_mib_s": None if speed is None else round(speed / 2**20, 1),
            "zstd_saving": None if saving is None else round(saving, 3),
            "zstd_pays": self.pays(),
            "chosen": dict(self.chosen),
        }
